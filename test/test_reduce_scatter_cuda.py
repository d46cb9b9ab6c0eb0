"""The copy-engine reduce-scatter on CUDA (NOTE [copy-engine reduce-scatter] in
torch_ce/runtime/reduce_scatter.py).

One GPU, loopback workspaces (``cuda_helpers.loopback_workspaces``: one process plays every
rank of the group; each "rank" launches, then each completes, the order the protocol's
waits need):

- ``test_loopback_exact``: worlds 2 and 3; fp32 and bf16, sum and avg, single and
  coalesced buckets (these completed by their outputs' ``wait_tensor``: the op's c10d
  work), ten calls in a row (both halves, the flags back to their start after each): every rank's output equals the documented sum (group index order, fp32), and at
  world 2 fp32 the plain ``a + b``; the flags end as they began.
- ``test_capture_and_replays``: the same calls captured in a CUDA graph and replayed
  five times while the inputs change: each replay exact on the new inputs.
- ``test_profile_has_no_transport_kernel``: a profiled call runs the pushes as memcpys,
  the flags as stream memory operations, and no kernel but the reduction's (an add per
  peer; a cast for bf16); no host synchronisation.
- ``test_one_hardware_queue``: the three tests above again in a subprocess with
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (every stream on one queue): they finish, exact.
- ``test_two_gpus``: 2 NCCL ranks (skipped with one GPU): the op against NCCL's
  reduce_scatter_tensor, a rank seconds late, bit-identical; then a peer that does not
  push for longer than ``rs_timeout_s`` makes its watchdog log the error naming the
  bucket, and the next call raises it (the late push then releases the stream).

Skipped without a GPU or without the built C++ library (the stream flag ops are there).
Run: ``python3 -m pytest -q test/test_reduce_scatter_cuda.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from cuda_helpers import loopback_reduce_scatter, loopback_workspaces, needs_gpu_and_kernels, needs_gpu_world

pytestmark = needs_gpu_and_kernels


def _documented(xs_by_rank: list, r: int, w: int, op: str) -> list:
    """Rank r's outputs by the documented order: chunk r summed over group index order."""
    outs = []
    for k in range(len(xs_by_rank[0])):
        acc = None
        for j in range(w):
            c = xs_by_rank[j][k].chunk(w)[r].float()
            acc = c.clone() if acc is None else acc.add_(c)
        if op == "avg":
            acc = acc / w
        outs.append(acc.to(xs_by_rank[0][k].dtype))
    return outs


def _inputs(w, dtype, gen, coalesced, rows=6):
    per = [[torch.randn(w * rows, 33, device="cuda", generator=gen).to(dtype)] for _ in range(w)]
    if coalesced:
        for xs in per:
            xs.append(torch.randn(w * 5, device="cuda", generator=gen).to(dtype))
    return per


@pytest.mark.parametrize("world", [2, 3])
def test_loopback_exact(world):
    gen = torch.Generator(device="cuda").manual_seed(11 + world)
    for dtype in (torch.float32, torch.bfloat16):
        wss = loopback_workspaces(world, 4096, dtype)
        start = [ws.flags.clone() for ws in wss]
        for call in range(10):
            op = "avg" if call % 3 == 2 else "sum"
            xs = _inputs(world, dtype, gen, coalesced=call % 2 == 1)
            # Odd calls (the coalesced ones) through the outputs' wait_tensor, as in a graph.
            outs = loopback_reduce_scatter(wss, xs, op, f"call {call}", via_wait_tensor=call % 2 == 1)
            torch.cuda.synchronize()
            for r in range(world):
                want = _documented(xs, r, world, op)
                for o, e in zip(outs[r], want, strict=True):
                    assert torch.equal(o, e), (world, dtype, call, r)
                if world == 2 and dtype == torch.float32 and op == "sum":
                    assert torch.equal(outs[r][0], xs[0][0].chunk(2)[r] + xs[1][0].chunk(2)[r])
        for ws, f in zip(wss, start, strict=True):
            assert torch.equal(ws.flags, f), (ws.flags, f)  # every flag back where it began


