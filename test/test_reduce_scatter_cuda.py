"""The copy-engine reduce-scatter on CUDA (NOTE [copy-engine reduce-scatter] in
torch_ce/runtime/reduce_scatter/__init__.py).

One GPU, loopback workspaces (``cuda_helpers.loopback_workspaces``: one process plays every
rank of the group; each "rank" launches, then each completes, the order the protocol's
waits need):

- ``test_loopback_exact``: worlds 2 and 3; fp32 and bf16, sum and avg, single and
  coalesced buckets (these completed by their outputs' ``wait_tensor``: the op's c10d
  work), ten calls in a row (both halves, the flags back to their start after each): every rank's output equals the documented sum (group index order, fp32), and at
  world 2 fp32 the plain ``a + b``; the flags end as they began.
- ``test_loopback_many_members``: buckets of five uneven members (the native pushes'
  batched memcpys), worlds 2 and 3, exact.
- ``test_capture_and_replays``: the same calls captured in a CUDA graph and replayed
  five times while the inputs change: each replay exact on the new inputs.
- ``test_profile_has_no_transport_kernel``: a profiled call runs the pushes as memcpys,
  the flags as stream memory operations, and no kernel but the reduction's (an add per
  peer; a cast for bf16); no host synchronisation.
- ``test_one_hardware_queue``: the tests above again in a subprocess with
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (every stream on one queue): they finish, exact.
- ``test_flag_order_under_load``: 24 calls of 32 MiB slices enqueued back to back, no
  host sync between them, then every output checked: a flag never lets a reduction read a
  slice before its push landed (the writer's flag write carries a memory barrier, on the
  stream that pushed: NOTE [stream flags]; DESIGN "Flag waits observe the data").
- ``test_dead_peer_releases_the_host``: in a subprocess with a hard timeout, with and
  without ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (there the native path on host-mapped flags,
  and under the default queues those forced too): "rank 0" completes a call "rank 1" never
  pushes, and the host sits in ``torch.cuda.synchronize()``: it returns within
  ``rs_timeout_s`` plus a margin (the watchdog released the wait), the outputs are NaN,
  the next call raises naming the bucket and the peer; a call whose peer pushed another
  call's slice (another size) is released the same way and names both; fresh workspaces
  (a new generation) are exact.
- ``test_two_gpus``: 2 NCCL ranks (skipped with one GPU): the op against NCCL's
  reduce_scatter_tensor, a rank seconds late, bit-identical; then a peer that does not
  push for longer than ``rs_timeout_s``: the waiting rank's watchdog releases its stream
  (NaN outputs) and its next call raises naming the bucket; the late rank's stream is
  released at its peer's abort and its next call raises too; then fresh calls are exact.

The loopback tests run three times: on the Python launch and completion, with
``config.rs_native`` on the C++ ones with the fused reduction kernel (NOTE [native
reduce-scatter path] in csrc/ce_reduce_scatter.cu; skipped where the library lacks them), and those
with ``config.rs_host_flags`` (flags, headers and poison words in registered /dev/shm
segments: what one hardware queue gets, NOTE [poison word]).
``test_native_runs_one_reduction_kernel`` profiles a native call: the pushes' memcpys, and
exactly one kernel per rank and call, the reduction (``reduce_kernel``: the CUDA one, or
the Triton one in a library built without nvcc).

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


@pytest.fixture(params=["python", "native", "native_host_flags"])
def rs_native(request):
    """Each loopback test on the Python path, on the native one (config.rs_native), and on
    the native one with host-mapped flags (config.rs_host_flags: what one hardware queue
    gets; NOTE [poison word] in csrc/ce_flags.cu)."""
    import torch_ce
    from torch_ce.runtime import native
    from torch_ce.runtime.reduce_scatter import host_flags as HF

    on = request.param != "python"
    if on and not native.has_rs_native():
        pytest.skip("the library has no native reduce-scatter (rebuild csrc/)")
    host = True if request.param == "native_host_flags" else None
    with torch_ce.config.patch(rs_native=on, rs_host_flags=host):
        if host and HF.unavailable():
            pytest.skip(f"no host-mapped flags here: {HF.unavailable()}")
        yield on


def _documented(xs_by_rank: list, r: int, w: int, op: str) -> list:
    """Rank r's outputs by the documented order: chunk r summed over group index order
    (premul_sum: each chunk times the factor first)."""
    from torch_ce.runtime.reduce_scatter import premul_factor

    factor = premul_factor(op)
    outs = []
    for k in range(len(xs_by_rank[0])):
        acc = None
        for j in range(w):
            c = xs_by_rank[j][k].chunk(w)[r].float()
            if factor is not None:
                c = c * factor
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
def test_loopback_exact(world, rs_native):
    import gc
    import weakref

    from torch_ce.runtime import native

    gen = torch.Generator(device="cuda").manual_seed(11 + world)
    gc.collect()  # earlier tests' workspaces first (a workspace and its owed call hold each other)
    held = native.rs_handle_count() if rs_native else 0
    refs = []
    for dtype in (torch.float32, torch.bfloat16):
        wss = loopback_workspaces(world, 4096, dtype)
        start = [ws.flags.clone() for ws in wss]
        for call in range(10):
            op = "avg" if call % 3 == 2 else "sum"
            op = "premul_sum(0.125)" if call == 7 else op
            xs = _inputs(world, dtype, gen, coalesced=call % 2 == 1)
            # Odd calls (the coalesced ones) through the outputs' wait_tensor, as in a graph.
            # Call 4 writes into given outputs (FSDP2's hook), filled with noise first.
            given = [[torch.randn(x.shape[0] // world, *x.shape[1:], device="cuda", generator=gen).to(dtype)
                      for x in xs[r]] for r in range(world)] if call == 4 else None
            outs = loopback_reduce_scatter(wss, xs, op, f"call {call}", via_wait_tensor=call % 2 == 1,
                                           outs=given)
            torch.cuda.synchronize()
            if given is not None:
                assert [[o.data_ptr() for o in r] for r in outs] == [[g.data_ptr() for g in r] for r in given]
            for r in range(world):
                want = _documented(xs, r, world, op)
                for o, e in zip(outs[r], want, strict=True):
                    assert torch.equal(o, e), (world, dtype, call, r)
                if world == 2 and dtype == torch.float32 and op == "sum":
                    assert torch.equal(outs[r][0], xs[0][0].chunk(2)[r] + xs[1][0].chunk(2)[r])
        for ws, f in zip(wss, start, strict=True):
            assert torch.equal(ws.flags, f), (ws.flags, f)  # every flag back where it began
        refs += [weakref.ref(ws) for ws in wss]
    if rs_native:  # every C++ call and workspace forgotten once Python drops them
        del wss, outs, xs, ws
        time.sleep(0.2)  # the watchdog lets go of the done calls
        gc.collect()
        # A call still owed its completion (the pool's next call completes it) is held by
        # its workspace (``Workspace.owed``), and goes with it: nothing is left (earlier
        # tests' handles may go meanwhile, never come).
        assert all(r() is None for r in refs), [r() for r in refs]
        assert native.rs_handle_count() <= held, (native.rs_handle_count(), held)


@pytest.mark.parametrize("world", [2, 3])
def test_loopback_many_members(world, rs_native):
    """A bucket of five members of uneven sizes (a layer's bucket): the native launch pushes
    them to each peer in one cudaMemcpyBatchAsync (three or more members), the Python path
    one copy each; exact at worlds 2 and 3, fp32 and bf16, sum and avg, completed directly
    and through the outputs' wait_tensor."""
    gen = torch.Generator(device="cuda").manual_seed(31 + world)
    shapes = [(7, 33), (1,), (64, 5), (3, 1, 11), (130,)]
    for dtype in (torch.float32, torch.bfloat16):
        wss = loopback_workspaces(world, 4096, dtype)
        for call in range(6):
            xs = [[torch.randn(world * s[0], *s[1:], device="cuda", generator=gen).to(dtype) for s in shapes]
                  for _ in range(world)]
            op = "avg" if call == 3 else "sum"
            outs = loopback_reduce_scatter(wss, xs, op, f"many {call}", via_wait_tensor=call % 2 == 1)
            torch.cuda.synchronize()
            for r in range(world):
                want = _documented(xs, r, world, op)
                assert [o.shape for o in outs[r]] == [e.shape for e in want]
                for k, (o, e) in enumerate(zip(outs[r], want, strict=True)):
                    assert torch.equal(o, e), (world, dtype, call, r, k)


def test_capture_and_replays(rs_native):
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


def test_capture_while_the_watchdog_polls(rs_native):
    """A CUDA graph captured in CUDA's default (global) mode while the watchdog queries
    the events of calls still running stays valid (the watchdog's thread is relaxed), and
    the calls end exact."""
    w, dtype = 2, torch.float32
    gen = torch.Generator(device="cuda").manual_seed(21)
    wss = loopback_workspaces(w, 4096, dtype)
    loopback_reduce_scatter(wss, _inputs(w, dtype, gen, coalesced=False))
    torch.cuda.synchronize()
    xs = _inputs(w, dtype, gen, coalesced=False)
    a = torch.randn(4096, device="cuda", generator=gen)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time before the calls' inputs are ready
    outs = loopback_reduce_scatter(wss, xs)  # launched and completed: watched, not done
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):  # no synchronize first (torch.cuda.graph's would wait them out)
        graph.capture_begin(capture_error_mode="global")
        b = a * 3
        time.sleep(0.25)  # the watchdog ticks every 20 ms
        graph.capture_end()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(b, a * 3)
    for r in range(w):
        assert torch.equal(outs[r][0], _documented(xs, r, w, "sum")[0]), r


