"""The reduction kernel's four tunings side by side (one GPU, loopback): a thread's loads in
flight (1 source at a time, or 4 before adding them) and the grid (the block cap, or spread
evenly over its grid-stride rounds), csrc/ce_reduce.h ``set_tuning``.

Per (tuning, world, dtype, size): the kernel's median device time over ``--calls`` profiled
calls, its bandwidth ((W + 1) slices: W read, one written) and that over a 512 MiB
device-to-device copy's in the same run (the target: >= 0.70 at 16 and 64 MiB). Every
tuning's outputs are checked equal to the first one's (the same adds in the same order). A
probe for perf-notes section 23, not a benchmark.
    python3 bench/compare/reduce_kernel_probe.py [--mib 16,64] [--worlds 2,3] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "test"))
sys.path.insert(0, os.path.join(HERE, ".."))

TUNINGS = ((1, False), (1, True), (4, False), (4, True))  # (loads in flight, even grid)


def _kernel_us(wss, xs, calls: int, native) -> tuple[list, list]:
    """Per tuning (``TUNINGS`` order): the median device us of one rank's reduction kernel
    over ``calls`` calls, and its last call's outputs; one profiler session for all four
    (a kernel's tuning is told by the order of the kernels: each tuning's calls run after
    the previous one's, on one reduce stream)."""
    from cuda_helpers import loopback_reduce_scatter
    from torch.profiler import ProfilerActivity, profile

    w = len(wss)
    outs_by = []
    for batch, even in TUNINGS:  # warm each: the kernel's module loaded, the tuning's first launch
        native.rs_reduce_tuning(batch, even)
        loopback_reduce_scatter(wss, xs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for batch, even in TUNINGS:
            native.rs_reduce_tuning(batch, even)
            for _ in range(calls):
                outs = loopback_reduce_scatter(wss, xs)
            torch.cuda.synchronize()
            outs_by.append(outs)
    evs = sorted((e for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and "reduce_kernel" in e.name),
                 key=lambda e: e.time_range.start)
    per = calls * w
    if len(evs) != per * len(TUNINGS):
        raise RuntimeError(f"{len(evs)} reduction kernels profiled, expected {per * len(TUNINGS)}")
    us = [statistics.median(e.time_range.elapsed_us() for e in evs[k * per:(k + 1) * per])
          for k in range(len(TUNINGS))]
    return us, outs_by


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="16,64")
    ap.add_argument("--worlds", default="2,3")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    from cuda_helpers import loopback_workspaces
    from rs_cost import _copy_gbps, _numel

    import torch_ce
    from torch_ce.runtime import native

    if not native.rs_has_kernel() or not hasattr(torch.ops.torch_ce_native, "rs_reduce_tuning"):
        raise SystemExit("the library has no CUDA reduction kernel with its tuning knob (an nvcc build)")
    before = native.rs_reduce_tuning()
    hbm = _copy_gbps(512 << 20, torch.uint8, 10)
    rows = []
    try:
        with torch_ce.config.patch(rs_native=True):
            for w in (int(v) for v in a.worlds.split(",")):
                for dname in a.dtypes.split(","):
                    dtype = getattr(torch, dname)
                    for mib in (float(v) for v in a.mib.split(",")):
                        numel = _numel(mib, dtype, w)
                        gen = torch.Generator(device="cuda").manual_seed(3)
                        xs = [[torch.randn(numel // 1024, 1024, device="cuda", generator=gen).to(dtype)]
                              for _ in range(w)]
                        wss = loopback_workspaces(w, numel // w, dtype)
                        slice_bytes = numel // w * dtype.itemsize
                        us_by, outs_by = _kernel_us(wss, xs, a.calls, native)
                        first = outs_by[0]
                        for (batch, even), us, outs in zip(TUNINGS, us_by, outs_by, strict=True):
                            same = all(torch.equal(o, f) for r, fr in zip(outs, first, strict=True)
                                       for o, f in zip(r, fr, strict=True))
                            gbps = (w + 1) * slice_bytes / (us * 1e-6) / 1e9
                            rows.append(dict(world=w, dtype=dname, mib=mib, batch=batch, even=even,
                                             kernel_us=us, GBps=gbps, over_copy=gbps / hbm, same_bits=same))
                        del xs, wss
                        torch.cuda.empty_cache()
    finally:
        native.rs_reduce_tuning(before[0], bool(before[1]))
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, hbm_copy_GBps=hbm, rows=rows)
    print(f"HBM copy (512 MiB): {hbm:.0f} GB/s")
    print(f"{'W':>2} {'dtype':>9} {'MiB':>4} | " + " | ".join(f"b{b}{' even' if e else '  cap'}" for b, e in TUNINGS))
    for k in range(0, len(rows), len(TUNINGS)):
        g = rows[k:k + len(TUNINGS)]
        cells = " | ".join(f"{r['over_copy']:.2f}{'' if r['same_bits'] else '!'}".rjust(7) for r in g)
        print(f"{g[0]['world']:>2} {g[0]['dtype']:>9} {g[0]['mib']:>4g} | {cells}")
    print("cells: the kernel's GB/s over the copy's; !: outputs differ from the first tuning's")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "reduce_kernel_probe.json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
