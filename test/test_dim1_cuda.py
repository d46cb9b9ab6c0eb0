"""Shard(d) strided reads on CUDA (NOTE [strided reads] in csrc/ce_copy.h), one GPU.

Loopback slots (``cuda_helpers.register_loopback``: the "peer" copy is a second local
tensor on the same GPU) check ``magi.ce_all_gather_dim`` exactly against
``torch.cat([rank 0's shard, rank 1's shard], d)`` for every strided strategy ("rows":
one batch entry per row block, "2d": one cudaMemcpy2DAsync per peer block, "3d": one
cudaMemcpy3DBatchAsync), both positions of this rank in the pair, the own block on the
second copy stream or in the peer batch, dims 1 and 2 of 3-D expert weights (bf16 and
fp32, row blocks from 64 B to 3 MiB), through the C++ kernel and the Python kernel's
hand-back; in stream order (the current stream busy when the gather is issued); and in a
captured CUDA graph (always "2d" there) replayed with new contents.

Run on the GPU machine (one GPU is enough):
    PYTHONPATH=$PWD python3 -m pytest -q -s test/test_dim1_cuda.py
Skipped without a GPU or without the built C++ library.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from cuda_helpers import register_loopback
from mp_harness import run_ranks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        not any(f.startswith("_ce_torch") for f in os.listdir(os.path.join(
            os.path.dirname(__file__), "..", "torch_ce", "runtime"))),
        reason="the C++ gather kernels are not built (CPU torch or no nvcc)"),
]

# (shape of one rank's shard, dtype, gather dim): experts [E, h, D] on dim 1, and on dim 2.
CASES = [
    ((4, 8, 16), torch.float32, 1),      # 512 B row blocks
    ((8, 96, 256), torch.bfloat16, 1),   # 48 KiB row blocks, 8 of them
    ((128, 24, 64), torch.bfloat16, 1),  # 128 small row blocks (3 KiB)
    ((2, 768, 1024), torch.bfloat16, 1), # 1.5 MiB row blocks
    ((4, 64, 8), torch.float32, 2),      # dim 2: 256 rows of 32 B
    ((3, 5, 7), torch.float32, 2),       # odd sizes, 28 B rows
    ((256, 7), torch.bfloat16, 1),       # a 2-D Linear shard: 256 rows of 14 B
]
STRATEGIES = ("rows", "2d", "3d")


def _wait(t):
    return torch.ops._c10d_functional.wait_tensor(t)


def _pairs(dev, gen, pos):
    out = []
    for shape, dtype, dim in CASES:
        mine = torch.randn(shape, generator=gen, device=dev).to(dtype)
        peer = torch.randn(shape, generator=gen, device=dev).to(dtype)
        register_loopback(mine, peer, dist.group.WORLD, pos)
        out.append((mine, peer, dim))
    return out


def _expected(mine, peer, dim, pos):
    return torch.cat([mine, peer] if pos == 0 else [peer, mine], dim).cpu()


def _loop_exact(rank, world):
    from torch_ce.runtime import native
    from torch_ce.runtime.gather import dim_strategy_as

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev).manual_seed(os.getpid())
    name = dist.group.WORLD.group_name
    res = dict(loaded=native.loaded(), default=native.dim_strategy())
    keep = []
    for pos in (0, 1):
        pairs = _pairs(dev, gen, pos)
        keep.append(pairs)
        for strategy in STRATEGIES:
            for split in (True, False):
                native.set_split_local_copy(split)
                with dim_strategy_as(strategy):
                    got = [_wait(torch.ops.magi.ce_all_gather_dim(m, 2, name, d)).cpu() for m, _, d in pairs]
                    back = [_wait(torch.ops.torch_ce.gather_dim_python(m, 2, name, d)).cpu() for m, _, d in pairs]
                    torch.cuda._sleep(int(5e7))  # busy stream: the copies must start after it
                    m, p, d = pairs[3]
                    ordered = bool(torch.equal((_wait(torch.ops.magi.ce_all_gather_dim(m, 2, name, d)) * 1).cpu(),
                                               _expected(m, p, d, pos)))
                exp = [_expected(m, p, d, pos) for m, p, d in pairs]
                res[f"{strategy}_pos{pos}_split{int(split)}"] = dict(
                    native=[bool(torch.equal(a, b)) for a, b in zip(got, exp, strict=True)],
                    python=[bool(torch.equal(a, b)) for a, b in zip(back, exp, strict=True)],
                    ordered=ordered,
                    shapes=[tuple(a.shape) == tuple(b.shape) for a, b in zip(got, exp, strict=True)])
    native.set_split_local_copy(True)
    res["strategy_after"] = native.dim_strategy()
    try:
        torch.ops.magi.ce_all_gather_dim(torch.randn(4, 4, device=dev), 2, name, 1)
        res["unbound"] = "no error"
    except RuntimeError as e:
        res["unbound"] = str(e)
    return res


def test_loopback_dim_gathers_exact():
    (r,) = run_ranks(_loop_exact, 1, timeout=600)
    print(r)
    assert r["loaded"], r
    from torch_ce.runtime import gather
    default = gather.DIM_STRATEGIES["3d"]  # one cudaMemcpy3DBatchAsync (NOTE [strided reads])
    assert r["default"] == default and r["strategy_after"] == default, r
    for strategy in STRATEGIES:
        for pos in (0, 1):
            for split in (0, 1):
                v = r[f"{strategy}_pos{pos}_split{split}"]
                assert all(v["shapes"]), (strategy, pos, split, v)
                assert all(v["native"]), (strategy, pos, split, v)
                assert all(v["python"]), (strategy, pos, split, v)
                assert v["ordered"], (strategy, pos, split, v)
    assert "not bound to a symmetric window" in r["unbound"], r


def _loop_graph(rank, world):
    """A captured dim gather (cudaMemcpy2DAsync nodes) replays the reads exactly."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev).manual_seed(os.getpid())
    name = dist.group.WORLD.group_name
    pairs = _pairs(dev, gen, 1)[:4]

    def step():
        return [_wait(torch.ops.magi.ce_all_gather_dim(m, 2, name, d)) * 2 for m, _, d in pairs]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = step()
    res = {}
    for trial in range(2):
        with torch.no_grad():
            for m, p, _ in pairs:
                m.copy_(torch.randn(m.shape, generator=gen, device=dev).to(m.dtype))
                p.copy_(torch.randn(p.shape, generator=gen, device=dev).to(p.dtype))
        exp = [_expected(m, p, d, 1) * 2 for m, p, d in pairs]
        g.replay()
        torch.cuda.synchronize()
        res[f"replay{trial}"] = [bool(torch.equal(o.cpu(), e)) for o, e in zip(static, exp, strict=True)]
    return res


def test_loopback_dim_gather_in_cuda_graph():
    (r,) = run_ranks(_loop_graph, 1, timeout=300)
    print(r)
    assert all(r["replay0"]) and all(r["replay1"]), r
