"""vote(): the bool-only AND of the ranks' eligibility (superseded by sync()).

Across gloo processes it is checked by tests/policy/test_sync.py, whose workers
vote beside their sync trials.
"""

from __future__ import annotations

import subprocess
import sys


def test_vote_without_a_process_group_is_local_and_imports_no_torch() -> None:
    code = ("import sys; from attnreg.graph_policy import vote; "
            "assert vote(True) is True and vote(False) is False; "
            "assert 'torch' not in sys.modules; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_vote_with_torch_imported_but_no_group_is_local() -> None:
    import torch.distributed as dist

    from attnreg.graph_policy import vote

    assert not dist.is_initialized()
    assert vote(True) is True and vote(False) is False
