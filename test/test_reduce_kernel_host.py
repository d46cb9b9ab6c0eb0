"""The native reduce-scatter path's CPU-checkable parts (NOTE [native reduce-scatter path]
in csrc/ce_reduce_scatter.cu, NOTE [reduction kernel] in csrc/ce_reduce.cu): no GPU here.

- ``test_triton_kernel_is_the_reference_in_fp32``: the Triton reduction
  (runtime/reduce_scatter/reduce_triton.py) run by Triton's interpreter on CPU tensors
  equals ``reference._reduce`` bit for bit (sum and premul_sum at worlds 2, 3 and 4, members
  at unaligned offsets; avg at world 2, and at world 3 against the sum times fp32(1/3),
  what ``_reduce``'s ``div_`` computes on CUDA). Skipped without triton and numpy (the
  interpreter needs numpy; the interpreter's bf16 cast truncates, so bf16 is the GPU
  test's).
- ``test_fallback_reduces_like_the_reference``: ``reduce_fallback`` (what the native
  completion calls without the CUDA kernel) on CPU tensors: ``_reduce``'s numbers, the
  premul factor carried exactly.
- ``test_address_tables``: the integers ``workspace._native_view`` hands to C++ are the
  words the Python ``CudaFlags`` path waits on and writes, table by table.
- ``test_host_flag_tables_carry_the_poison_words``: with host-mapped flags (runtime/
  reduce_scatter/host_flags.py) the tables are the segments' words, and the two poison
  words follow.
- ``test_watchdog_release_writes``: what the watchdog writes to release a call, on each
  kind of workspace: host-mapped flags get the call's tag in its half's poison word, then
  the awaited flags, then RETRACT in the peers' data flags (none on a mismatch); device
  flags get, in stream order, NaN into each awaited slice before its flag, then the
  RETRACTs (the library's writes recorded here).
- ``test_on_by_default_never_on_cpu``: ``rs_native`` is on; a CPU torch never takes it.
- ``test_watchdog_frees_its_calls_before_it_leaves``: a call's last reference dropped
  by the watchdog is freed while the atexit join still covers the thread.
- ``test_watchdog_starts_a_native_calls_deadline_at_its_completion``: the watchdog's
  deadline of a native call runs from its completion's start (the C++ stage), not its
  launch; a done call leaves the watch.
- ``test_rs_cost_dry_run``: bench/rs_cost.py's plan and table without a GPU.
- ``test_rs_cost_replot``: its ``--replot`` prints a saved result's table (and its PNG).
- ``test_no_kernel_in_the_host_compiled_source``: csrc/ce_reduce_scatter.cu (and the
  library's other host sources) is also built by the host C++ compiler: no ``__global__``
  there.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sources(w, n_members, dtype, gen, index, cap=4096):
    recv = torch.randn(w, cap, generator=gen).to(dtype)
    ns = [1000, 333, 7][:n_members]
    inputs = [torch.randn(w * n, generator=gen).to(dtype) for n in ns]
    owns = [x[index * n:(index + 1) * n] for x, n in zip(inputs, ns, strict=True)]
    offs, off = [], 0
    for n in ns:
        offs.append(off)
        off += n
    return recv, owns, offs


def _reference(recv, owns, offs, index, reduce_op):
    from torch_ce.runtime.reduce_scatter.reference import _reduce

    w = recv.shape[0]
    outs = []
    for own, off in zip(owns, offs, strict=True):
        n = own.numel()
        out = torch.empty_like(own)
        _reduce([own if j == index else recv[j, off:off + n] for j in range(w)], out, reduce_op, w)
        outs.append(out)
    return outs


_INTERPRET = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
sys.path.insert(0, sys.argv[1])
from torch_ce.runtime.reduce_scatter import reduce_triton as RT
from torch_ce.runtime.reduce_scatter.reference import _reduce
gen = torch.Generator().manual_seed(7)
bad = []
for w in (2, 3, 4):
    for op, name in ((0, "sum"), (1, "avg"), (2, "premul_sum(0.1)")):
        index = w - 2
        recv = torch.randn(w, 4096, generator=gen)
        ns = (1000, 333, 7)
        inputs = [torch.randn(w * n, generator=gen) for n in ns]
        owns = [x[index * n:(index + 1) * n] for x, n in zip(inputs, ns)]
        offs = [0, 1000, 1333]
        outs = [torch.empty(n) for n in ns]
        RT.reduce(owns, outs, recv, index, offs, op, 0.1)
        for own, off, out in zip(owns, offs, outs):
            n = own.numel()
            srcs = [own if j == index else recv[j, off:off + n] for j in range(w)]
            ref = torch.empty(n)
            if name == "avg":  # _reduce on CUDA: the sum times fp32(1 / W) (torch's div_ by a scalar)
                _reduce(srcs, ref, "sum", w)
                ref = ref * torch.tensor(1.0 / w, dtype=torch.float32)
            else:
                _reduce(srcs, ref, name, w)
            if not torch.equal(ref, out):
                bad.append((w, name, n, float((ref - out).abs().max())))
print("BAD", bad)
"""


