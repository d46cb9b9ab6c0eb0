"""Host cost of one eager weight gather (NOTE [eager gathers] in torch_ce/runtime/eager.py)
next to the collective's, on 2 gloo CPU ranks with the host transport: SimpleFSDP's
parametrization (torchtitan's ``ReplicateComputation``) gathering one Shard(0) weight
outside a compiled graph, timed per call (median of ``--iters``), for

- ``collective``: torch_ce off, DTensor's ``redistribute(Replicate())`` (gloo all_gather);
- ``ce``: torch_ce on, the weight served from its staging slot (bound by a first gather
  under autograd; no refresh: the weight is unchanged between calls);
- ``ce_refresh``: the same after each call's in-place write of the weight (a stand-in
  for the optimizer step): every call runs a refresh round (fence, copy, fence);
- ``ce_grad``: ``ce`` under autograd (the ``_EagerGather`` Function; forward only).

Sizes: ``--rows`` x ``--cols`` fp32 per weight (the gathered weight). On 2 CPU cores this
measures Python host cost, not a transport: the collective is gloo over TCP loopback, the
CE read a memcpy of shared memory. Prints one JSON line per size; ``--out`` writes them.

    python3 bench/eager_cost.py --sizes 64x64,1024x1024 --iters 200
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def _time(fn, iters: int) -> float:
    import torch.distributed as dist

    for _ in range(5):
        fn()
    dist.barrier()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _rank(rank, world, sizes, iters):
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torchtitan.experiments.graph_trainer import simple_fsdp

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    rc = simple_fsdp.ReplicateComputation(mesh, (Shard(0),), "fully_shard", None)
    out = []
    for rows, cols in sizes:
        w = torch.nn.Parameter(distribute_tensor(torch.randn(rows, cols), mesh, [Shard(0)]))
        res = dict(rows=rows, cols=cols, gathered_bytes=rows * cols * 4)
        with torch.no_grad():
            res["collective_us"] = _time(lambda: rc(w), iters)
        torch_ce.enable(transport="copy_engine", cost_mode="default")
        rc(w)  # a training gather binds the staging slot (an inference one binds nothing)
        with torch.no_grad():
            ref = rc.replicate_compute.__wrapped__(rc, w)
            assert torch.equal(rc(w), ref)
            res["ce_us"] = _time(lambda: rc(w), iters)

            def write_then_gather():
                w._local_tensor.mul_(1.0)  # moves the version: a refresh round per call
                rc(w)

            res["ce_refresh_us"] = _time(write_then_gather, iters)
        res["ce_grad_us"] = _time(lambda: rc(w), iters)
        res["served"] = {k[1]: v[0] for k, v in torch_ce.report.eager.items()}
        torch_ce.disable()
        out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64x64,256x256,1024x1024")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test"))
    from mp_harness import run_ranks

    sizes = [tuple(int(x) for x in s.split("x")) for s in a.sizes.split(",")]
    res = run_ranks(_rank, 2, sizes, a.iters, timeout=600)
    lines = []
    for i, size in enumerate(res[0]):
        row = dict(size, **{k: max(r[i][k] for r in res) for k in size if k.endswith("_us")},
                   served=size["served"],
                   torch=torch.__version__, device="cpu (2 gloo ranks, host transport)")
        lines.append(json.dumps(row))
        print(lines[-1])
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
