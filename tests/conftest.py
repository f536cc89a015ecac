"""Project-wide test setup.

Triton kernels run under the CPU interpreter when no GPU is present, so CI
without a GPU still exercises the real kernels.  TRITON_INTERPRET must be set
before triton is first imported, hence here at conftest import time.
"""

from __future__ import annotations

import os

import pytest

# Never pick up the developer's own third-party attnreg plugins by accident:
# tests that need entry points opt in explicitly.
os.environ.setdefault("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none detected)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
