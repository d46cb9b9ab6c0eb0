"""The README's examples run as written: ``torchrun --nproc_per_node 2 examples/X.py`` on 2
CPU ranks (gloo, host transport).

Each script checks itself against the collective run (outputs, or every step's loss) and
exits non-zero when they differ; here we also read what it printed: rank 0's
``explain()`` table must show every weight bound by the copy-engine path, by its
parameter name, and both ranks must report the match.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan")  # its modules then import, or the file fails loudly

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS = ["0.weight", "0.bias", "2.weight", "2.bias"]  # the examples' two Linear layers
TIMEOUT = 300  # a hang, not slowness: the pair takes ~70 s on 2 loaded cores


def run_example(name: str, tmp_path) -> str:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", name)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{name} hung past {TIMEOUT} s:\n{out[-6000:]}")
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def bound_weights(out: str) -> list[str]:
    """The parameter names explain() lists as bound (``  bound    0.weight  ...``)."""
    return re.findall(r"^\s+bound\s+(\S+)\s", out, re.M)


def check(out: str, what: str) -> None:
    assert "host transport" in out, out
    bound = bound_weights(out)
    assert set(WEIGHTS) <= set(bound), f"explain() does not show every weight bound: {bound}\n{out}"
    assert not re.search(r"^\s+(refused|fallback)\s", out, re.M), out
    for rank in (0, 1):
        assert f"rank {rank}: {what} match the gloo run" in out, out


def test_inference_example(tmp_path):
    check(run_example("inference.py", tmp_path), "outputs")


def test_training_example(tmp_path):
    out = run_example("training.py", tmp_path)
    check(out, "losses")
    assert "staging slot, bfloat16" in out, out  # the param_dtype cast is what peers read


def test_the_checks_can_fail():
    sample = "graph 1: 1 weight(s)\n  bound    0.weight   1 B  window 0 @ 0\n  refused  0.bias  why\n"
    assert bound_weights(sample) == ["0.weight"]
    with pytest.raises(AssertionError):
        check(sample + "host transport\nrank 0: outputs match the gloo run\n", "outputs")


def check_fsdp2(out: str, what: str) -> None:
    """The FSDP2 examples: every param group on the copy engines, both ranks matched."""
    assert "host transport" in out, out
    assert re.search(r"^fsdp2 coverage: 100\.0% of ", out, re.M), out
    assert not re.search(r"^\s+refused\s", out, re.M), out
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: {what} match the gloo run", out), out


@pytest.mark.slow  # ~15 s each on 2 cores
def test_fsdp2_inference_example(tmp_path):
    out = run_example("fsdp2_inference.py", tmp_path)
    check_fsdp2(out, "outputs")
    assert "cast slot (bfloat16)" in out, out


@pytest.mark.slow  # ~15 s each on 2 cores
def test_fsdp2_training_example(tmp_path):
    out = run_example("fsdp2_training.py", tmp_path)
    check_fsdp2(out, "losses")
    assert "staged (training)" in out, out
