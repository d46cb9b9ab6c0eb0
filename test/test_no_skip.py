"""``TORCH_CE_NO_SKIP`` (test/conftest.py; .ci/legs.sh sets it for graph_trainer's test
files on every CI leg): a skip in a named file fails the run unless its reason is one
``conftest.ALLOWED_SKIPS`` lists (a slow case, no GPU, no kernels) or graph_trainer not
importable on this torch, named. A pytest of its own on stand-in files that skip."""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MOVED = "torchtitan.experiments.graph_trainer.simple_fsdp moved"


def _pytest(tmp_path, no_skip: str) -> subprocess.CompletedProcess:
    for name, reasons in (("test_graph_trainer_stand_in.py", (MOVED, "slow: set TORCH_CE_SLOW=1", "needs a CUDA GPU")),
                          ("test_other_stand_in.py", (MOVED,))):
        body = "import pytest\n\n\ndef test_runs():\n    assert 1\n"
        for i, why in enumerate(reasons):
            body += f"\n\ndef test_skipped_{i}():\n    pytest.skip({why!r})\n"
        (tmp_path / name).write_text(body)
    env = {**os.environ, "TORCH_CE_NO_SKIP": no_skip,
           "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "."],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_skip_fails_only_where_asked(tmp_path):
    r = _pytest(tmp_path, "test_graph_trainer*.py")
    out = r.stdout + r.stderr
    assert "2 passed, 4 skipped" in out and r.returncode == 1, (r.returncode, out)
    listed = out[out.index("skipped although this torch supports them"):]
    assert f"test_graph_trainer_stand_in.py::test_skipped_0: Skipped: {MOVED}" in listed, out
    assert "test_skipped_1" not in listed and "test_skipped_2" not in listed, out  # slow, no GPU
    assert "test_other_stand_in" not in listed, out  # not a file it names
    r = _pytest(tmp_path, "")
    assert r.returncode == 0 and "skipped although" not in r.stdout + r.stderr, r.stdout + r.stderr
