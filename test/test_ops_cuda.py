"""The op layer on GPUs: magi::ce_all_gather[_coalesced] over the copy-engine transport
(symmetric-memory windows, cudaMemcpyBatchAsync peer reads) with NCCL process groups.

Runs on TORCH_CE_GPU_WORLD ranks (default 2; ``cuda_helpers``), skipped with fewer GPUs;
``TORCH_CE_GPU_WORLD=4 pytest test/test_ops_cuda.py`` on a 4-GPU machine.
Every gather is compared EXACTLY with NCCL's all_gather_into_tensor of the same shards,
through the C++ kernels and through the opted-in pure-torch fallback.
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from cuda_helpers import GPU_WORLD, needs_gpu_world
from mp_harness import count_gathers, run_ranks
from mp_harness import reference_all_gather as _ref_gather

pytestmark = needs_gpu_world

WS = GPU_WORLD
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SLEEP_CYCLES = int(2e8)  # ~0.1 s of torch.cuda._sleep at H200 clocks: >> the CPU issue time
SENTINEL = -12345.0  # exactly representable in all three dtypes; randn never yields it


def _base() -> int:
    import random

    return random.randrange(1 << 30)


def _rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen, device=gen.device).to(dtype)




def _wait(t):
    return torch.ops._c10d_functional.wait_tensor(t)


def _windows_overlap(t) -> bool:
    import torch_ce.runtime.window_pools as WP

    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    for pool in WP.pools().values():
        for w in pool.windows:
            b = w.local.data_ptr()
            if lo < b + w.nbytes and b < hi:
                return True
    return False




# ---------------------------------------------------------------------------------------
# Exact gathers (the C++ kernel, the pure-torch fallback)
# ---------------------------------------------------------------------------------------


def _rank_cuda_exact(rank, ws, base, kind):
    import torch_ce
    import torch_ce.runtime.windows as W
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch_ce.runtime import native

    dev = torch.device("cuda", rank)
    if kind == "native":
        assert native.loaded(), "the C++ gather kernels are not loaded"
    else:  # TORCH_CE_NATIVE=0 with TORCH_CE_CUDA_TORCH_FALLBACK=1: per-peer copy_
        assert not native.loaded() and torch_ce.config.cuda_torch_fallback
    counts = count_gathers()
    gen = torch.Generator(device=dev).manual_seed(base + rank)
    mesh = init_device_mesh("cuda", (ws,))
    mesh_name = mesh.get_group(0).group_name
    world_name = dist.group.WORLD.group_name

    params, refs = {}, {}
    for i, dt in enumerate(DTYPES):
        for shape in ((1000 + 8 * i,), (37 + i, 129)):
            name = f"{dt}_{len(shape)}d"
            local = _rand(shape, dt, gen)
            refs[name] = _ref_gather(local)
            gshape = (shape[0] * ws, *shape[1:])
            params[name] = torch.nn.Parameter(
                DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=gshape,
                                   stride=torch.empty(gshape, device="meta").stride()),
                requires_grad=False,
            )
            del local
    plain = [_rand(s, d, gen) for s, d in (((7,), torch.float16), ((3, 4, 5), torch.float32), ((9, 2), torch.bfloat16))]
    plain_refs = [_ref_gather(p) for p in plain]

    res = torch_ce.bind(params)
    assert sorted(res.bound) == sorted(params) and not res.skipped, res
    res_p = torch_ce.bind(plain, group=dist.group.WORLD)
    assert len(res_p.bound) == len(plain) and not res_p.skipped, res_p
    locals_ = {n: p._local_tensor for n, p in params.items()}

    layout = {}
    for n, t in list(locals_.items()) + [(f"plain{i}", t) for i, t in enumerate(plain)]:
        slot = W.lookup(t)
        assert isinstance(slot, W.Slot), n
        addr = slot.window.local.data_ptr() + slot.offset
        assert t.data_ptr() == addr == slot.peer_ptrs[rank], n
        assert t.storage_offset() == 0 and t.untyped_storage().data_ptr() == addr, n
        assert slot.offset % 512 == 0 and addr % 512 == 0, n
        layout[n] = (slot.window.pool_key, slot.window.index, slot.offset, slot.nbytes)
    everyone = [None] * ws
    dist.all_gather_object(everyone, layout)
    assert all(lay == layout for lay in everyone), everyone

    def check(name, out, shard, ref):
        assert torch.equal(out, ref), f"{name}: differs from NCCL all_gather_into_tensor"
        assert out.data_ptr() != shard.data_ptr() and not _windows_overlap(out), f"{name}: output in a window"

    # Count only the ops' gathers (binding also times a few gathers to calibrate).
    counts.update(native=0, torch=0)
    calls = 0
    python_calls = 0  # the C++ kernel hands a group named differently from the bind to Python
    for n, t in locals_.items():
        for gname in (mesh_name, world_name):
            check(n, _wait(torch.ops.magi.ce_all_gather(t, ws, gname)), t, refs[n])
            calls += 1
            python_calls += gname != W.lookup(t).window.group.group_name
    names = list(locals_)
    outs = torch.ops.magi.ce_all_gather_coalesced([locals_[n] for n in names], ws, mesh_name)
    calls += 1
    for n, o in zip(names, outs, strict=True):
        check(n, _wait(o), locals_[n], refs[n])
    outs = torch.ops.magi.ce_all_gather_coalesced(plain, ws, world_name)
    calls += 1
    for i, o in enumerate(outs):
        check(f"plain{i}", _wait(o), plain[i], plain_refs[i])
    # The C++ kernel serves every bucket itself but the ones named by another group's
    # name (the Python kernel checks the group and hands them back); the fallback copies
    # once per bucket.
    if kind == "native":
        assert counts == {"native": python_calls, "torch": 0}, (counts, python_calls)
    else:
        assert counts == {"native": 0, "torch": calls}, (counts, calls)

    # Writing an output changes no shard here or on the peer.
    for o in outs:
        o.fill_(SENTINEL)
    torch.cuda.synchronize()
    dist.barrier()
    for i, o in enumerate(torch.ops.magi.ce_all_gather_coalesced(plain, ws, world_name)):
        assert torch.equal(_wait(o), plain_refs[i])

    # A bucket mixing a bound shard with one whose binding was refused (rank 1 passes it
    # non-contiguous): the refused member goes through NCCL inside the op, exact on both.
    a, b = _rand((64, 32), torch.bfloat16, gen), _rand((32, 64), torch.bfloat16, gen)
    if rank == 1:
        b = b.t().contiguous().t()
    mixed_refs = [_ref_gather(a), _ref_gather(b)]
    res = torch_ce.bind([a, b], group=dist.group.WORLD)
    assert res.bound == ["param0"] and "param1" in res.skipped, res
    for o, r in zip(torch.ops.magi.ce_all_gather_coalesced([a, b], ws, world_name), mixed_refs, strict=True):
        assert torch.equal(_wait(o), r)
    assert torch.equal(_wait(torch.ops.magi.ce_all_gather(b, ws, world_name)), mixed_refs[1])
    return dict(counts)


def _require_kernels():
    from torch_ce.runtime import native

    if native.library_path() is None:
        pytest.skip("the C++ gather kernels are not built")


@pytest.mark.parametrize("kind", ["native", "torch_fallback"])
def test_cuda_gather_exact(kind):
    """The C++ kernel, and the opted-in pure-torch fallback (TORCH_CE_NATIVE=0)."""
    if kind == "native":
        _require_kernels()
    env = None if kind == "native" else {"TORCH_CE_NATIVE": "0", "TORCH_CE_CUDA_TORCH_FALLBACK": "1"}
    run_ranks(_rank_cuda_exact, WS, _base(), kind, backend="nccl", timeout=300, env=env)


# ---------------------------------------------------------------------------------------
# Stream ordering, with negative controls
# ---------------------------------------------------------------------------------------


def _rank_cuda_ordering(rank, ws, base):
    import torch_ce
    from torch_ce.runtime import native

    assert native.loaded(), "the C++ gather kernels are not loaded"
    dev = torch.device("cuda", rank)
    gen = torch.Generator(device=dev).manual_seed(base + rank)
    s = _rand((4096, 2048), torch.float32, gen)  # 32 MiB per rank
    ref = _ref_gather(s)  # stays alive, so no output block ever held the gathered data
    assert torch_ce.bind([s], group=dist.group.WORLD).bound == ["param0"]
    gname = dist.group.WORLD.group_name

    def fresh_start():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    # 1. The copies wait for the current stream's pending work on the output's memory:
    # heavy work on the current stream, then a write into the block that the output will
    # get (the allocator hands the same block back), then the gather.
    fresh_start()
    x = torch.empty_like(ref)
    ptr = x.data_ptr()
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(SENTINEL)  # queued behind the sleep
    del x
    out = torch.ops.magi.ce_all_gather(s, ws, gname)
    assert out.data_ptr() == ptr, "the output did not reuse the producer's block"
    got = _wait(out).clone()  # consumer on the current stream
    torch.cuda.synchronize()
    assert torch.equal(got, ref), "copies overtook the current stream's work"

    # 2. wait_tensor orders the consumer after the copies: the consumer is issued at once,
    # while 32 MiB of peer reads are still running, over a block that held SENTINEL.
    fresh_start()
    x = torch.full_like(ref, SENTINEL)
    ptr = x.data_ptr()
    del x
    out = torch.ops.magi.ce_all_gather(s, ws, gname)
    assert out.data_ptr() == ptr
    got = _wait(out).clone()
    torch.cuda.synchronize()
    assert torch.equal(got, ref), "the consumer read the output before the copies finished"
    return True


def test_cuda_stream_ordering():
    """The C++ kernel's stream order on real windows (its controls, an unwaited read, are
    in test_native_cuda.py)."""
    _require_kernels()
    run_ranks(_rank_cuda_ordering, WS, _base(), backend="nccl", timeout=300)


# ---------------------------------------------------------------------------------------
# No second copy on the device
# ---------------------------------------------------------------------------------------


def _rank_cuda_memory(rank, ws, base):
    import torch_ce
    from torch.multiprocessing.reductions import StorageWeakRef

    dev = torch.device("cuda", rank)
    gen = torch.Generator(device=dev).manual_seed(base + rank)
    # Warm up NCCL and the symmetric-memory machinery so their one-time allocations fall
    # outside the measurement.
    warm = _rand((4096,), torch.bfloat16, gen)
    assert torch_ce.bind([warm], group=dist.group.WORLD).bound == ["param0"]
    shards = [torch.randn((8192, 4096), generator=gen, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    total = sum(t.numel() * t.element_size() for t in shards)  # 256 MiB
    refs = [_ref_gather(t) for t in shards]
    weak = [StorageWeakRef(t.untyped_storage()) for t in shards]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    alloc0, free0 = torch.cuda.memory_allocated(dev), torch.cuda.mem_get_info(dev)[0]

    res = torch_ce.bind(shards, group=dist.group.WORLD)
    torch.cuda.synchronize()
    alloc1 = torch.cuda.memory_allocated(dev)
    free_bind = torch.cuda.mem_get_info(dev)[0]  # the old blocks may still be cached here
    torch.cuda.empty_cache()
    free1 = torch.cuda.mem_get_info(dev)[0]
    numbers = {
        "rank": rank, "shard_bytes": total, "caching_allocator_drop": alloc0 - alloc1,
        "device_used_delta_right_after_bind": free0 - free_bind,
        "device_used_delta_after_empty_cache": free0 - free1, "windows_opened": res.windows_opened,
    }
    assert len(res.bound) == len(shards), res
    assert all(w.expired() for w in weak), f"old storage still alive: {numbers}"
    assert abs((alloc0 - alloc1) - total) <= 2**20, f"caching-allocator bytes did not drop by the shards: {numbers}"
    assert free0 - free1 < total // 2, f"binding used a second copy's worth of device memory: {numbers}"
    for t, r in zip(shards, refs, strict=True):
        assert torch.equal(_wait(torch.ops.magi.ce_all_gather(t, ws, dist.group.WORLD.group_name)), r)
    return numbers


def test_cuda_no_second_copy():
    _require_kernels()
    numbers = run_ranks(_rank_cuda_memory, WS, _base(), backend="nccl", timeout=300)
    for n in numbers:
        print("torch_ce bind memory:", {k: (f"{v / 2**20:.1f} MiB" if "byte" in k or "delta" in k or "drop" in k else v)
                                         for k, v in n.items()})
