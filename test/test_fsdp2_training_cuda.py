"""FSDP2's training gathers on one GPU (loopback): the step words as stream operations
(NOTE [FSDP2 step words on CUDA] in csrc/ce_flags.cu), one comm per simulated rank
(``torch_ce.bench.fsdp2.loopback_training_comms``), each rank on a stream of its own.

- Exact over several steps at worlds 2 and 3, fp32 and bf16, fresh random chunks per step,
  one rank enqueuing seconds after its peers, and a rank two steps ahead (its second call
  must wait until its peers left its first chunk before it overwrites it).
- A dead peer (a rank that never calls): the stream watchdog releases the waiting stream
  within the timeout plus a margin, under both queue settings (each in a process of its
  own: the driver reads CUDA_DEVICE_MAX_CONNECTIONS at start); the error names the peer,
  the group's next gather raises, and with two queues the released peer parts are NaN.
- No kernel in a profile of a call: copies and stream memory operations only.
- The words in a registered host mapping, as the bind puts them (held, counted, let go).
"""
from __future__ import annotations

import time

import pytest
import torch

from cuda_helpers import needs_gpu_and_kernels
from mp_harness import run_ranks

pytestmark = needs_gpu_and_kernels


def _call(comm, out, i, n, group):
    return comm(output_tensor=out, input_tensor=out[i * n:(i + 1) * n], group=group, async_op=False)


def _exact_over_steps(rank, world_size, world, dtype_name, late_s):
    import torch.distributed as dist

    from torch_ce.bench.fsdp2 import loopback_training_comms

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device=dev).manual_seed(20261206 + world)
    group = dist.group.WORLD
    n = 4096 * 3 + 7 * world
    comms = loopback_training_comms([torch.empty(n, dtype=dtype, device=dev) for _ in range(world)])
    streams = [torch.cuda.Stream(dev) for _ in range(world)]
    steps, results = 5, []
    # Each "step" is one gather of the group on every rank; rank 0 enqueues two steps at a
    # time (its second overwrites its staging buffer only after every peer left the first),
    # the last rank enqueues ``late_s`` after the others.
    pending = []
    for step in range(steps):
        chunks = [torch.randn(n, device=dev, generator=gen).to(dtype) for _ in range(world)]
        outs = []
        for i in range(world):
            o = torch.randn(world * n, device=dev, generator=gen).to(dtype)  # noise where peers land
            o[i * n:(i + 1) * n].copy_(chunks[i])  # FSDP2's copy-in
            outs.append(o)
        torch.cuda.synchronize()
        pending.append((chunks, outs))
    order = []
    for step in range(0, steps, 2):
        order += [(0, s) for s in range(step, min(step + 2, steps))]
        order += [(i, s) for s in range(step, min(step + 2, steps)) for i in range(1, world - 1)]
        order += [("late", s) for s in range(step, min(step + 2, steps))]
    for who, s in order:
        chunks, outs = pending[s]
        if who == "late":
            time.sleep(late_s)
            who = world - 1
        with torch.cuda.stream(streams[who]):
            assert _call(comms[who], outs[who], who, n, group) is None
    torch.cuda.synchronize()
    for chunks, outs in pending:
        want = torch.cat(chunks)
        results.append([bool(torch.equal(o, want)) for o in outs])
    words = [comm.bound.words.peer_views[comm.rank].tolist() for comm in comms]
    return dict(exact=results, calls=[c.calls for c in comms], words=words)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_step_words_exact_over_steps(world, dtype):
    (r,) = run_ranks(_exact_over_steps, 1, world, dtype, 1.0, backend="nccl", timeout=90)
    assert all(all(x) for x in r["exact"]), r["exact"]
    assert r["calls"] == [5] * world, r["calls"]
    # Every rank's ready at the last call, its done one behind (written at the next call's
    # head: NOTE [FSDP2 step words on CUDA]).
    assert r["words"] == [[5, 4]] * world, r["words"]


def _dead_peer(rank, world_size, timeout_s):
    import torch.distributed as dist

    from torch_ce.bench.fsdp2 import loopback_training_comms
    from torch_ce.config import config

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    config.fsdp2_timeout_s = timeout_s
    group = dist.group.WORLD
    n = 1 << 16
    comms = loopback_training_comms([torch.empty(n, device=dev) for _ in range(2)])
    for c in comms:
        c.timeout_s = timeout_s
    s0 = torch.cuda.Stream(dev)
    outs = [torch.randn(2 * n, device=dev) for _ in range(2)]
    torch.cuda.synchronize()
    # One full step first: both ranks.
    for i in range(2):
        with torch.cuda.stream(s0 if i == 0 else torch.cuda.Stream(dev)):
            _call(comms[i], outs[i], i, n, group)
    torch.cuda.synchronize()
    first_ok = bool(torch.equal(outs[0], outs[1]))
    # Rank 1 dies: rank 0's second gather waits for a chunk that never comes.
    out = torch.randn(2 * n, device=dev)
    mine = out[:n].clone()
    t0 = time.monotonic()
    with torch.cuda.stream(s0):
        _call(comms[0], out, 0, n, group)
    torch.cuda.synchronize()  # returns once the watchdog released the stream
    released_s = time.monotonic() - t0
    try:
        _call(comms[0], out, 0, n, group)
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    peer_part = out[n:]
    return dict(first_ok=first_ok, released_s=released_s, poison=comms[0].poison, raised=raised,
                mine_kept=bool(torch.equal(out[:n], mine)), peer_nan=bool(torch.isnan(peer_part).all()))


