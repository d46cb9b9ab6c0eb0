"""Where a native reduce-scatter call's host time goes (one GPU, loopback, world 2 or --world).

Times per rank-call: the whole call as bench/rs_cost.py times it (launch with the work
registered, then each output's ``wait_tensor``), its launch and its wait separately, the
C++ launch alone (``native.rs_launch``), the GPU's own time (the calls enqueued behind a
spin), the C++ pieces, each with the flag operations batched and one driver call each
(``native.rs_memop_batching``, where the library has it), the cost of a torch.ops call
into the library with and without a custom-class argument, and a cProfile of 300 calls
(top 30 by own time). A probe for perf-notes, not a benchmark.
    python3 bench/compare/rs_host_breakdown.py [--mib 1] [--dtype float32] [--world 2]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "test"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=1.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    import torch.distributed as dist
    from cuda_helpers import loopback_workspaces
    from rs_cost import _gpu_busy_us

    import torch_ce
    from torch_ce.runtime import native
    from torch_ce.runtime.reduce_scatter import launch as RS

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    w, dtype = a.world, getattr(torch, a.dtype)
    numel = int(a.mib * 2**20) // dtype.itemsize
    rows = max(w, numel // 1024 // w * w)  # whole rows per rank
    numel = rows * 1024
    xs = [[torch.randn(rows, 1024, device="cuda").to(dtype)] for _ in range(w)]
    f = torch.ops._c10d_functional
    torch_ce.config.rs_native = True
    wss = loopback_workspaces(w, numel // w, dtype)
    acc = dict(launch=0.0, wait=0.0, cxx=0.0)
    real = native.rs_launch

    def timed_cxx(*args):
        t = time.perf_counter()
        r = real(*args)
        acc["cxx"] += time.perf_counter() - t
        return r

    native.rs_launch = timed_cxx

    def call():
        t0 = time.perf_counter()
        calls = [RS.launch(ws, x, "sum", "bench", register=True) for ws, x in zip(wss, xs, strict=True)]
        t1 = time.perf_counter()
        outs = [[f.wait_tensor(o) for o in c.outs] for c in calls]
        acc["launch"] += t1 - t0
        acc["wait"] += time.perf_counter() - t1
        return outs

    names = ("launch: setup+outputs", "launch: ready event", "launch: free wait+reset", "launch: memcpys",
             "launch: header+tag writes", "launch: pushed event", "launch: work registration",
             "complete: pushed wait", "complete: data waits+resets", "complete: reduction launch",
             "complete: free writes", "complete: done event+wait")
    per = lambda s: s / a.iters / w * 1e6  # noqa: E731  per rank-call, us
    # The flag operations batched (the default) and one driver call each (the A/B knob).
    modes = [1, 2] if hasattr(torch.ops.torch_ce_native, "rs_memop_batching") else [None]
    labels = {1: "cuStreamBatchMemOp batches", 2: "one driver call each"}
    for mode in modes:
        if mode is not None:
            native.rs_memop_batching(mode)
            print(f"== flag operations: {labels[mode]}")
        for _ in range(30):
            call()
        torch.cuda.synchronize()
        for k in acc:
            acc[k] = 0.0
        t = time.perf_counter()
        for _ in range(a.iters):
            call()
        total = time.perf_counter() - t
        torch.cuda.synchronize()
        outs = call()  # exact in this mode too: rank r's chunk summed in group index order
        torch.cuda.synchronize()
        exact = True
        for r in range(w):
            want = xs[0][0].chunk(w)[r].float().clone()
            for j in range(1, w):
                want.add_(xs[j][0].chunk(w)[r].float())
            exact = exact and torch.equal(outs[r][0], want.to(dtype))
        print(f"per rank-call us: total {per(total):.1f}  launch {per(acc['launch']):.1f} "
              f"(C++ rs_launch {per(acc['cxx']):.1f})  wait_tensor {per(acc['wait']):.1f}  "
              f"GPU's own {_gpu_busy_us(call, 50, w)[0]:.1f}  exact {exact}")
        # the C++ pieces (csrc/ce_reduce_scatter.cu rs_timing), a second timed loop with the probe on
        native.rs_timing(1)
        t = time.perf_counter()
        for _ in range(a.iters):
            call()
        total_probed = time.perf_counter() - t
        pieces = native.rs_timing(2)
        torch.cuda.synchronize()
        print(f"with the C++ probe on: total {per(total_probed):.1f} us per rank-call; C++ pieces (us per rank-call):")
        for nm, v in zip(names, pieces):
            print(f"  {nm:30s} {per(v):7.2f}")
        print(f"  {'C++ total':30s} {per(sum(pieces)):7.2f}")
    if modes[0] is not None:
        native.rs_memop_batching(1)
    # torch.ops dispatch into the library
    ops = torch.ops.torch_ce_native
    handle = RS.launch(wss[0], xs[0], "sum", "q").native
    for r in range(1, w):  # every rank's part of the call, so rank 0's completes too
        RS.complete(RS.launch(wss[r], xs[r], "sum", "q"))
    flat = xs[0][0].view(-1)
    for label, fn in (("torch.ops no-arg (rs_has_kernel)", lambda: ops.rs_has_kernel()),
                      ("torch.ops int-handle arg (rs_query)", lambda: ops.rs_query(handle.id)),
                      ("direct op (native.rs_query)", lambda: native.rs_query(handle)),
                      ("direct op, Tensor(a!) + Tensor[] args (peer_copy_into, no rows)",
                       lambda: native._raw("peer_copy_into")(flat, [], [])),
                      ("torch.cuda.is_current_stream_capturing", torch.cuda.is_current_stream_capturing),
                      ("torch.cuda.current_stream", torch.cuda.current_stream)):
        for _ in range(100):
            fn()
        t = time.perf_counter()
        for _ in range(2000):
            fn()
        print(f"{label}: {(time.perf_counter() - t) / 2000 * 1e6:.2f} us")
    torch.cuda.synchronize()
    native.rs_launch = real
    # NCCL functional, same input, one-rank group
    g = dist.group.WORLD.group_name
    x0 = xs[0][0]

    def nccl():
        return f.wait_tensor(f.reduce_scatter_tensor(x0, "sum", 1, g))

    for _ in range(30):
        nccl()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.iters):
        nccl()
    print(f"NCCL functional reduce_scatter_tensor + wait_tensor: {(time.perf_counter() - t) / a.iters * 1e6:.1f} us")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.iters):
        call()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