def test_profile_has_no_transport_kernel(rs_native):
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
        # One add per rank (world 2: a + b), and for bf16 the fp32 accumulator's casts; native:
        # the fused reduction alone.
        allowed = ("reduce_kernel",) if rs_native else ("add", "copy", "elementwise", "vectorized", "unrolled")
        assert kernels and all(any(a in k.lower() for a in allowed) for k in kernels), kernels
        assert len(memcpys) >= w * (w - 1), memcpys  # the pushes: one memcpy per (rank, peer)
        assert not syncs, syncs


@pytest.mark.skipif(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", reason="already on one queue")
def test_one_hardware_queue():
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(here, os.path.basename(__file__)),
           "-k", "loopback_exact or loopback_many_members or capture_and_replays or profile_has_no_transport_kernel or flag_order "
           "or native_runs_one_reduction_kernel"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=here, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert " passed" in p.stdout and "failed" not in p.stdout, p.stdout[-2000:]
    print(f"one hardware queue: {p.stdout.strip().splitlines()[-1]} ({time.monotonic() - t0:.0f} s)")


def test_flag_order_under_load(rs_native):
    mem_ops_v1, can_flush, wait_flags = torch.ops.torch_ce_native.stream_flags_info()
    assert wait_flags & 0x3 == 1  # EQ on the tag
    assert bool(wait_flags & (1 << 30)) == (can_flush == 1), (mem_ops_v1, can_flush, wait_flags)  # FLUSH iff supported
    w, dtype, n = 2, torch.float32, 8 << 20  # 32 MiB slices
    gen = torch.Generator(device="cuda").manual_seed(21)
    wss = loopback_workspaces(w, n, dtype)
    xs_all, outs_all = [], []
    for call in range(24):  # enqueued back to back: the flags alone order them
        xs = [[torch.randn(w * n, device="cuda", generator=gen)] for _ in range(w)]
        xs_all.append(xs)
        outs_all.append(loopback_reduce_scatter(wss, xs))
    torch.cuda.synchronize()
    for call, (xs, outs) in enumerate(zip(xs_all, outs_all, strict=True)):
        for r in range(w):
            assert torch.equal(outs[r][0], xs[0][0].chunk(2)[r] + xs[1][0].chunk(2)[r]), (call, r)


def test_native_runs_one_reduction_kernel():
    """rs_native: a profiled call (every "rank" of the loopback) runs the pushes as
    memcpys, the flags as stream memory operations, and exactly one kernel per rank, the
    fused reduction; no host synchronisation. Worlds 2 and 3, fp32 and bf16, a coalesced
    bucket (one kernel for all its members)."""
    from torch.profiler import ProfilerActivity, profile

    import torch_ce
    from torch_ce.runtime import native

    if not native.has_rs_native():
        pytest.skip("the library has no native reduce-scatter (rebuild csrc/)")
    gen = torch.Generator(device="cuda").manual_seed(19)
    with torch_ce.config.patch(rs_native=True):
        for w in (2, 3):
            for dtype in (torch.float32, torch.bfloat16):
                wss = loopback_workspaces(w, 1 << 16, dtype)
                xs = _inputs(w, dtype, gen, coalesced=True, rows=64)
                loopback_reduce_scatter(wss, xs)  # warm (the kernel's module loaded)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    outs = loopback_reduce_scatter(wss, xs)
                    torch.cuda.synchronize()
                for r in range(w):
                    for o, e in zip(outs[r], _documented(xs, r, w, "sum"), strict=True):
                        assert torch.equal(o, e), (w, dtype, r)
                events = prof.events()
                dev = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
                kernels = [n for n in dev if "memcpy" not in n.lower() and "memset" not in n.lower()
                           and "stream" not in n.lower()]
                memcpys = [n for n in dev if "memcpy" in n.lower()]
                syncs = [e.name for e in events if "Synchronize" in e.name and e.name != "cudaDeviceSynchronize"]
                assert len(kernels) == w and all("reduce_kernel" in k for k in kernels), (w, dtype, kernels)
                assert len(memcpys) >= w * (w - 1) * 2, memcpys  # a memcpy per (rank, peer, member)
                assert not syncs, syncs


@pytest.mark.skipif(not os.environ.get("CE_TEST_DEAD_PEER"),
                    reason="run by test_dead_peer_releases_the_host, in a subprocess with a hard timeout")
def test_dead_peer_child():
    import torch_ce
    from torch_ce.runtime.reduce_scatter import ReduceScatterError, launch as RS

    torch_ce.config.update(rs_timeout_s=2.0, rs_native=os.environ.get("CE_TEST_RS_NATIVE") == "1",
                           rs_host_flags=True if os.environ.get("CE_TEST_HOST_FLAGS") == "1" else None)
    from torch_ce.runtime.reduce_scatter import host_flags as HF

    host = HF.wanted()  # one queue with the native path: host-mapped flags, as the op would
    w, dtype = 2, torch.float32
    gen = torch.Generator(device="cuda").manual_seed(3)
    wss = loopback_workspaces(w, 1 << 16, dtype)
    xs = _inputs(w, dtype, gen, coalesced=False, rows=64)
    outs = loopback_reduce_scatter(wss, xs)  # exact first (and the reduction's kernels loaded)
    torch.cuda.synchronize()
    for r in range(w):
        assert torch.equal(outs[r][0], _documented(xs, r, w, "sum")[0])
    # "rank 1" never pushes: the host waits in synchronize until the watchdog releases it.
    xs = _inputs(w, dtype, gen, coalesced=False, rows=64)
    call = RS.launch(wss[0], xs[0], "sum", "the dead peer's bucket")
    RS.complete(call)
    torch.cuda.current_stream().wait_event(call.done)
    t0 = time.monotonic()
    torch.cuda.synchronize()
    took = time.monotonic() - t0
    assert took < 2.0 + 3.0, took
    assert torch.isnan(call.outs[0]).all()
    with pytest.raises(ReduceScatterError) as e:
        RS.launch(wss[0], xs[0], "sum", "the next bucket")
    msg = str(e.value)
    assert "the dead peer's bucket" in msg and "rank 1 did not push" in msg and "rs_timeout_s" in msg, msg
    # Another call's push (another size): both "ranks" released, each naming both calls.
    wss = loopback_workspaces(w, 1 << 16, dtype)
    a = [torch.randn(w * 64, 33, device="cuda", generator=gen)]
    b = [torch.randn(w * 32, 33, device="cuda", generator=gen)]
    calls = [RS.launch(wss[0], a, "sum", "bucket A"), RS.launch(wss[1], b, "sum", "bucket B")]
    for c in calls:
        RS.complete(c)
        torch.cuda.current_stream().wait_event(c.done)
    t0 = time.monotonic()
    torch.cuda.synchronize()
    took2 = time.monotonic() - t0
    assert took2 < 2.0 + 4.0, took2
    for ws, c in zip(wss, calls, strict=True):
        assert torch.isnan(c.outs[0]).all()
        with pytest.raises(ReduceScatterError) as e:
            RS.launch(ws, a, "sum", "next")
        assert "pushed another call" in str(e.value) and "2112" in str(e.value) and "1056" in str(e.value), str(e.value)
    # A new generation (fresh workspaces) is exact.
    wss = loopback_workspaces(w, 1 << 16, dtype)
    for call in range(3):
        xs = _inputs(w, dtype, gen, coalesced=call == 1)
        outs = loopback_reduce_scatter(wss, xs)
        torch.cuda.synchronize()
        for r in range(w):
            for o, e in zip(outs[r], _documented(xs, r, w, "sum"), strict=True):
                assert torch.equal(o, e), (call, r)
    print(f"DEAD_PEER released after {took:.2f} s; mismatch released after {took2:.2f} s; "
          f"host-mapped flags {host}")


@pytest.mark.parametrize("connections", ["default", "1"])
@pytest.mark.parametrize("path", ["python", "native", "native_host_flags"])
def test_dead_peer_releases_the_host(connections, path):
    """Default queues: device flags, released by the watchdog's own-stream writes (both
    paths), and host-mapped flags forced (native). One queue: the native path takes
    host-mapped flags (a host store releases the wait, the kernel reads the poison word);
    the Python path is not run there: the op keeps the collective
    (RsReason.ONE_QUEUE, reduce_scatter/op.py; test_reduce_scatter_faults_host)."""
    from torch_ce.runtime import native
    from torch_ce.runtime.reduce_scatter import host_flags as HF

    if path != "python" and not native.has_rs_native():
        pytest.skip("the library has no native reduce-scatter (rebuild csrc/)")
    if path == "python" and connections == "1":
        pytest.skip("one queue: the op keeps the collective on the Python path (one_queue_refusal)")
    if path != "python" and connections == "1" or path == "native_host_flags":
        import torch_ce

        with torch_ce.config.patch(rs_native=True):
            if HF.unavailable():
                pytest.skip(f"no host-mapped flags here: {HF.unavailable()}")
    env = dict(os.environ, CE_TEST_DEAD_PEER="1", CE_TEST_RS_NATIVE="1" if path != "python" else "0",
               CE_TEST_HOST_FLAGS="1" if path == "native_host_flags" else "0")
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    if connections == "1":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
           os.path.join(here, os.path.basename(__file__)), "-k", "dead_peer_child"]
    try:  # a stream the watchdog cannot release is a hang: the hard timeout fails it
        p = subprocess.run(cmd, env=env, cwd=here, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung (CUDA_DEVICE_MAX_CONNECTIONS={connections}): {str(e.stdout)[-2000:]} {str(e.stderr)[-2000:]}")
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    line = " ".join(ln for ln in p.stdout.splitlines() if "DEAD_PEER" in ln)
    assert line.endswith(f"host-mapped flags {connections == '1' or path == 'native_host_flags'}"), line
    print(f"connections {connections}: {line}")


def _two_gpus(rank, world, seed):
    import torch.distributed as dist

    import torch_ce
    from torch_ce.runtime.reduce_scatter import ReduceScatterError

    torch_ce.config.update(rs_timeout_s=5.0)
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)

    def exact(call, late):
        if rank == 1 and late:
            time.sleep(2.0)
        dtype = torch.bfloat16 if call % 2 else torch.float32
        x = torch.randn(world * 1024, 257, device="cuda", generator=gen).to(dtype)
        out = torch_ce.reduce_scatter(x, dist.group.WORLD)
        ref = torch.empty_like(out)
        dist.reduce_scatter_tensor(ref, x, group=dist.group.WORLD)
        torch.cuda.synchronize()
        assert torch.equal(out, ref), (call, float((out.float() - ref.float()).abs().max()))
        return x

    for call in range(6):
        x = exact(call, call == 1)
    name = dist.group.WORLD.group_name
    if rank == 1:
        time.sleep(12.0)  # pushes the next call only after its peer's watchdog released it
    out = torch.ops._c10d_functional.wait_tensor(torch.ops.magi.ce_reduce_scatter(x, "sum", world, name, "the stuck bucket"))
    t0 = time.monotonic()
    torch.cuda.synchronize()  # rank 0: released at rs_timeout_s; rank 1: at its peer's abort
    took = time.monotonic() - t0
    assert took < 5.0 + 3.0, took
    assert torch.isnan(out.float()).all()
    with pytest.raises(ReduceScatterError, match="the stuck bucket"):
        torch_ce.reduce_scatter(x, dist.group.WORLD)
    for call in range(3):  # a new generation: exact again
        exact(call, call == 1)
    return "released"


@needs_gpu_world
def test_two_gpus():
    from mp_harness import run_ranks, seed_base

    got = run_ranks(_two_gpus, 2, seed_base(), backend="nccl", timeout=180)
    assert got == ["released", "released"], got
