"""Inside an engine, a bridge logs the policy's trace once, on the engine's logger.

``resolve()`` logs each decision on ``attnreg.graph_policy`` itself; a bridge that
reports the same decisions through the engine's logger (sglang's, vLLM's) runs
``resolve()`` inside :func:`policy_log_silenced` so each line appears once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["policy_log_silenced"]


class _Silence(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextmanager
def policy_log_silenced() -> Iterator[None]:
    """Drop records of the ``attnreg.graph_policy`` logger while the block runs."""
    policy_logger = logging.getLogger("attnreg.graph_policy")
    silence = _Silence()
    policy_logger.addFilter(silence)
    try:
        yield
    finally:
        policy_logger.removeFilter(silence)
