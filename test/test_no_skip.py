"""``TORCH_CE_NO_SKIP`` (test/conftest.py; .ci/legs.sh sets it for graph_trainer's test
files on every CI leg): a skip in a named file fails the run unless its reason is one
``conftest.ALLOWED_SKIPS`` lists (a slow case, no GPU, no kernels) or graph_trainer not
importable on this torch, named. A pytest of its own on a file that skips, per reason."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _pytest(tmp_path, reason: str, no_skip: str) -> subprocess.CompletedProcess:
    f = tmp_path / "test_graph_trainer_stand_in.py"
    f.write_text("import pytest\n\n\ndef test_one():\n    assert 1\n\n\n"
                 f"def test_skipped():\n    pytest.skip({reason!r})\n")
    env = {**os.environ, "TORCH_CE_NO_SKIP": no_skip, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", str(f)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("reason, no_skip, fails", [
    ("torchtitan.experiments.graph_trainer.simple_fsdp moved", "test_graph_trainer*.py", True),
    ("slow: set TORCH_CE_SLOW=1", "test_graph_trainer*.py", False),
    ("needs a CUDA GPU", "test_graph_trainer*.py", False),
    ("torchtitan.experiments.graph_trainer.simple_fsdp moved", "", False),  # not asked for
    ("torchtitan.experiments.graph_trainer.simple_fsdp moved", "test_other*.py", False),  # another file
])
def test_a_skip_fails_only_where_asked(tmp_path, reason, no_skip, fails):
    r = _pytest(tmp_path, reason, no_skip)
    out = r.stdout + r.stderr
    assert "1 passed, 1 skipped" in out, out
    assert (r.returncode == 1) == fails and r.returncode in (0, 1), (r.returncode, out)
    assert ("skipped although this torch supports them" in out) == fails, out
