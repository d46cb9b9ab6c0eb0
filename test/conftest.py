"""Make ``torch_ce`` importable from the source tree when it is not pip-installed; the tests'
switches (``testenv``) are read before it; ``@pytest.mark.slow`` runs only with TORCH_CE_SLOW=1.

Each test process (a plain run, or one pytest-xdist worker) gets, before torch_ce reads its
environment, its own ``shm_prefix`` (the host transport's /dev/shm names; ``no_shm_left``
checks only these) and its own calibration cache (``cost_cache_dir``, never the user's
``~/.cache/torch_ce``). Every rank, torchrun job or script a test starts inherits both."""
import atexit
import os
import shutil
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import testenv  # noqa: E402,F401  (first: the tests' switches leave the environment before torch_ce reads it)

SHM_PREFIX = f"torch_ce_p{os.getpid()}_"  # unique among the processes alive on this host
os.environ["TORCH_CE_SHM_PREFIX"] = SHM_PREFIX
_COST_DIR = tempfile.mkdtemp(prefix=f"torch_ce_cost_p{os.getpid()}_")
os.environ["TORCH_CE_COST_CACHE_DIR"] = _COST_DIR
atexit.register(shutil.rmtree, _COST_DIR, True)

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
    """No /dev/shm segment of this test process (``SHM_PREFIX``: its ranks' too) survives a
    test: the host transport unlinks its names at publish time. Other processes' segments
    (xdist workers, other jobs) are not looked at. Every segment of ours counts, also one
    left by a module fixture set up for this test; leftovers are reported, then removed."""
    import glob

    yield
    left = sorted(glob.glob(f"/dev/shm/{SHM_PREFIX}*"))
    for path in left:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    assert not left, f"shared-memory segments left behind: {left}"


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.slow`` cases run only with TORCH_CE_SLOW=1 (``testenv.SLOW``)."""
    if testenv.SLOW:
        return
    skip = pytest.mark.skip(reason="slow: set TORCH_CE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
