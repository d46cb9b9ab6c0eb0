"""``torch-ce demo``: the five-minute tour, on whatever this machine has.

With >= 2 GPUs: 2 ranks on NCCL, bf16, the CUDA copy-engine transport. Otherwise: 2 CPU
ranks on gloo, fp32, the host (shared-memory) transport. Either way it builds a small
SimpleFSDP decoder, compiles it with plain torch.compile twice (transport "nccl", then
"copy_engine"), prints the explain report, checks the outputs match, and times both.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from ._net import free_port


def _say(rank: int, *msg) -> None:
    if rank == 0:
        print("[torch-ce demo]", *msg, flush=True)


def _time_ms(fn, x, iters: int, cuda: bool) -> float:
    import torch

    for _ in range(2):
        fn(x)
    if cuda:
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn(x)
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - t0) * 1e3 / iters


def _rank_main(rank: int, world: int, port: int, cuda: bool, args, results) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch_ce
    from torch_ce.simple_fsdp import build

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.cache_dir, f"rank{rank}")
    if cuda:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, device_id=dev)
        dtype = torch.bfloat16
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        dtype = torch.float32
        torch.set_num_threads(1)
    mesh = init_device_mesh(dev.type, (world,))
    dims = dict(layers=args.layers, dim=args.dim, ffn=args.ffn, heads=args.heads)
    model = build(0, dev, dtype, mesh, **dims)
    torch.manual_seed(1234)
    x = torch.randn(1, args.tokens, args.dim, device=dev, dtype=dtype)
    outs, times = {}, {}
    try:
        for transport in ("nccl", "copy_engine"):
            what = f"{dist.get_backend()} collectives" if transport == "nccl" else (
                "copy engines" if cuda else "host transport")
            _say(rank, f"compiling with transport={transport!r} ({what}) ...")
            torch._dynamo.reset()
            torch_ce.enable(transport=transport)
            compiled = torch.compile(model)
            t0 = time.perf_counter()
            with torch.no_grad():
                outs[transport] = compiled(x).float().cpu()
                _say(rank, f"  first call (compile + bind) took {time.perf_counter() - t0:.1f} s")
                times[transport] = _time_ms(compiled, x, args.iters, cuda)
            torch_ce.disable()
            if transport == "nccl":  # the report below is the copy-engine compile's
                torch_ce.report.clear()
        same = torch.equal(outs["nccl"], outs["copy_engine"])
        diff = (outs["nccl"] - outs["copy_engine"]).abs().max().item()
        if rank == 0:
            print(torch_ce.explain().table(), flush=True)
        results[rank] = dict(exact=same, max_abs_diff=diff, times=times,
                             bound=sum(len(b.bound) for b in torch_ce.report.binds))
    finally:
        torch_ce.disable()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torch-ce demo", description=__doc__)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--cpu", action="store_true", help="use 2 CPU ranks even if GPUs exist")
    args = p.parse_args(argv)

    import torch
    import torch.multiprocessing as mp

    cuda = not args.cpu and torch.cuda.device_count() >= 2
    args.dim = args.dim or (2048 if cuda else 256)
    args.ffn = args.ffn or (4 * args.dim if cuda else 512)
    args.tokens = args.tokens or (2048 if cuda else 64)
    args.iters = args.iters or (20 if cuda else 5)
    world = 2
    where = "2 GPUs, NCCL, copy-engine transport" if cuda else "2 CPU ranks, gloo, host transport"
    print(f"[torch-ce demo] {where}; decoder {args.layers} layers, dim {args.dim}, "
          f"{args.tokens} tokens", flush=True)
    with tempfile.TemporaryDirectory(prefix="torch_ce_demo_") as cache_dir:
        args.cache_dir = cache_dir
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager:
            results = manager.dict()
            mp.start_processes(_rank_main, args=(world, free_port(), cuda, args, results),
                               nprocs=world, start_method="spawn", join=True)
            results = dict(results)
    r0 = results[0]
    t = r0["times"]
    backend = "nccl" if cuda else "gloo"
    ce = "copy engines" if cuda else "host transport"
    print(f"[torch-ce demo] outputs {'identical' if r0['exact'] else 'differ'} "
          f"(max abs diff {r0['max_abs_diff']:.3g}); {r0['bound']} weight shard(s) bound per rank",
          flush=True)
    print(f"[torch-ce demo] forward: {backend} gathers {t['nccl']:.2f} ms, torch_ce ({ce}) "
          f"{t['copy_engine']:.2f} ms ({t['copy_engine'] / t['nccl']:.2f}x)", flush=True)
    ok = all(r["exact"] or r["max_abs_diff"] < 1e-2 for r in results.values()) and r0["bound"] > 0
    print("[torch-ce demo] OK" if ok else "[torch-ce demo] FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
