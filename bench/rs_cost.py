"""The copy-engine reduce-scatter on one GPU, loopback workspaces (issue 37): the host cost
per call, the GPU time per call, and what a call runs on the GPU (kernels, memcpys,
stream memory operations) by the profiler.

One process plays both ranks of a 2-rank group (test/cuda_helpers.py
``loopback_workspaces``): a "call" is both ranks' launch and completion, so one rank's host
cost is half of it. Per bucket size: ``--iters`` calls timed on the host (perf_counter
around the Python calls, the GPU left to run behind them), then the same calls timed by
CUDA events, then one profiled call. The kernels it lists are the reduction's only (an
add per rank; casts for bf16): the pushes are memcpys, the flags stream memory operations.

    python3 bench/rs_cost.py [--mib 1,16,64] [--dtype float32] [--iters 50] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test"))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", default="1,16,64", help="input MiB per rank, comma-separated")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    from cuda_helpers import loopback_reduce_scatter, loopback_workspaces
    from torch.profiler import ProfilerActivity, profile

    import torch_ce  # noqa: F401  (the ops, the native library)
    from torch_ce.runtime import native

    dtype = getattr(torch, a.dtype)
    w = 2
    rows = []
    for mib in (float(m) for m in a.mib.split(",")):
        numel = int(mib * 2**20) // dtype.itemsize // (w * 1024) * (w * 1024)
        wss = loopback_workspaces(w, numel // w, dtype)
        xs = [[torch.randn(numel // 1024, 1024, device="cuda").to(dtype)] for _ in range(w)]
        for _ in range(3):
            loopback_reduce_scatter(wss, xs)
        torch.cuda.synchronize()
        host = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            loopback_reduce_scatter(wss, xs)
            host.append((time.perf_counter() - t0) * 1e6 / w)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.iters):
            loopback_reduce_scatter(wss, xs)
        end.record()
        torch.cuda.synchronize()
        gpu_ms = start.elapsed_time(end) / a.iters
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loopback_reduce_scatter(wss, xs)
            torch.cuda.synchronize()
        dev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = sorted({e.name for e in dev if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()})
        memcpys = sum(1 for e in dev if "memcpy" in e.name.lower())
        syncs = sorted({e.name for e in prof.events() if "Synchronize" in e.name
                        and e.name != "cudaDeviceSynchronize"})
        rows.append(dict(mib=mib, dtype=a.dtype, host_us_per_rank_call=statistics.median(host),
                         host_us_p90=sorted(host)[int(0.9 * len(host))],
                         gpu_ms_per_call_both_ranks=gpu_ms, kernels=kernels,
                         memcpys_per_call=memcpys, host_syncs=syncs))
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               build=native.build_info(), connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default"),
               world=w, iters=a.iters, rows=rows)
    print(f"{'MiB':>6} {'dtype':>9} {'host us/rank-call':>18} {'p90':>7} {'GPU ms/call':>12} {'memcpys':>8}  kernels")
    for r in rows:
        print(f"{r['mib']:>6g} {r['dtype']:>9} {r['host_us_per_rank_call']:>18.1f} {r['host_us_p90']:>7.1f} "
              f"{r['gpu_ms_per_call_both_ranks']:>12.3f} {r['memcpys_per_call']:>8d}  {'; '.join(r['kernels'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
