"""Make ``torch_ce`` importable from the source tree when it is not pip-installed; the tests'
switches (``testenv``) are read before it; ``@pytest.mark.slow`` runs only with TORCH_CE_SLOW=1."""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import testenv  # noqa: E402,F401  (first: the tests' switches leave the environment before torch_ce reads it)

try:
    import torch_ce  # noqa: F401
except ImportError:
    sys.path.insert(0, _ROOT)


import dataclasses  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_torch_ce_config():
    """enable(**overrides) changes the global config: give each test a clean one."""
    import torch_ce

    saved = dataclasses.asdict(torch_ce.config)
    yield
    for k, v in saved.items():
        setattr(torch_ce.config, k, v)


@pytest.fixture(autouse=True)
def no_shm_left():
    """No /dev/shm/torch_ce_* segment of ours survives a test (the host transport unlinks
    its names at publish time)."""
    import glob

    pattern = "/dev/shm/torch_ce_*"
    before = set(glob.glob(pattern))
    yield
    left = set(glob.glob(pattern)) - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.slow`` cases run only with TORCH_CE_SLOW=1 (``testenv.SLOW``)."""
    if testenv.SLOW:
        return
    skip = pytest.mark.skip(reason="slow: set TORCH_CE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