def test_triton_kernel_is_the_reference_in_fp32():
    from torch_ce.runtime.reduce_scatter import reduce_triton

    why = reduce_triton.unavailable()
    if why is not None or importlib.util.find_spec("numpy") is None:
        pytest.skip(f"Triton's interpreter needs triton and numpy ({why or 'numpy is not installed'})")
    p = subprocess.run([sys.executable, "-c", _INTERPRET, ROOT], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "BAD []" in p.stdout, p.stdout[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3])
def test_fallback_reduces_like_the_reference(dtype, world):
    from torch_ce.runtime import reduce_scatter as RS
    from torch_ce.runtime.reduce_scatter import spec as S

    gen = torch.Generator().manual_seed(3 + world)
    for reduce_op in ("sum", "avg", "premul_sum(0.1)", "premul_sum(0.333333333333)"):
        index = world - 1
        recv, owns, offs = _sources(world, 3, dtype, gen, index)
        op, factor = S.op_code(reduce_op)
        outs = [torch.empty_like(o) for o in owns]
        RS.reduce_fallback(owns, outs, recv, index, offs, op, factor)
        for o, e in zip(outs, _reference(recv, owns, offs, index, reduce_op), strict=True):
            assert torch.equal(o, e), (reduce_op, dtype, world)
    assert S.op_code("avg") == (1, 1.0) and S.op_code("premul_sum(0.25)") == (2, 0.25)


def test_address_tables(monkeypatch):
    from torch_ce.runtime import native
    from torch_ce.runtime.reduce_scatter import flags as RF, workspace as RW

    w, cap = 3, 1024
    recvs = [torch.zeros(2, w, cap) for _ in range(w)]
    flags = [torch.zeros(2, 2, w, dtype=torch.int32) for _ in range(w)]
    heads = [torch.zeros(2, w, 2, dtype=torch.int32) for _ in range(w)]
    i = 1
    ws = RW.Workspace((tuple(range(w)), "torch.float32", "cuda", "k", i), i, cap, torch.float32, recvs[i],
                      flags[i], recvs, flags, [], "", head=heads[i], peer_head=heads)
    got = {}
    monkeypatch.setattr(native, "rs_workspace", lambda *a: got.setdefault("args", a) and "handle")

    class _S:
        cuda_stream = 0

    ws.streams = (_S(), _S())  # a CUDA workspace's own (made with it)
    assert RW._native_view(ws) == "handle"
    addrs, world, index, c, dtype, device = got["args"][:6]
    assert (world, index, c, dtype, device) == (w, i, cap, torch.float32, None)  # CPU tensors here
    assert len(addrs) == 8 * 2 * w
    DATA, FREE = RF.DATA, RF.FREE

    def t(k, h, j):
        return addrs[(k * 2 + h) * w + j]

    for h in (0, 1):
        for j in range(w):
            assert t(0, h, j) == flags[i][DATA, h, j].data_ptr()  # waited on: the call's tag
            assert t(1, h, j) == flags[i][FREE, h, j].data_ptr()  # waited on: 1
            assert t(7, h, j) == recvs[i][h, j].data_ptr()  # reduced from
            if j == i:
                assert all(t(k, h, j) == 0 for k in range(2, 7))
                continue
            assert t(2, h, j) == flags[j][DATA, h, i].data_ptr()  # the tag, after the push
            assert t(3, h, j) == flags[j][FREE, h, i].data_ptr()  # 1, after the reduction
            assert t(4, h, j) == heads[j][h, i, 0].data_ptr()  # seq
            assert t(5, h, j) == heads[j][h, i, 1].data_ptr()  # numel
            assert t(6, h, j) == recvs[j][h, i].data_ptr()  # the push's destination


