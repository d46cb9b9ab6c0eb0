"""The copy-engine reduce-scatter's cost on one GPU, loopback workspaces, against the
functional collective in the same run (issues 37 and 49).

One process plays every rank of a W-rank group (test/cuda_helpers.py
``loopback_workspaces``): a "call" is every rank's launch, then every rank's
``wait_tensor`` on its outputs (what a graph does), so one rank's host cost is the call's
host time over W. Per (world, dtype, size):

  functional     ``_c10d_functional.reduce_scatter_tensor`` + ``wait_tensor`` on a one-rank
                 NCCL group: the host cost of the collective the op replaces
  python         the CE call on the Python launch and completion (``rs_native`` off)
  native         the CE call on the C++ ones with the fused reduction (``rs_native`` on;
                 absent when the library lacks them)

each as host microseconds per rank-call (median of ``--iters`` calls timed with
perf_counter, the GPU left to run behind: ``gpu_paced`` where that loop ran at the GPU's
pace, its median then the GPU's time, not host work), GPU ms per call (CUDA events around
that loop: the slower of the two) and the GPU's own time per rank-call (the calls enqueued
behind a spin, timed from its end: ``gpu_busy_us_per_rank_call``; ``gpu_busy_valid`` where
the host had enqueued them all before the spin ended); for the native path also the two
timed in alternation, one call of each per round, each begun on an idle GPU, and the
median of the per-round ratios (``paired_ratio``: the host's work alone, its drift
cancelled out: the target's figure); the
profiler's kernels per call; the reduction kernel's achieved bandwidth ((W + 1) slices:
W read, one written, over its profiled device time) against the HBM bandwidth of a
device-to-device copy in the same run (``copy_`` of 512 MiB, far past the 50 MB L2: 2 x
the bytes over its profiled device time; the copy of each slice is kept beside it, L2
helps it below ~25 MiB);
and a captured call (every rank, native when it is there) replayed from a CUDA graph:
host microseconds per replay. JSON and a PNG (matplotlib, where installed) under --out.

    python3 bench/rs_cost.py [--mib 1,16,64] [--dtypes float32,bfloat16] [--worlds 2,3]
                             [--iters 50] [--members 1] [--out bench/results/rs_cost] [--dry-run]
    python3 bench/rs_cost.py --replot bench/results/runN_rs_cost_h200.json

``--members K``: each bucket holds K tensors, the size split over them (the functional
call is then ``reduce_scatter_tensor_coalesced``).

``--dry-run`` needs no GPU: it checks the arguments, writes the plan (the cases and
columns a GPU run fills) as JSON and exits (test/test_bench_cpu.py runs it). ``--replot``
needs none either: it prints a saved result's table and draws its PNG beside it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test"))

PATHS = ("functional", "python", "native")
COLUMNS = ("host_us_per_rank_call", "host_us_p90", "gpu_ms_per_call", "gpu_busy_us_per_rank_call",
           "kernels_per_call", "memcpys_per_call")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="1,16,64", help="input MiB per rank, comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--worlds", default="2,3")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--members", type=int, default=1,
                    help="tensors per bucket, the size split over them (a layer's bucket: ~9)")
    ap.add_argument("--out", default="", help="directory for rs_cost.json and rs_cost.png")
    ap.add_argument("--json", default="", help="(kept for older scripts) a JSON path")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: write the plan and exit")
    ap.add_argument("--replot", default="", metavar="JSON",
                    help="no GPU: draw a saved result's PNG beside it and print its table")
    a = ap.parse_args(argv)
    a.mibs = [float(m) for m in a.mib.split(",") if m]
    a.dtype_list = [d for d in a.dtypes.split(",") if d]
    a.world_list = [int(w) for w in a.worlds.split(",") if w]
    for d in a.dtype_list:
        if d not in ("float32", "bfloat16"):
            ap.error(f"--dtypes: {d!r} is not float32 or bfloat16")
    if any(w < 2 for w in a.world_list) or any(m <= 0 for m in a.mibs) or a.iters < 1 or a.members < 1:
        ap.error("worlds >= 2, sizes > 0, iters >= 1 and members >= 1")
    return a


def plan(a) -> list[dict]:
    return [dict(world=w, dtype=d, mib=m) for w in a.world_list for d in a.dtype_list for m in a.mibs]


def _numel(mib: float, dtype: torch.dtype, w: int) -> int:
    return max(w * 1024, int(mib * 2**20) // dtype.itemsize // (w * 1024) * (w * 1024))


def _member_rows(rows: int, members: int, w: int) -> int:
    """Rows of 1024 elements per bucket member: ``rows`` split over ``members``, a multiple
    of the world size (each member scatters whole rows), at least one row per rank."""
    return max(w, rows // members // w * w)


def _host_times(fn, iters: int, per: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6 / per)
    return out


def _gpu_ms(fn, iters: int) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _gpu_busy_us(fn, iters: int, per: int) -> tuple[float, bool]:
    """The GPU's own time per rank-call: ``iters`` calls enqueued behind a ~100 ms spin on
    the current stream (every call's streams wait for it: the launch orders its copy stream
    after the current one), then timed from the spin's end to the last call's end. Unlike
    ``_gpu_ms`` (events around a loop, which measure the slower of host and GPU), this is
    the GPU's pace with the host ahead of it: valid (the second value) when the host had
    enqueued every call before the spin ended."""
    torch.cuda.synchronize()
    pre, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    pre.record()
    torch.cuda._sleep(200_000_000)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    enqueued_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters / per, enqueued_ms < pre.elapsed_time(start)


def _profile(fn) -> tuple[list, int, dict]:
    """(kernel names, memcpys, {kernel name: total device us}) of one call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    dev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels, us = [], {}
    memcpys = 0
    for e in dev:
        low = e.name.lower()
        if "memcpy" in low:
            memcpys += 1
        elif "memset" not in low and "stream" not in low:
            kernels.append(e.name)
            us[e.name] = us.get(e.name, 0.0) + e.time_range.elapsed_us()
    return kernels, memcpys, us


