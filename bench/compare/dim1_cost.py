"""What a Shard(d) strided gather costs against a plain Shard(0) gather of the same bytes
(NOTE [strided reads] in csrc/ce_copy.h), on one GPU's loopback slots.

One process, one GPU: each shard is a loopback slot (``register_loopback`` from
test/cuda_helpers.py: the "peer" copy is a second tensor on the same GPU), so the reads
are device-local DtoD copies through the copy engines. That measures the copy shapes
(how a row-block batch, per-block 2-D copies and one 3-D batch submit and run against one
contiguous slab), not NVLink. For each expert shape ``[E, h, D]`` (one rank's Shard(1)
shard, bf16; and a 2-D ``[out, in / 8]`` Linear shard: thousands of short rows) and each
strategy ("rows", "2d", "3d") it prints

  - GB/s of ``wait_tensor(magi.ce_all_gather_dim(shard, 2, g, 1))`` (output bytes /
    median time of one gather, CUDA events, 50 timed gathers after 10 warm-ups), beside
    ``magi.ce_all_gather`` of a 1-D shard of the same bytes (the Shard(0) baseline);
  - the CPU cost per call of the op + wait_tensor (microseconds, a tight loop of 300
    calls with no synchronisation, on a 1 MiB shard, so the submission, not the copy,
    is what is timed), and of ``ce_all_gather`` + wait_tensor for comparison.

Run on the GPU machine from the repository root:
    python3 bench/compare/dim1_cost.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

SHAPES = [  # one rank's Shard(1) expert shard [E, h, D] (h: the local rows of dim 1)
    (128, 96, 2048),   # Qwen3-30B-A3B-like w1/w3 over 8 ranks: 128 row blocks of 384 KiB
    (128, 1024, 192),  # w2-like: [E, dim, moe_inter / 8]: row blocks of 384 KiB
    (64, 16, 2048),    # many small row blocks (64 KiB)
    (8, 1024, 4096),   # few large row blocks (8 MiB)
    (4096, 448),       # a 2-D Linear [4096, 3584] Shard(1) over 8: 4096 rows of 896 B
]
STRATEGIES = ("rows", "2d", "3d")


def _median_ms(fn, warm=10, n=50):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "test"))
    from cuda_helpers import register_loopback

    import torch_ce  # noqa: F401  (the magi ops)
    from torch_ce.runtime import native
    from torch_ce.runtime.gather import dim_strategy_as, kernel_path

    if not native.load():
        raise SystemExit(f"dim1_cost: {kernel_path('cuda')}")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    g = dist.group.WORLD.group_name
    wait = torch.ops._c10d_functional.wait_tensor.default
    dim_op = torch.ops.magi.ce_all_gather_dim.default
    op = torch.ops.magi.ce_all_gather.default
    keep, rows = [], []

    def loopback(shape, dtype=torch.bfloat16):
        mine = torch.randn(shape, device=dev).to(dtype)
        peer = torch.randn(shape, device=dev).to(dtype)
        register_loopback(mine, peer, dist.group.WORLD, 0)
        keep.append((mine, peer))
        return mine, peer

    for shape in SHAPES:
        mine, peer = loopback(shape)
        flat, _ = loopback((mine.numel(),))
        out_bytes = 2 * mine.numel() * mine.element_size()
        ref = torch.cat([mine, peer], 1)
        row = dict(shape=list(shape), shard_mib=round(out_bytes / 2 / 2**20, 2),
                   row_blocks=shape[0], row_block_kib=round(mine[0].numel() * 2 / 1024, 2))
        ms = _median_ms(lambda: wait(op(flat, 2, g)))
        row["shard0_gbps"] = round(out_bytes / ms / 1e6, 1)
        for s in STRATEGIES:
            with dim_strategy_as(s):
                exact = bool(torch.equal(wait(dim_op(mine, 2, g, 1)), ref))
                ms = _median_ms(lambda: wait(dim_op(mine, 2, g, 1)))
            row[f"{s}_gbps"] = round(out_bytes / ms / 1e6, 1)
            row[f"{s}_exact"] = exact
        rows.append(row)
        print("[dim1] " + json.dumps(row), flush=True)

    small, _ = loopback((8, 32, 2048))  # 1 MiB: 8 row blocks of 128 KiB
    small_flat, _ = loopback((small.numel(),))
    cpu = {"ce_all_gather + wait (Shard(0))": _per_call_us(lambda: wait(op(small_flat, 2, g)))}
    for s in STRATEGIES:
        with dim_strategy_as(s):
            cpu[f"ce_all_gather_dim + wait ({s})"] = _per_call_us(lambda: wait(dim_op(small, 2, g, 1)))
    py = torch.ops.torch_ce.gather_dim_python.default
    cpu["gather_dim_python + wait (rows)"] = _per_call_us(lambda: wait(py(small, 2, g, 1)))
    for k, v in cpu.items():
        print(f"[dim1-cpu] {k:<40} {v:8.1f} us/call", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bandwidth=rows, cpu_us_per_call=cpu, device=torch.cuda.get_device_name(dev),
                           torch=torch.__version__), f, indent=1)
    torch_ce.release_all()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