def _host_flag_workspaces(w: int, cap: int, tmp: str) -> list:
    """``w`` workspaces whose words live in host flag segments (``open_group`` as the
    loopback tests use it, not registered with CUDA), slices in plain CPU tensors."""
    from torch_ce.runtime.reduce_scatter import host_flags as HF, workspace as RW

    segs = HF.open_group(None, [os.path.join(tmp, f"flags_{r}") for r in range(w)], 0, register=False)
    recvs = [torch.zeros(2, w, cap) for _ in range(w)]
    return [RW.Workspace((tuple(range(w)), "float32", "cuda", "k", r), r, cap, torch.float32, recvs[r],
                         segs[r].flags, recvs, [s.flags for s in segs], list(segs), "", head=segs[r].head,
                         peer_head=[s.head for s in segs], poison=segs[r].poison) for r in range(w)]


def test_host_flag_tables_carry_the_poison_words(monkeypatch, tmp_path):
    from torch_ce.runtime import native
    from torch_ce.runtime.reduce_scatter import workspace as RW

    w, i = 3, 2
    wss = _host_flag_workspaces(w, 256, str(tmp_path))
    got = {}
    monkeypatch.setattr(native, "rs_workspace", lambda *a: got.setdefault("args", a) and "handle")

    class _S:
        cuda_stream = 0

    wss[i].streams = (_S(), _S())
    RW._native_view(wss[i])
    addrs = got["args"][0]
    assert len(addrs) == 8 * 2 * w + 2
    assert addrs[-2:] == [wss[i].poison[0].data_ptr(), wss[i].poison[1].data_ptr()]
    assert addrs[(0 * 2 + 1) * w + 0] == wss[i].flags[0, 1, 0].data_ptr()  # own data[1, 0]
    assert addrs[(2 * 2 + 0) * w + 1] == wss[1].flags[0, 0, i].data_ptr()  # peer 1's data[0, i]
    assert not os.listdir(tmp_path)  # every name unlinked once opened


def _released_call(ws, half, tag):
    from torch_ce.runtime.reduce_scatter.call import Call

    return Call(ws, half, [], [], [], [], "sum", "bucket", 0, seq=5, numel=8, tag=tag, native="h")


@pytest.mark.parametrize("mismatch", [False, True])
def test_watchdog_release_writes(monkeypatch, tmp_path, mismatch):
    from torch_ce.runtime import native
    from torch_ce.runtime.reduce_scatter import flags as RF, watchdog as WD, workspace as RW

    w, i, h, tag = 3, 1, 1, 0x1234567
    stuck = [(RF.FREE, 2, 1), (RF.DATA, 2, tag), (RF.DATA, 0, tag)]
    wss = _host_flag_workspaces(w, 64, str(tmp_path))
    ws = wss[i]
    WD._release_host_flags(ws, _released_call(ws, h, tag), stuck, mismatch)
    assert ws.poison.tolist() == [0, tag]
    assert ws.flags[RF.FREE, h, 2] == 1 and ws.flags[RF.DATA, h, 2] == tag and ws.flags[RF.DATA, h, 0] == tag
    assert ws.flags[RF.DATA, 1 - h].tolist() == [0, 0, 0]  # the other half untouched
    for j in (0, 2):
        assert int(wss[j].flags[RF.DATA, h, i]) == (0 if mismatch else RF.RETRACT)
    # Device flags: the same release through the library's own-stream writes, recorded.
    writes = []
    monkeypatch.setattr(native, "host_write_words",
                        lambda addr, value, count, width, method: writes.append((addr, value, count, width)) or 0)
    flags = [torch.zeros(2, 2, w, dtype=torch.int32) for _ in range(w)]
    recvs = [torch.zeros(2, w, 64) for _ in range(w)]
    dws = RW.Workspace((tuple(range(w)), "float32", "cuda", "k2", i), i, 64, torch.float32, recvs[i], flags[i],
                       recvs, flags, [], "")
    WD._release_device_flags(dws, _released_call(dws, h, tag), stuck, mismatch)
    nan = (0x7FC00000, 8, 4)
    want = [(flags[i][RF.FREE, h, 2].data_ptr(), 1, 1, 4),
            (recvs[i][h, 2].data_ptr(), *nan), (flags[i][RF.DATA, h, 2].data_ptr(), tag, 1, 4),
            (recvs[i][h, 0].data_ptr(), *nan), (flags[i][RF.DATA, h, 0].data_ptr(), tag, 1, 4)]
    if not mismatch:
        want += [(flags[j][RF.DATA, h, i].data_ptr(), RF.RETRACT, 1, 4) for j in (0, 2)]
    assert writes == want


def test_on_by_default_never_on_cpu():
    import torch_ce
    from torch_ce.runtime import native
    from torch_ce.runtime.reduce_scatter import launch as L

    assert torch_ce.config.rs_native is True
    assert L.native_path() == native.has_rs_native()  # a CPU torch: never
    if torch.version.cuda is None:
        assert not L.native_path()
    with torch_ce.config.patch(rs_native=False):
        assert not L.native_path()