def test_capture_and_replays():
    w, dtype = 2, torch.float32
    gen = torch.Generator(device="cuda").manual_seed(5)
    wss = loopback_workspaces(w, 4096, dtype)
    static = _inputs(w, dtype, gen, coalesced=True)
    loopback_reduce_scatter(wss, static)  # warm: the streams, events and allocations exist
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = loopback_reduce_scatter(wss, static, "sum", "captured")
    for k in range(5):
        fresh = _inputs(w, dtype, gen, coalesced=True)
        for xs, ys in zip(static, fresh, strict=True):
            for x, y in zip(xs, ys, strict=True):
                x.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        for r in range(w):
            for o, e in zip(outs[r], _documented(fresh, r, w, "sum"), strict=True):
                assert torch.equal(o, e), (k, r)


def test_profile_has_no_transport_kernel():
    from torch.profiler import ProfilerActivity, profile

    w = 2
    gen = torch.Generator(device="cuda").manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        wss = loopback_workspaces(w, 1 << 16, dtype)
        xs = [[torch.randn(w * 256, 64, device="cuda", generator=gen).to(dtype)] for _ in range(w)]
        loopback_reduce_scatter(wss, xs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loopback_reduce_scatter(wss, xs)
            torch.cuda.synchronize()
        events = prof.events()
        kernels = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                   and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()
                   and "stream" not in e.name.lower()]
        memcpys = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                   and "memcpy" in e.name.lower()]
        syncs = [e.name for e in events if "Synchronize" in e.name and e.name != "cudaDeviceSynchronize"]
        # One add per rank (world 2: a + b), and for bf16 the fp32 accumulator's casts.
        allowed = ("add", "copy", "elementwise", "vectorized", "unrolled")
        assert kernels and all(any(a in k.lower() for a in allowed) for k in kernels), kernels
        assert len(memcpys) >= w * (w - 1), memcpys  # the pushes: one memcpy per (rank, peer)
        assert not syncs, syncs


@pytest.mark.skipif(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", reason="already on one queue")
def test_one_hardware_queue():
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(here, os.path.basename(__file__)),
           "-k", "loopback_exact or capture_and_replays or profile_has_no_transport_kernel"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=here, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert " passed" in p.stdout and "failed" not in p.stdout, p.stdout[-2000:]
    print(f"one hardware queue: {p.stdout.strip().splitlines()[-1]} ({time.monotonic() - t0:.0f} s)")


def _two_gpus(rank, world, seed):
    import torch.distributed as dist

    import torch_ce
    from torch_ce.runtime.rs_workspace import ReduceScatterError

    torch_ce.config.update(rs_timeout_s=5.0)
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    for call in range(6):
        if rank == 1 and call == 1:
            time.sleep(2.0)
        dtype = torch.bfloat16 if call % 2 else torch.float32
        x = torch.randn(world * 1024, 257, device="cuda", generator=gen).to(dtype)
        out = torch_ce.reduce_scatter(x, dist.group.WORLD)
        ref = torch.empty_like(out)
        dist.reduce_scatter_tensor(ref, x, group=dist.group.WORLD)
        torch.cuda.synchronize()
        assert torch.equal(out, ref), (call, float((out.float() - ref.float()).abs().max()))
    name = dist.group.WORLD.group_name
    if rank == 1:
        time.sleep(15.0)  # pushes the next call only after its peer's watchdog fired
        torch.ops._c10d_functional.wait_tensor(torch.ops.magi.ce_reduce_scatter(x, "sum", world, name, "the stuck bucket"))
        torch.cuda.synchronize()
        return "late"
    torch.ops._c10d_functional.wait_tensor(torch.ops.magi.ce_reduce_scatter(x, "sum", world, name, "the stuck bucket"))
    time.sleep(8.0)  # the watchdog sees the stream wait pass rs_timeout_s
    with pytest.raises(ReduceScatterError, match="the stuck bucket"):
        torch_ce.reduce_scatter(x, dist.group.WORLD)
    torch.cuda.synchronize()  # released by the peer's late push
    return "raised"


@needs_gpu_world
def test_two_gpus():
    from mp_harness import run_ranks, seed_base

    got = run_ranks(_two_gpus, 2, seed_base(), backend="nccl", timeout=180)
    assert got == ["raised", "late"], got
