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
    """``@pytest.mark.slow`` cases run only with TORCH_CE_SLOW=1 (``testenv.SLOW``), or
    those TORCH_CE_RUN_SLOW names (``testenv.RUN_SLOW``)."""
    import fnmatch

    if testenv.SLOW:
        return
    skip = pytest.mark.skip(reason="slow: set TORCH_CE_SLOW=1")
    for item in items:
        if "slow" in item.keywords and not any(fnmatch.fnmatch(item.nodeid, g) for g in testenv.RUN_SLOW):
            item.add_marker(skip)


# Reasons a file of TORCH_CE_NO_SKIP may still skip a case for: a slow case, no GPU or no
# kernels (the CUDA files), and torchtitan's graph_trainer not importable on this torch
# (graph_trainer_harness.importable: torchtitan absent, or a torch feature it imports
# absent, named). Anything else (an import that moved, a feature test gone wrong) fails.
ALLOWED_SKIPS = ("slow: set TORCH_CE_SLOW=1", "needs a CUDA GPU", "the C++ gather kernels are not built")
_strict_skips: list[str] = []


def _allowed_skip(nodeid: str, reason: str) -> bool:
    if any(a in reason for a in ALLOWED_SKIPS):
        return True
    if "graph_trainer" in os.path.basename(nodeid.split("::")[0]):
        import graph_trainer_harness as H

        why = H.importable()
        return why is not None and why in reason
    return False


def _note_skip(report) -> None:
    import fnmatch

    if not testenv.NO_SKIP or not report.skipped:
        return
    path = report.nodeid.split("::")[0]
    if not any(fnmatch.fnmatch(os.path.basename(path), g) for g in testenv.NO_SKIP):
        return
    reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
    if not _allowed_skip(report.nodeid, reason):
        _strict_skips.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report):
    _note_skip(report)  # a module-level skip


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus):
    """TORCH_CE_NO_SKIP: a skip not in ``ALLOWED_SKIPS`` fails the run."""
    if _strict_skips:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = ["TORCH_CE_NO_SKIP: these skipped although this torch supports them:", *_strict_skips]
        if tr is not None:
            tr.write_line("\n".join(lines), red=True)
        else:
            print("\n".join(lines))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
