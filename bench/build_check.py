"""One build of the C++ kernels on one GPU, loopback slots: what it gathers and what a
gather costs the CPU (bench/gpu_build_check.sh runs it once per build and compares).

    python3 bench/build_check.py --label no_nvcc --expect-root DIR --out FILE.json

Gathers (``magi.ce_all_gather`` and ``_coalesced``) and row gathers (``gather.gather_rows``)
of seeded data on loopback slots (``register_loopback`` from test/cuda_helpers.py: the peer
copy is a second local tensor), each output checked against ``torch.cat`` /
``torch.embedding`` and hashed, so two builds can be compared bit for bit. Then CPU time
per call in a tight loop (median of 5 rounds of 300 calls, as bench/issue_cost.py): op +
``wait_tensor`` on a 1 MiB shard, a coalesced bucket of 5 + 5 waits, and the row gather of
4096 ids x 8 KiB bf16 rows, whose device time is also timed (CUDA events).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def per_call_us(fn, n=300, rounds=5):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def device_us(fn, n=50):
    for _ in range(5):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1e3


def digest(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes (no numpy needed)."""
    c = t.detach().contiguous().cpu()
    return hashlib.sha256(ctypes.string_at(c.data_ptr(), c.numel() * c.element_size())).hexdigest()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--expect-root", default=None, help="torch_ce must be imported from here")
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = tempfile.NamedTemporaryFile(delete=False).name
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    import torch_ce
    from torch_ce.runtime import gather, native

    root = os.path.dirname(os.path.dirname(os.path.abspath(torch_ce.__file__)))
    if a.expect_root and os.path.realpath(root) != os.path.realpath(a.expect_root):
        raise SystemExit(f"build_check: torch_ce imported from {root}, expected {a.expect_root}")
    if not native.load():
        raise SystemExit(f"build_check: {gather.kernel_path('cuda')}")
    sys.path.insert(0, os.path.join(HERE, "..", "test"))
    from cuda_helpers import register_loopback

    torch_ce.config.update(cost_mode="default")
    g = dist.group.WORLD
    name = g.group_name
    res = dict(label=a.label, root=root, library=native.library_path(), build=list(native.build_info()),
               row_path=gather.row_path()[0], kernel_path=gather.kernel_path("cuda"),
               exact=[], digests=[], rows_exact=[], rows_digests=[])
    gen = torch.Generator(device=dev).manual_seed(1234)
    keep = []
    specs = (((128, 64), torch.float32), ((4096,), torch.bfloat16), ((64, 3, 5), torch.float16),
             ((8 << 20,), torch.bfloat16))
    shards = []
    for shape, dtype in specs:
        mine = torch.randn(shape, generator=gen, device=dev).to(dtype)
        peer = torch.randn(shape, generator=gen, device=dev).to(dtype)
        register_loopback(mine, peer, g, 1)
        keep.append((mine, peer))
        shards.append(mine)
        out = torch.ops._c10d_functional.wait_tensor(torch.ops.magi.ce_all_gather(mine, 2, name))
        res["exact"].append(bool(torch.equal(out, torch.cat([peer, mine]))))
        res["digests"].append(digest(out))
    outs = torch.ops.magi.ce_all_gather_coalesced(shards, 2, name)
    for o, (m, p_) in zip(outs, keep, strict=True):
        o = torch.ops._c10d_functional.wait_tensor(o)
        res["exact"].append(bool(torch.equal(o, torch.cat([p_, m]))))
        res["digests"].append(digest(o))
    # Row gathers: 8 KiB bf16 rows, and 12-byte fp32 rows.
    tables = []
    for rows, dim, dtype in ((1024, 4096, torch.bfloat16), (333, 3, torch.float32)):
        mine = torch.randn(rows, dim, generator=gen, device=dev).to(dtype)
        peer = torch.randn(rows, dim, generator=gen, device=dev).to(dtype)
        slot = register_loopback(mine, peer, g, 0)
        keep.append((mine, peer))
        ids = torch.randint(0, 2 * rows, (4096,), generator=gen, device=dev)
        got = gather.gather_rows(mine, slot, ids)
        res["rows_exact"].append(bool(torch.equal(got, torch.cat([mine, peer])[ids])))
        res["rows_digests"].append(digest(got))
        tables.append((mine, slot, ids))
    torch.cuda.synchronize()
    wait = torch.ops._c10d_functional.wait_tensor.default
    op = torch.ops.magi.ce_all_gather.default
    opc = torch.ops.magi.ce_all_gather_coalesced.default
    mib = torch.randn(1 << 19, generator=gen, device=dev).to(torch.bfloat16)
    register_loopback(mib, torch.randn_like(mib), g, 0)
    five = [mib] * 5
    row_table, row_slot, row_ids = tables[0]
    res["cpu_us"] = {
        "op + wait_tensor": per_call_us(lambda: wait(op(mib, 2, name))),
        "coalesced x5 + 5 waits": per_call_us(lambda: [wait(o) for o in opc(five, 2, name)]),
        "row gather 4096 x 8 KiB": per_call_us(lambda: gather.gather_rows(row_table, row_slot, row_ids)),
    }
    res["device_us"] = {"row gather 4096 x 8 KiB": device_us(lambda: gather.gather_rows(row_table, row_slot, row_ids))}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"[{a.label}] {res['kernel_path']}")
    print(f"[{a.label}] exact gathers {all(res['exact'])}, rows {all(res['rows_exact'])}; "
          + ", ".join(f"{k} {v:.1f} us" for k, v in res["cpu_us"].items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