def test_no_kernel_in_the_host_compiled_source():
    for name in ("ce_ops.cu", "ce_gather.cu", "ce_reduce_scatter.cu", "ce_flags.cu"):
        with open(os.path.join(ROOT, "csrc", name)) as f:
            src = f.read()
        assert "__global__" not in src and "<<<" not in src, name
    with open(os.path.join(ROOT, "csrc", "ce_reduce.h")) as f:
        assert "__global__" not in f.read()


def _rs_cost():
    spec = importlib.util.spec_from_file_location("rs_cost", os.path.join(ROOT, "bench", "rs_cost.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rs_cost_dry_run(tmp_path):
    """bench/rs_cost.py without a GPU: its plan (worlds x dtypes x sizes), written as JSON,
    and its table of a result with a path missing (a library without rs_native)."""
    import json

    mod = _rs_cost()
    out = mod.main(["--dry-run", "--out", str(tmp_path)])
    got = json.loads((tmp_path / "rs_cost.json").read_text())
    assert got == json.loads(json.dumps(out)) and got["dry_run"]
    assert {(r["world"], r["dtype"], r["mib"]) for r in got["rows"]} == {
        (w, d, m) for w in (2, 3) for d in ("float32", "bfloat16") for m in (1.0, 16.0, 64.0)}
    assert got["paths"] == ["functional", "python", "native"]
    row = dict(world=2, dtype="float32", mib=1.0, functional=dict(host_us_per_rank_call=30.0),
               python=dict(host_us_per_rank_call=300.0), native=None, copy_GBps=3000.0)
    text = mod.table(dict(rows=[row]))
    assert "300.0" in text and "30.0" in text and text.count("\n") == 2
    # a loop at the GPU's pace is marked: its host median under 1.1x the GPU's own time
    paced = dict(world=3, dtype="float32", mib=16.0,
                 functional=dict(host_us_per_rank_call=50.0, gpu_busy_us_per_rank_call=20.0),
                 native=dict(host_us_per_rank_call=190.0, gpu_busy_us_per_rank_call=200.0, paired_ratio=1.3),
                 python=None)
    mod._ratios(paced)
    assert paced["native"]["gpu_paced"] and not paced["functional"]["gpu_paced"]
    assert paced["native"]["host_over_functional"] == pytest.approx(3.8)
    line = mod.table(dict(rows=[paced])).splitlines()[1]
    assert "200.0*" in line and "1.30" in line
    # a GPU time measured while the host fell behind the spin is not valid: never "paced"
    paced["native"]["gpu_busy_valid"] = False
    mod._ratios(paced)
    assert not paced["native"]["gpu_paced"]
    assert "200.0?" in mod.table(dict(rows=[paced])).splitlines()[1]
    with pytest.raises(SystemExit):
        mod.parse(["--dtypes", "float16"])


def test_rs_cost_replot(tmp_path, capsys):
    """``--replot`` reads a saved result without a GPU and prints its table, each row's
    paired ratio and kernel ratio as measured (random here), and draws the PNG beside it
    where matplotlib is installed."""
    import json
    import random

    mod = _rs_cost()
    rng = random.Random()
    rows = []
    for w, d, m in ((2, "float32", 16.0), (3, "bfloat16", 64.0)):
        nat = dict(host_us_per_rank_call=rng.uniform(50, 200), gpu_busy_us_per_rank_call=rng.uniform(10, 40),
                   paired_ratio=rng.uniform(0.5, 1.4))
        rows.append(dict(world=w, dtype=d, mib=m, functional=dict(host_us_per_rank_call=rng.uniform(40, 150),
                                                                gpu_busy_us_per_rank_call=rng.uniform(5, 20)),
                         python=dict(host_us_per_rank_call=rng.uniform(300, 900),
                                     gpu_busy_us_per_rank_call=rng.uniform(20, 60)),
                         native=nat,
                         kernel_over_copy=rng.uniform(0.6, 0.95)))
    for r in rows:
        mod._ratios(r)
    saved = tmp_path / "runX_rs_cost.json"
    saved.write_text(json.dumps(dict(device="cpu test", rows=rows)))
    out = mod.main(["--replot", str(saved)])
    assert out["rows"] == rows
    lines = capsys.readouterr().out.splitlines()
    for r, line in zip(rows, lines[1:3]):
        assert f"{r['native']['paired_ratio']:6.2f}" in line and f"{r['kernel_over_copy']:6.2f}" in line
        assert line.split()[:3] == [str(r["world"]), r["dtype"], f"{r['mib']:g}"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "runX_rs_cost.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        mod.parse(["--members", "0"])
    # --members: whole rows per rank in every member, the size split over them
    assert mod.parse(["--members", "8"]).members == 8
    assert [mod._member_rows(r, k, w) for r, k, w in ((512, 9, 3), (2, 9, 2), (1024, 1, 2))] == [54, 2, 1024]


def test_watchdog_frees_its_calls_before_it_leaves(monkeypatch):
    """A done native call whose last reference is the watchdog's is freed (its handle's
    ``rs_forget``, an op that runs without the GIL) in the watchdog's thread while that
    thread is still registered in ``_watcher``: the atexit join (``_stop_watchdog``) then
    covers the free. Freed after the thread left ``_watcher``, it raced the interpreter's
    finalization, which ends such a thread inside the op (run 69's probe: std::terminate
    at exit). Three calls, each watched by a fresh watchdog."""
    import threading
    import types

    from torch_ce.runtime import native
    from torch_ce.runtime.reduce_scatter import watchdog as WD
    from torch_ce.runtime.reduce_scatter.call import Call

    freed = []

    class Handle:  # stands for native.Handle: its __del__ runs rs_forget
        def __del__(self):
            me = threading.current_thread()
            freed.append((me.name, bool(WD._watcher) and WD._watcher[0] is me))

    monkeypatch.setattr(native, "rs_stages", lambda hs: [3] * len(hs))  # every call done
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ws = types.SimpleNamespace(failed="", key=((0, 1),), gen=1, session=types.SimpleNamespace(failed="", aborted=lambda: None))
    for k in range(3):
        call = Call(ws, 0, [], [], [], [], "sum", f"c{k}", 0, native=Handle())
        WD.watch(call, started=False)
        del call
        deadline = time.monotonic() + 5.0
        while (len(freed) <= k or WD._watcher) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(freed) == k + 1 and not WD._watcher, (freed, WD._watcher)
    assert freed == [("torch_ce_watchdog", True)] * 3, freed


def test_watchdog_starts_a_native_calls_deadline_at_its_completion(monkeypatch):
    """A native call is watched from its launch, but its deadline runs only from when the
    C++ stage says its completion began (when the Python path would start watching it):
    a call launched long before its wait is not released for the time before; one whose
    completion then stalls past ``rs_timeout_s`` is (``_release``), and a done one leaves
    the watch. A tick reads every native call's stage in one ``rs_stages`` query, a
    Python-path call watched among them keeping its own (its event)."""
    import types

    import torch_ce
    from torch_ce.runtime import native
    from torch_ce.runtime import reduce_scatter as RS
    from torch_ce.runtime.reduce_scatter import watchdog as WD
    from torch_ce.runtime.reduce_scatter.call import Call, NativeDone, Stage

    stage = {"a": 0, "b": 0}
    released, queries = [], []

    def stages(hs):  # one query per tick, of the native calls only, in watch order
        queries.append(list(hs))
        return [stage[h] for h in hs]

    monkeypatch.setattr(native, "rs_stages", stages)
    monkeypatch.setattr(WD, "_release", lambda call, why: released.append((call.native, why, time.monotonic())))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ws = types.SimpleNamespace(failed="", key=((0, 1),), gen=1, session=types.SimpleNamespace(failed="", aborted=lambda: None))
    calls = {}
    for h in ("a", "b"):
        calls[h] = Call(ws, 0, [], [], [], [], "sum", h, 0, native=h)
        calls[h].done = NativeDone(h)
    # A Python-path call watched between them, done: it leaves the watch, and the native
    # calls' stages stay theirs.
    py = Call(ws, 0, [], [], [], [], "sum", "py", 0, stage=Stage.RECORDED)
    py.done = types.SimpleNamespace(query=lambda: True)
    with torch_ce.config.patch(rs_timeout_s=0.3):
        WD.watch(calls["a"], started=False)
        WD.watch(py)
        WD.watch(calls["b"], started=False)
        time.sleep(0.6)  # longer than the timeout, completions not begun: nothing released
        assert released == []
        stage["a"], stage["b"] = 1, 3  # a: completion begun; b: done
        t0 = time.monotonic()
        deadline = t0 + 3.0
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [r[0] for r in released] == ["a"] and released[0][1] == "timeout", released
    assert released[0][2] - t0 >= 0.25, released[0][2] - t0  # from its start, not its launch
    with WD._watch_lock:
        assert not any(item[1] is calls["b"] or item[1] is py for item in WD._watched)
    assert queries and all(q in (["a", "b"], ["a"]) for q in queries), queries
    RS.release()