def _summary(host: list, gpu_ms: float, gpu_busy: tuple, kernels: list, memcpys: int) -> dict:
    return dict(host_us_per_rank_call=statistics.median(host), host_us_p90=sorted(host)[int(0.9 * len(host))],
                gpu_ms_per_call=gpu_ms, gpu_busy_us_per_rank_call=gpu_busy[0], gpu_busy_valid=gpu_busy[1],
                kernels_per_call=len(kernels), kernel_names=sorted(set(kernels)), memcpys_per_call=memcpys)


def _paired(ce_call, nccl_call, iters: int, w: int) -> dict:
    """Host us per rank-call of the CE call and of the functional one timed in alternation,
    one call of each per round, each begun on an idle GPU (an untimed synchronize before
    it), and the median of the per-round ratios. Alternation: this host's drift (run 65:
    the functional call's median ranged 27-120 us across sizes) cancels out of the ratio.
    An idle GPU: a loop that runs ahead of a slower GPU fills the launch queue and then
    times the GPU's pace, not the host's work (docs/perf-notes.md section 23)."""
    ce, nccl, ratio = [], [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        nccl_call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        ce_call()
        t3 = time.perf_counter()
        nccl.append((t1 - t0) * 1e6)
        ce.append((t3 - t2) * 1e6 / w)
        ratio.append(ce[-1] / nccl[-1])
    torch.cuda.synchronize()
    return dict(paired_host_us=statistics.median(ce), paired_functional_us=statistics.median(nccl),
                paired_ratio=statistics.median(ratio))


def _functional_call(group_name: str, xs: list):
    """The functional collective of one bucket: ``reduce_scatter_tensor`` of its one member,
    or ``reduce_scatter_tensor_coalesced`` of its members (what a graph's bucket calls)."""
    f = torch.ops._c10d_functional

    if len(xs) == 1:
        def call():
            f.wait_tensor(f.reduce_scatter_tensor(xs[0], "sum", 1, group_name))
    else:
        def call():
            for o in f.reduce_scatter_tensor_coalesced(xs, "sum", 1, group_name):
                f.wait_tensor(o)

    return call


def _functional(group_name: str, xs: list, iters: int) -> dict:
    call = _functional_call(group_name, xs)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    host = _host_times(call, iters, 1)
    gpu = _gpu_ms(call, iters)
    busy = _gpu_busy_us(call, iters, 1)
    kernels, memcpys, _ = _profile(call)
    return _summary(host, gpu, busy, kernels, memcpys)


def _ce(wss, xs, iters: int, w: int) -> tuple[dict, dict, object]:
    """One CE path (the config decides which): its summary, the kernels' device us, a call."""
    from torch_ce.runtime.reduce_scatter import launch as RS

    f = torch.ops._c10d_functional

    def call():
        calls = []
        for ws, x in zip(wss, xs, strict=True):
            c = RS.launch(ws, x, "sum", "bench", register=True)
            if c.native is None:
                RS.register(c)
            calls.append(c)
        return [[f.wait_tensor(o) for o in c.outs] for c in calls]

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    host = _host_times(call, iters, w)
    gpu = _gpu_ms(call, iters)
    busy = _gpu_busy_us(call, iters, w)
    kernels, memcpys, us = _profile(call)
    return _summary(host, gpu, busy, [k for k in kernels], memcpys), us, call


def _copy_gbps(nbytes: int, dtype: torch.dtype, iters: int) -> float:
    """A device-to-device copy of one slice: its device time from the profiler (as the
    reduction kernel's), median of ``iters``: event timing of a loop measures the host's
    launch gaps at small sizes."""
    from torch.profiler import ProfilerActivity, profile

    src = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            dst.copy_(src)
        torch.cuda.synchronize()
    us = [e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return 2 * nbytes / (statistics.median(us) * 1e-6) / 1e9 if us else float("nan")


def _graph_replay_us(call, iters: int) -> float:
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    host = _host_times(graph.replay, iters, 1)
    torch.cuda.synchronize()
    return statistics.median(host)


def run(a) -> dict:
    import torch.distributed as dist
    from cuda_helpers import loopback_workspaces

    import torch_ce
    from torch_ce.runtime import native

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    group_name = dist.group.WORLD.group_name
    has_native = native.has_rs_native()
    rows, hbm = [], None
    for case in plan(a):
        w, dtype, mib = case["world"], getattr(torch, case["dtype"]), case["mib"]
        rows_per = _member_rows(_numel(mib, dtype, w) // 1024, a.members, w)
        numel = rows_per * 1024 * a.members
        gen = torch.Generator(device="cuda").manual_seed(1)
        xs = [[torch.randn(rows_per, 1024, device="cuda", generator=gen).to(dtype) for _ in range(a.members)]
              for _ in range(w)]
        row = dict(case, members=a.members, numel_per_rank_input=numel,
                   functional=_functional(group_name, xs[0], a.iters))
        slice_bytes = numel // w * dtype.itemsize
        for path in ("python", "native"):
            if path == "native" and not has_native:
                row[path] = None
                continue
            with torch_ce.config.patch(rs_native=path == "native"):
                wss = loopback_workspaces(w, numel // w, dtype)
                summary, us, call = _ce(wss, xs, a.iters, w)
                if path == "native":
                    summary.update(_paired(call, _functional_call(group_name, xs[0]), 2 * a.iters, w))
                    k_us = sum(v for k, v in us.items() if "reduce_kernel" in k) / w
                    summary["reduce_kernel_us"] = k_us
                    summary["reduce_kernel_GBps"] = (w + 1) * slice_bytes / (k_us * 1e-6) / 1e9 if k_us else None
                    try:
                        summary["graph_replay_host_us"] = _graph_replay_us(call, a.iters)
                    except Exception as e:  # noqa: BLE001 (reported in the JSON; the other figures stand)
                        summary["graph_replay_host_us"] = None
                        summary["graph_replay_error"] = f"{type(e).__name__}: {e}"[:300]
                        print(f"graph replay failed: {summary['graph_replay_error']}", flush=True)
                        torch.cuda.synchronize()
                row[path] = summary
        row["copy_GBps"] = _copy_gbps(slice_bytes, dtype, a.iters)  # this slice's copy (L2 helps below ~25 MiB)
        if hbm is None:  # the HBM figure: a copy of 512 MiB, far past the 50 MB L2
            hbm = _copy_gbps(512 << 20, torch.uint8, 10)
        row["hbm_copy_GBps"] = hbm
        if row["native"] and row["native"].get("reduce_kernel_GBps"):
            row["kernel_over_copy"] = row["native"]["reduce_kernel_GBps"] / hbm
        _ratios(row)
        rows.append(row)
        del xs
        torch.cuda.empty_cache()
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, build=native.build_info(),
                reduce_kernel="cuda" if native.rs_has_kernel() else ("triton" if has_native else "none"),
                connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default"), iters=a.iters,
                members=a.members, rows=rows)


def _ratios(row: dict) -> None:
    """Per path: whether its timed loop ran at the GPU's pace (its median then the GPU's
    time, not host work: under 1.1x the GPU's own time per rank-call), and its host time
    over the functional call's."""
    for path in PATHS:
        summ = row.get(path)
        if not summ:
            continue
        summ["gpu_paced"] = (summ.get("gpu_busy_valid", True)
                             and summ["host_us_per_rank_call"] < 1.1 * summ["gpu_busy_us_per_rank_call"])
        if path != "functional":
            summ["host_over_functional"] = summ["host_us_per_rank_call"] / row["functional"]["host_us_per_rank_call"]


def _pace_mark(summ: dict) -> str:
    """``*`` the timed loop ran at the GPU's pace, ``?`` the GPU's time is not valid (the
    host had not enqueued every call before the spin ended)."""
    if summ.get("gpu_busy_valid") is False:
        return "?"
    return "*" if summ.get("gpu_paced") else " "


def table(out: dict) -> str:
    lines = [f"{'W':>2} {'dtype':>9} {'MiB':>5} | {'host us/rank-call: NCCL':>23} {'python':>8} {'native':>8} "
             f"{'nat/NCCL':>8} {'GPU us':>7} {'paired':>6} | {'kernel GB/s':>11} {'HBM copy':>9} {'ratio':>6} | {'replay us':>9}"]
    for r in out["rows"]:
        nat = r.get("native") or {}
        f = lambda v, fmt: format(v, fmt) if isinstance(v, (int, float)) else "-"  # noqa: E731
        lines.append(
            f"{r['world']:>2} {r['dtype']:>9} {r['mib']:>5g} | {f(r['functional']['host_us_per_rank_call'], '23.1f')} "
            f"{f((r.get('python') or {}).get('host_us_per_rank_call'), '8.1f')} "
            f"{f(nat.get('host_us_per_rank_call'), '8.1f')} {f(nat.get('host_over_functional'), '8.2f')} "
            f"{f(nat.get('gpu_busy_us_per_rank_call'), '6.1f')}{_pace_mark(nat)} "
            f"{f(nat.get('paired_ratio'), '6.2f')} | "
            f"{f(nat.get('reduce_kernel_GBps'), '11.0f')} {f(r.get('hbm_copy_GBps'), '9.0f')} "
            f"{f(r.get('kernel_over_copy'), '6.2f')} | {f(nat.get('graph_replay_host_us'), '9.1f')}")
    lines.append("GPU us: the native call's GPU time per rank-call, the host ahead (*: the timed loop ran at "
                 "the GPU's pace; ?: not valid, the host fell behind the spin); "
                 "paired: the native call's host time over NCCL's, each begun on an idle GPU")
    return "\n".join(lines)


def plot(out: dict, path: str) -> bool:
    """Top: each path's host time per rank-call (unpaired medians). Bottom: the two targets'
    figures, the paired host ratio against NCCL (<= 1.5) and the kernel's bandwidth over the
    copy's (>= 0.70 at 16 and 64 MiB), each with its line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 (no matplotlib: the JSON alone)
        return False
    rows = out["rows"]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(max(6, len(rows) * 0.9), 7), sharex=True)
    labels = [f"W{r['world']} {r['dtype'][:4]} {r['mib']:g}M" for r in rows]
    xs = range(len(rows))
    width = 0.27
    for k, path_name in enumerate(PATHS):
        vals = [((r.get(path_name) or {}).get("host_us_per_rank_call") or 0.0) for r in rows]
        ax.bar([x + (k - 1) * width for x in xs], vals, width, label=path_name)
    ax.set_ylabel("host us per rank-call")
    ax.set_title(f"reduce-scatter host cost, {out.get('device', '')}")
    ax.legend()
    paired = [((r.get("native") or {}).get("paired_ratio") or 0.0) for r in rows]
    kernel = [(r.get("kernel_over_copy") or 0.0) for r in rows]
    bx.bar([x - width / 2 for x in xs], paired, width, label="host, native over NCCL (paired)", color="C2")
    bx.bar([x + width / 2 for x in xs], kernel, width, label="reduction kernel GB/s over the copy's", color="C4")
    bx.axhline(1.5, color="C2", linestyle="--", linewidth=1, label="host target <= 1.5")
    bx.axhline(0.70, color="C4", linestyle=":", linewidth=1, label="kernel target >= 0.70 (16, 64 MiB)")
    bx.set_ylabel("ratio")
    bx.set_xticks(list(xs), labels, rotation=45, ha="right")
    bx.legend(fontsize="small", ncol=2, loc="upper left")
    bx.set_ylim(0, max([1.7] + paired + kernel) * 1.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> dict:
    a = parse(argv)
    if a.replot:
        with open(a.replot) as f:
            out = json.load(f)
        print(table(out))
        plot(out, os.path.splitext(a.replot)[0] + ".png")
        return out
    if a.dry_run:
        out = dict(dry_run=True, paths=list(PATHS), columns=list(COLUMNS), iters=a.iters, rows=plan(a))
    else:
        out = run(a)
        print(table(out))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "rs_cost.json"), "w") as f:
            json.dump(out, f, indent=1)
        if not a.dry_run:
            plot(out, os.path.join(a.out, "rs_cost.png"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.dry_run:
        print(f"dry run: {len(out['rows'])} cases x {len(PATHS)} paths")
    return out


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