@pytest.mark.parametrize("queues", ["default", "one"])
def test_dead_peer_released_by_the_watchdog(queues):
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1" if queues == "one" else "8"}
    timeout_s = 3.0
    (r,) = run_ranks(_dead_peer, 1, timeout_s, backend="nccl", timeout=90, env=env)
    assert r["first_ok"]
    assert timeout_s <= r["released_s"] < timeout_s + 10.0, r["released_s"]
    assert "rank 1 did not begin gather 2" in r["poison"], r["poison"]
    assert "rank 1 did not begin gather 2" in r["raised"], r["raised"]
    assert r["mine_kept"]
    if queues == "default":
        assert r["peer_nan"], "the released peer part must be NaN, never stale weights"


def _no_kernel(rank, world_size):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from torch_ce.bench.fsdp2 import loopback_training_comms

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    group = dist.group.WORLD
    n = 1 << 18
    comms = loopback_training_comms([torch.empty(n, dtype=torch.bfloat16, device=dev) for _ in range(2)])
    streams = [torch.cuda.Stream(dev) for _ in range(2)]
    chunks = [torch.randn(n, device=dev).to(torch.bfloat16) for _ in range(2)]
    outs = [torch.empty(2 * n, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    for i in range(2):
        outs[i][i * n:(i + 1) * n].copy_(chunks[i])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(2):
            with torch.cuda.stream(streams[i]):
                _call(comms[i], outs[i], i, n, group)
        torch.cuda.synchronize()
    ev = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    want = torch.cat(chunks)
    return dict(kernels=[k for k in ev if not any(s in k.lower() for s in ("memcpy", "memset", "stream"))],
                memcpys=len([k for k in ev if "memcpy" in k.lower()]),
                exact=[bool(torch.equal(o, want)) for o in outs])


def test_training_gather_no_kernel():
    (r,) = run_ranks(_no_kernel, 1, backend="nccl", timeout=90)
    assert r["exact"] == [True, True]
    assert r["kernels"] == [], r["kernels"]
    assert r["memcpys"] >= 4, r["memcpys"]  # per rank: its chunk staged, its peer's read


def _registered_window_words(rank, world_size):
    """The words where FSDP2's bind puts them: a host window's mapping (an mmap), registered
    with CUDA by ``step_words.hold``, unregistered by ``let_go`` + ``flush``."""
    import mmap
    import types

    import torch.distributed as dist

    from torch_ce.bench.fsdp2 import loopback_training_comms
    from torch_ce.fsdp2 import step_words

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    group = dist.group.WORLD
    mm = mmap.mmap(-1, mmap.PAGESIZE)
    page = torch.frombuffer(mm, dtype=torch.uint8, count=mmap.PAGESIZE)
    slot = types.SimpleNamespace(window=types.SimpleNamespace(peer_locals=[page]))
    step_words.hold(slot)
    step_words.hold(slot)  # a second group on the same window: counted, registered once
    registered = step_words.registered()
    words_all = page.view(torch.int32)
    words = [words_all[2 * i:2 * i + 2] for i in range(2)]
    n = 5000
    comms = loopback_training_comms([torch.empty(n, device=dev) for _ in range(2)], words)
    streams = [torch.cuda.Stream(dev) for _ in range(2)]
    exact = []
    for step in range(3):
        chunks = [torch.randn(n, device=dev) for _ in range(2)]
        outs = [torch.randn(2 * n, device=dev) for _ in range(2)]
        for i in range(2):
            outs[i][i * n:(i + 1) * n].copy_(chunks[i])
        torch.cuda.synchronize()
        for i in (1, 0):
            with torch.cuda.stream(streams[i]):
                _call(comms[i], outs[i], i, n, group)
        torch.cuda.synchronize()
        exact.append([bool(torch.equal(o, torch.cat(chunks))) for o in outs])
    step_words.let_go(step_words.bases(slot))
    after_one = step_words.flush()
    step_words.let_go(step_words.bases(slot))
    after_two = step_words.flush()
    return dict(registered=registered, exact=exact, words=words_all[:4].tolist(), flushed=[after_one, after_two],
                left=step_words.registered())


def test_registered_host_window_words():
    (r,) = run_ranks(_registered_window_words, 1, backend="nccl", timeout=90)
    assert r["registered"] == 1
    assert all(all(x) for x in r["exact"]), r["exact"]
    assert r["words"] == [3, 2, 3, 2]
    assert r["flushed"] == [0, 1] and r["left"] == 0, r
