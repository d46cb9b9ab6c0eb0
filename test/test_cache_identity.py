"""torch_ce's compile-cache identity (passes/identity.py) covers its code and its config.

Inductor's FX graph cache keys a compiled graph on our post-grad pass's ``uuid()`` and on
the pickled reorder entry. Both must change when any module that shapes the compiled graph
or its schedule changes, and when any config value that changes what we emit does. CPU, no
process group.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import pkgutil
import shutil
import subprocess
import sys
import textwrap

import pytest

import torch_ce
from torch_ce.passes import identity, install, reorder


def _keys():
    return install._pass.uuid(), pickle.dumps(reorder.LatestSafeLaunch())


def test_modules_cover_every_pass_and_the_named_modules():
    import torch_ce.passes as P

    passes = {f"torch_ce.passes.{m.name}" for m in pkgutil.iter_modules(P.__path__)}
    named = {"torch_ce.inductor_lowering", "torch_ce.ops", "torch_ce.fake_impls",
             "torch_ce.runtime.eligibility", "torch_ce.config"}
    assert sorted((passes | named) - set(identity.MODULES)) == []
    assert len(set(identity.MODULES)) == len(identity.MODULES)


# Run in a copy of the package, in a fresh interpreter: edit each listed module on disk (one
# line appended), recompute both keys, put the module back.
_EDIT_EACH_MODULE = textwrap.dedent("""
    import importlib, json, pickle, sys
    root = sys.argv[1]
    sys.path.insert(0, root)
    import torch_ce
    assert torch_ce.__file__.startswith(root), torch_ce.__file__
    from torch_ce.passes import identity, install, reorder

    def keys():
        identity.code_identity.cache_clear()
        return install._pass.uuid(), pickle.dumps(reorder.LatestSafeLaunch()).hex()

    base, out = keys(), {}
    for name in identity.MODULES:
        path = importlib.import_module(name).__file__
        src = open(path).read()
        with open(path, "w") as f:
            f.write(src + "\\n# one more line\\n")
        try:
            uuid, pickled = keys()
        finally:
            with open(path, "w") as f:
                f.write(src)
        out[name] = [uuid != base[0], pickled != base[1], keys() == base]
    print(json.dumps(out))
""")


def test_an_edit_to_any_listed_module_changes_both_keys(tmp_path):
    src = os.path.dirname(torch_ce.__file__)
    shutil.copytree(src, tmp_path / "torch_ce", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    script = tmp_path / "edit_each.py"
    script.write_text(_EDIT_EACH_MODULE)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    res = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                         text=True, timeout=240, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted(out) == sorted(identity.MODULES)
    # Per module: uuid changed, pickled reorder changed, both back once the edit is undone.
    assert {name: v for name, v in out.items() if v != [True, True, True]} == {}


def _other_value(name, value):
    if name == "transport":
        return "nccl" if value == "copy_engine" else "copy_engine"
    if name == "cost_mode":
        return "default" if value == "calibrated" else "calibrated"
    if name == "reduce_scatter":
        return "copy_engine" if value == "collective" else "collective"
    if isinstance(value, bool):
        return not value
    if value is None:  # bool | None ("auto"): an explicit value
        return True
    return value + 1.0


@pytest.mark.parametrize("name", [k for k, _ in torch_ce.config.cache_key()])
def test_every_cache_key_field_changes_both_keys(name):
    before = _keys()
    with torch_ce.config.patch(**{name: _other_value(name, getattr(torch_ce.config, name))}):
        after = _keys()
    assert after[0] != before[0] and after[1] != before[1]
    assert _keys() == before


# Run-time-only settings: they change what a bind or a calibration does, never the graph.
RUN_TIME_ONLY = {"cost_cache_dir", "bind_timeout_s", "bind_arrival_timeout_s", "bind_readback", "cuda_torch_fallback", "shm_prefix",
                 "rs_workspace_cap_mib", "rs_timeout_s", "eager_gathers", "rs_native",
                 "rs_host_flags", "fsdp2_timeout_s"}


def test_cache_key_is_every_field_but_the_run_time_ones():
    """A new config field is in the key unless it is left out here on purpose."""
    fields = {f.name for f in dataclasses.fields(torch_ce.config)}
    assert {k for k, _ in torch_ce.config.cache_key()} == fields - RUN_TIME_ONLY


@pytest.mark.parametrize("transport,reorder", [("copy_engine", True), ("copy_engine", False),
                                               ("nccl", True), ("nccl", False)])
def test_rank_view_enters_the_key_for_both_transports(transport, reorder, monkeypatch):
    """What differs per rank (NOTE [a cache shared by ranks]) changes what Inductor hashes
    for every enable(): the installed pass's uuid and, with the reorder, its pickle."""
    import torch._inductor.config as ic

    def hashed():
        p = ic.post_grad_custom_post_pass
        return p.uuid(), pickle.dumps(ic.reorder_for_compute_comm_overlap_passes)

    torch_ce.enable(transport=transport, reorder=reorder)
    try:
        monkeypatch.setattr(identity, "rank_view", lambda: "rank A")
        a = hashed()
        monkeypatch.setattr(identity, "rank_view", lambda: "rank B")
        b = hashed()
    finally:
        torch_ce.disable()
    assert a[0] != b[0]
    assert (a[1] != b[1]) == reorder


def test_rank_view_outside_a_compile_is_stable_and_empty_without_a_group():
    """No tracing context and no process group: nothing per rank to add."""
    assert identity.rank_view() == identity.rank_view() == ""
