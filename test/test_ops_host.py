"""The op layer on CPU: magi::ce_all_gather[_coalesced] over the host transport (POSIX
shared-memory windows, peer reads as memcpy) with gloo process groups.

Every gather is compared EXACTLY (torch.equal) with gloo's all_gather_into_tensor of the
same shards, on fresh random data (seeded by a random base + rank). Each test spawns its
ranks once (see mp_harness.py) and groups related checks in that run; the rank functions
below are module level so that spawn can pickle them.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_harness import all_gather_json, run_ranks
from mp_harness import randn as _rand
from mp_harness import seed_base as _base
from mp_harness import wait as _wait
from mp_harness import reference_all_gather as _ref_gather

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------
# Helpers used inside the ranks
# ---------------------------------------------------------------------------------------


def _gather1(shard, group_size, group_name):
    return _wait(torch.ops.magi.ce_all_gather(shard, group_size, group_name))


def _gather_n(shards, group_size, group_name):
    return [_wait(o) for o in torch.ops.magi.ce_all_gather_coalesced(shards, group_size, group_name)]


def _mapping_of(addr: int) -> str:
    """The /proc/self/maps path of the mapping holding ``addr`` ('' if anonymous)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5].strip() if len(parts) > 5 else ""
    return ""


def _make_dtensor_params(mesh, gen, specs):
    """{name: Parameter(DTensor Shard(0))}, {name: clone of the local shard}, {name:
    StorageWeakRef of the local shard's storage}. Nothing else keeps the local storage."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.multiprocessing.reductions import StorageWeakRef

    ws = mesh.size()
    params, clones, weak = {}, {}, {}
    for name, (shape, dtype) in specs.items():
        local = _rand(shape, dtype, gen)
        clones[name] = local.clone()
        gshape = (shape[0] * ws, *shape[1:])
        dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=gshape,
                                stride=torch.empty(gshape).stride())
        params[name] = torch.nn.Parameter(dt, requires_grad=False)
        weak[name] = StorageWeakRef(params[name]._local_tensor.untyped_storage())
        del local, dt
    return params, clones, weak


def _check_in_window(name, t):
    """``t`` is a bound shard that views its slot: no second copy anywhere."""
    import torch_ce.runtime.windows as W
    from torch_ce.config import config

    slot = W.lookup(t)
    assert isinstance(slot, W.Slot), f"{name}: not bound after bind ({slot!r})"
    addr = slot.window.local.data_ptr() + slot.offset
    assert t.data_ptr() == addr, f"{name}: data_ptr {t.data_ptr():#x} != slot address {addr:#x}"
    assert t.storage_offset() == 0 and t.untyped_storage().data_ptr() == addr, name
    assert t.untyped_storage().nbytes() == slot.nbytes == t.numel() * t.element_size(), name
    assert slot.offset % W.SLOT_ALIGN == 0 and addr % 512 == 0, f"{name}: slot at {addr:#x} not 512-aligned"
    path = _mapping_of(addr)
    assert path.startswith(f"/dev/shm/{config.shm_prefix}"), f"{name}: storage is not a window mapping: {path!r}"
    return slot


def _check_fresh(name, out, shard, ref):
    """``out`` is exact, owns fresh memory, and writing it changes no window."""
    assert torch.equal(out, ref), f"{name}: gather differs from gloo all_gather_into_tensor"
    assert out.data_ptr() != shard.data_ptr(), name
    assert not _mapping_of(out.data_ptr()).startswith("/dev/shm/"), f"{name}: output lives in a window"


# ---------------------------------------------------------------------------------------
# Exact gathers, no second copy, layout, idempotence
# ---------------------------------------------------------------------------------------


def _rank_gather_exact(rank, ws, base):
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh

    gen = torch.Generator().manual_seed(base + rank)
    mesh = init_device_mesh("cpu", (ws,))
    mesh_name = mesh.get_group(0).group_name
    world_name = dist.group.WORLD.group_name

    # DTensor parameters: every dtype, 1-D and 2-D, sizes that are not multiples of 512 B.
    specs = {}
    for i, dt in enumerate(DTYPES):
        specs[f"{dt}_1d"] = ((37 + 8 * i,), dt)
        specs[f"{dt}_2d"] = ((5 + i, 13), dt)
    params, clones, weak = _make_dtensor_params(mesh, gen, specs)
    refs = {n: _ref_gather(c) for n, c in clones.items()}

    res = torch_ce.bind(params)
    assert sorted(res.bound) == sorted(specs) and not res.skipped and not res.already_bound, res
    assert res.bytes_bound == sum(c.numel() * c.element_size() for c in clones.values()), res
    assert res.windows_opened == len(DTYPES), res  # one pool (window) per dtype

    # Plain tensors bound with an explicit group: mixed dtypes and shapes.
    plain = [_rand(s, d, gen) for s, d in (((7,), torch.float16), ((3, 4, 5), torch.float32), ((9, 2), torch.bfloat16))]
    plain_clones = [p.clone() for p in plain]
    plain_refs = [_ref_gather(c) for c in plain_clones]
    from torch.multiprocessing.reductions import StorageWeakRef

    plain_weak = [StorageWeakRef(p.untyped_storage()) for p in plain]
    res_p = torch_ce.bind(plain, group=dist.group.WORLD)
    assert res_p.bound == [f"param{i}" for i in range(len(plain))] and not res_p.skipped, res_p

    # No second copy: each shard views its slot in a shared-memory window; old storage freed.
    locals_ = {n: p._local_tensor for n, p in params.items()}
    slots = {}
    for n, t in locals_.items():
        assert weak[n].expired(), f"{n}: the pre-bind storage is still alive (a second copy)"
        slots[n] = _check_in_window(n, t)
        assert torch.equal(t, clones[n]), f"{n}: data changed by bind"
        assert torch.equal(params[n].to_local(), clones[n]), n
    for i, t in enumerate(plain):
        assert plain_weak[i].expired(), f"plain {i}: pre-bind storage still alive"
        slots[f"plain{i}"] = _check_in_window(f"plain{i}", t)
        assert torch.equal(t, plain_clones[i])

    # Symmetric layout: the same (pool, window, offset, size) for each shard on every rank.
    layout = {n: (s.window.pool_key, s.window.index, s.offset, s.nbytes) for n, s in slots.items()}
    everyone = all_gather_json(layout)
    assert all(lay == everyone[0] for lay in everyone), f"layouts differ across ranks: {everyone}"

    # Single gathers (mesh group name and WORLD name name the same ranks) and coalesced ones.
    for n, t in locals_.items():
        for gname in (mesh_name, world_name):
            _check_fresh(n, _gather1(t, ws, gname), t, refs[n])
        _check_fresh(n, _gather1(params[n].to_local(), ws, mesh_name), t, refs[n])
    names = list(locals_)
    outs = _gather_n([locals_[n] for n in names], ws, mesh_name)  # mixed dtypes and shapes
    for n, o in zip(names, outs, strict=True):
        _check_fresh(n, o, locals_[n], refs[n])
    for i, t in enumerate(plain):
        _check_fresh(f"plain{i}", _gather1(t, ws, world_name), t, plain_refs[i])
    outs = _gather_n(plain + [locals_[names[0]]], ws, world_name)
    for o, t, r in zip(outs, plain + [locals_[names[0]]], plain_refs + [refs[names[0]]], strict=True):
        _check_fresh("coalesced plain", o, t, r)

    # Writing an output changes no shard here or on a peer.
    outs = _gather_n(plain, ws, world_name)
    for o in outs:
        o.fill_(float(rank + 1))
    dist.barrier()
    for i, t in enumerate(plain):
        assert torch.equal(t, plain_clones[i]), f"plain {i}: changed by writing an output"
        assert torch.equal(_gather1(t, ws, world_name), plain_refs[i])

    # Binding again moves nothing and keeps everything exact.
    ptrs = {n: t.data_ptr() for n, t in locals_.items()}
    res2 = torch_ce.bind(params)
    assert not res2.bound and sorted(res2.already_bound) == sorted(specs), res2
    assert res2.windows_opened == 0 and res2.bytes_bound == 0 and not res2.skipped, res2
    res2p = torch_ce.bind(plain, group=dist.group.WORLD)
    assert not res2p.bound and len(res2p.already_bound) == len(plain), res2p
    for n, p in params.items():
        assert p._local_tensor.data_ptr() == ptrs[n], f"{n} moved by the second bind"
        assert torch.equal(p._local_tensor, clones[n])
        assert torch.equal(_gather1(p._local_tensor, ws, mesh_name), refs[n])
    return len(res.bound) + len(res_p.bound)


# world 3 is slow (default suite under 15 min on 2 cores): 3-rank gathers run by default in
# test_uneven_host and test_no_hang.
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_gather_exact_no_copy_layout_idempotent(world_size):
    n = run_ranks(_rank_gather_exact, world_size, _base())
    assert n == [9] * world_size


# ---------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------

# Every sub-test of torch.library.opcheck that runs the op for real first clones the
# tensor inputs (torch 2.13 torch/testing/_internal/optests/generate_tests.py):
#   test_schema                 deepcopy_tensors() -> clone_input, then the op
#   test_faketensor             deepcopy_tensors(), then CrossRefFakeMode runs the op
#   test_aot_dispatch_dynamic   wraps the op in ``func`` that torch.clone()s every input
#   test_autograd_registration  clones too, but returns before running anything when no
#                               input requires grad
# A clone of a bound shard is a different (unbound) tensor, so on a real group the op
# rightly raises "not bound" there. What stays meaningful:
#   * opcheck restricted to test_autograd_registration on bound shards;
#   * the full default opcheck with group_size=1 (the op never looks a binding up);
#   * the same three checks on the bound shards without the clone, through the optests
#     helpers that opcheck itself calls (schema check with copy_inputs=False, fake_check,
#     aot_autograd_check on the op itself: it mutates nothing, so no clone is needed).
CLONING_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def _error_text(ex):
    parts = []
    while ex is not None:
        parts.append(str(ex))
        ex = ex.__cause__ or ex.__context__
    return " | ".join(parts)


def _rank_opcheck(rank, ws, base):
    import torch_ce
    from torch.library import opcheck
    from torch.testing._internal.optests.aot_autograd import aot_autograd_check
    from torch.testing._internal.optests.fake_tensor import fake_check
    from torch.testing._internal.optests.generate_tests import safe_schema_check

    gen = torch.Generator().manual_seed(base + rank)
    shards = [_rand((6, 5), torch.float32, gen), _rand((11,), torch.bfloat16, gen)]
    refs = [_ref_gather(s) for s in shards]
    assert len(torch_ce.bind(shards, group=dist.group.WORLD).bound) == 2
    gname = dist.group.WORLD.group_name
    one = torch.ops.magi.ce_all_gather.default
    many = torch.ops.magi.ce_all_gather_coalesced.default
    cases = [(one, (shards[0], ws, gname)), (one, (shards[1], ws, gname)), (many, (shards, ws, gname))]

    findings = {}
    for op, args in cases:
        opcheck(op, args, test_utils=("test_autograd_registration",))
        opcheck(op, (args[0], 1, gname))  # every default sub-test: group_size 1 needs no binding
        # Un-cloned equivalents on the bound shards.
        safe_schema_check(op, args, {}, copy_inputs=False)
        fake_check(op, args, {})
        aot_autograd_check(op, args, {}, dynamic=True, check_gradients="auto")
        aot_autograd_check(op, args, {}, dynamic=False, check_gradients="auto")
        # Document what the default opcheck does on bound shards: only "not bound" failures.
        got = opcheck(op, args, raise_exception=False)
        for util, r in got.items():
            if r != "SUCCESS":
                assert "not bound" in _error_text(r), f"{op} {util}: unexpected failure {r!r}"
            findings[f"{op.name()} {util}"] = "SUCCESS" if r == "SUCCESS" else "not bound"
    for s, r in zip(shards, refs, strict=True):
        assert torch.equal(_gather1(s, ws, gname), r)
    return findings


def test_opcheck():
    findings = run_ranks(_rank_opcheck, 2, _base())
    assert findings[0] == findings[1]
    print("opcheck on bound shards, default test_utils:", findings[0])


# ---------------------------------------------------------------------------------------
# Window cap
# ---------------------------------------------------------------------------------------


def _rank_window_cap(rank, ws, base):
    import torch_ce
    import torch_ce.runtime.windows as W
    from torch_ce.config import patch  # torch_ce.config is the Config object, not the module

    gen = torch.Generator().manual_seed(base + rank)
    cap_mib = 4096 / 2**20  # a 4 KiB cap
    shapes = [(3, 100), (2, 100), (5, 100), (30, 100), (1, 100), (4, 100), (2, 100)]
    big = 3  # 12000 B: larger than the cap
    shards = [_rand(s, torch.float32, gen) for s in shapes] + [_rand((40, 10), torch.bfloat16, gen)]
    refs = [_ref_gather(s) for s in shards]
    with patch(window_cap_mib=cap_mib) as cfg:
        cap = cfg.window_cap_bytes
        res = torch_ce.bind(shards, group=dist.group.WORLD)
    assert len(res.bound) == len(shards), res
    slots = [W.lookup(s) for s in shards]
    assert all(isinstance(s, W.Slot) for s in slots)
    windows = {id(s.window): s.window for s in slots}
    assert res.windows_opened == len(windows) >= 4, res
    assert shards[big].numel() * 4 > cap
    for w in windows.values():
        members = sorted((s for s in slots if s.window is w), key=lambda s: s.offset)
        if len(members) > 1:
            assert w.nbytes <= cap, f"window of {w.nbytes} B holds {len(members)} shards over a {cap} B cap"
        for a, b in zip(members, members[1:]):
            assert a.offset + W.align_up(a.nbytes) <= b.offset, "slots overlap"
        assert members[-1].offset + members[-1].nbytes <= w.nbytes
    assert sum(s.window is slots[big].window for s in slots) == 1, "the over-cap shard shares its window"
    assert len({s.window.pool_key for s in slots}) == 2  # float32 and bfloat16 never share
    for i, s in enumerate(shards):
        _check_in_window(f"shard{i}", s)
    layout = [(s.window.pool_key, s.window.index, s.offset) for s in slots]
    everyone = all_gather_json(layout)
    assert all(lay == everyone[0] for lay in everyone), everyone
    gname = dist.group.WORLD.group_name
    for s, r in zip(shards, refs, strict=True):
        assert torch.equal(_gather1(s, ws, gname), r)
    for o, r in zip(_gather_n(shards, ws, gname), refs, strict=True):  # one bucket across many windows
        assert torch.equal(o, r)
    return len(windows)


def test_window_cap_splits_windows():
    run_ranks(_rank_window_cap, 2, _base())


# ---------------------------------------------------------------------------------------
# Clear errors and refusals
# ---------------------------------------------------------------------------------------


def _rank_errors(rank, ws, base):
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    gen = torch.Generator().manual_seed(base + rank)
    gname = dist.group.WORLD.group_name

    # An unbound tensor: both ops raise and say what to do.
    t = _rand((4, 3), torch.float32, gen)
    for call in (lambda: torch.ops.magi.ce_all_gather(t, ws, gname),
                 lambda: torch.ops.magi.ce_all_gather_coalesced([t], ws, gname)):
        with pytest.raises(RuntimeError) as e:
            call()
        assert "not bound" in str(e.value) and "torch_ce.bind" in str(e.value), str(e.value)

    # A group_size that does not match the window's group.
    s = _rand((4, 3), torch.float32, gen)
    ref = _ref_gather(s)
    assert torch_ce.bind([s], group=dist.group.WORLD).bound == ["param0"]
    for call in (lambda: torch.ops.magi.ce_all_gather(s, ws + 1, gname),
                 lambda: torch.ops.magi.ce_all_gather_coalesced([s], ws + 1, gname)):
        with pytest.raises(RuntimeError, match="group_size"):
            call()
    with pytest.raises(RuntimeError, match="not bound"):  # a bound shard next to an unbound one
        torch.ops.magi.ce_all_gather_coalesced([s, t], ws, gname)
    assert torch.equal(_gather1(s, ws, gname), ref)

    # Ineligible parameters are skipped, each with its reason.
    mesh = init_device_mesh("cpu", (ws,))
    loc = _rand((4, 6), torch.float32, gen)
    p_shard1 = DTensor.from_local(loc, mesh, [Shard(1)], run_check=False, shape=(4, 6 * ws), stride=(6 * ws, 1))
    rows = 3 if rank == 0 else 2  # 3 + 2 * (ws - 1) rows: uneven over ws ranks
    grows = 3 + 2 * (ws - 1)
    p_uneven = DTensor.from_local(_rand((rows, 4), torch.float32, gen), mesh, [Shard(0)], run_check=False,
                                  shape=(grows, 4), stride=(4, 1))
    res = torch_ce.bind({"shard1": p_shard1, "uneven": p_uneven})
    assert not res.bound and set(res.skipped) == {"shard1", "uneven"}, res
    assert "Shard(0)" in res.skipped["shard1"], res.skipped
    assert "uneven" in res.skipped["uneven"], res.skipped
    nc = _rand((6, 4), torch.float32, gen).t()
    res = torch_ce.bind([nc], group=dist.group.WORLD)
    assert not res.bound and "non-contiguous" in res.skipped["param0"], res
    res = torch_ce.bind([_rand((4,), torch.float32, gen)])  # plain tensor, no group
    assert not res.bound and "group" in res.skipped["param0"], res
    with pytest.raises(RuntimeError, match="not bound"):
        torch.ops.magi.ce_all_gather(loc, ws, gname)
    return True


def test_errors_and_refusals():
    run_ranks(_rank_errors, 2, _base())


def _rank_disagreement(rank, ws, base):
    import torch_ce
    import torch_ce.runtime.windows as W

    gen = torch.Generator().manual_seed(base + rank)
    gname = dist.group.WORLD.group_name

    # Rank 1 passes shard 1 non-contiguous (same shape and values): refused on both ranks.
    a = _rand((4, 6), torch.float32, gen)
    b = _rand((6, 4), torch.float32, gen)
    c = _rand((5,), torch.bfloat16, gen)
    if rank == 1:
        b = b.t().contiguous().t()
        assert not b.is_contiguous()
    refs = [_ref_gather(x) for x in (a, b, c)]
    res = torch_ce.bind([a, b, c], group=dist.group.WORLD)
    assert res.bound == ["param0", "param2"] and set(res.skipped) == {"param1"}, res
    why = res.skipped["param1"]
    if rank == 0:
        assert "disagreement" in why and "non-contiguous" in why, why
    else:  # the refusing rank reports its own reason
        assert "non-contiguous" in why or "disagreement" in why, why
    assert isinstance(W.lookup(b), W.Fallback)
    # The refused shard falls back to gloo inside the op, on both ranks, alone or in a bucket.
    assert torch.equal(_gather1(b, ws, gname), refs[1])
    for o, r in zip(_gather_n([a, b, c], ws, gname), refs, strict=True):
        assert torch.equal(o, r)

    # Different shapes at the same position: refused on both ranks, no hang.
    d = _rand((4 + 2 * rank, 5), torch.float32, gen)
    e = _rand((3, 5), torch.float32, gen)
    e_ref = _ref_gather(e)
    res = torch_ce.bind([e, d], group=dist.group.WORLD)
    assert res.bound == ["param0"] and "disagreement" in res.skipped.get("param1", ""), res
    assert torch.equal(_gather1(e, ws, gname), e_ref)

    # A bucket of two refused shards: each fallback gather is complete when the op returns,
    # never two gloo collectives in flight (NOTE [gloo: one functional collective in
    # flight] in ops.py); the graph's wait is then a no-op.
    b2 = _rand((6, 4), torch.float32, gen)
    b2_ref = _ref_gather(b2)
    if rank == 1:
        b2 = b2.t().contiguous().t()
    assert torch_ce.bind([b2], group=dist.group.WORLD).skipped
    outs = torch.ops.magi.ce_all_gather_coalesced([b, b2], ws, gname)
    assert torch._C._distributed_c10d._get_work_registry_size() == 0
    for o, r in zip([_wait(o) for o in outs], [refs[1], b2_ref], strict=True):
        assert torch.equal(o, r)

    # A different number of shards: everything refused, no hang.
    f = _rand((2, 5), torch.float16, gen)
    res = torch_ce.bind([f] if rank == 0 else [f, _rand((2, 5), torch.float16, gen)], group=dist.group.WORLD)
    assert not res.bound and all("disagreement" in w for w in res.skipped.values()), res
    return res.skipped


def test_rank_disagreement():
    run_ranks(_rank_disagreement, 2, _base())


def _rank_world1(rank, ws, base):
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh

    gen = torch.Generator().manual_seed(base)
    mesh = init_device_mesh("cpu", (1,))
    params, clones, _ = _make_dtensor_params(mesh, gen, {"w": ((6, 3), torch.bfloat16)})
    plain = _rand((5,), torch.float16, gen)
    res = torch_ce.bind(params)
    res_p = torch_ce.bind([plain], group=dist.group.WORLD)
    assert not res.bound and "size 1" in res.skipped["w"], res
    assert not res_p.bound and "size 1" in res_p.skipped["param0"], res_p
    gname = dist.group.WORLD.group_name
    for t in (params["w"].to_local(), plain):
        out = _gather1(t, 1, gname)
        assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
        (o,) = _gather_n([t], 1, gname)
        assert torch.equal(o, t) and o.data_ptr() != t.data_ptr()
    return True


def test_world_size_1():
    run_ranks(_rank_world1, 1, _base())
