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


#: Fixture scopes that set up once per module (or class): under pytest-xdist every worker
#: that runs one of the module's tests sets them up again.
_SHARED_SCOPES = frozenset({"module", "class", "package"})


def _shared_fixture_groups(items: list[pytest.Item]) -> dict[str, str]:
    """nodeid -> an xdist group for each test that uses a module-, class- or package-scoped
    fixture: the tests of one file that share such a fixture (directly or through another
    test's fixtures: union-find over the fixture names) get one group, so that with
    ``--dist loadgroup`` (the Makefile's) one worker runs them and the fixture is set up
    once, not once per worker (test_planted's conformance runs took minutes each)."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    uses: dict[str, list[str]] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        path = item.nodeid.split("::", 1)[0]
        keys = [f"{path}::{name}" for name, defs in getattr(info, "name2fixturedefs", {}).items()
                if defs and defs[-1].scope in _SHARED_SCOPES]
        for key in keys[1:]:
            parent[find(key)] = find(keys[0])
        if keys:
            uses[item.nodeid] = keys
    return {nodeid: find(keys[0]) for nodeid, keys in uses.items()}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = _shared_fixture_groups(items)
    for item in items:
        group = groups.get(item.nodeid)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none detected)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
