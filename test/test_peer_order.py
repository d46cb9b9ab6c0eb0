"""The peer order of the pure-torch gather (``gather.copy_peers``, NOTE [peer order] in
csrc/ce_copy.h) on 3 gloo ranks with the host transport: the reads go out in the rotated
order ``rank+1, rank+2, ...`` peer-major, this rank's rows last (``fixed`` under
``peer_order_as``), and the gathers stay exact in both orders. The C++ gather's order is
checked against the same ``gather.peer_order`` in test_build.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mp_harness import randn, reference_all_gather, run_ranks, seed_base, wait

WS = 3


def _issued_reads(fn, slots) -> list[tuple[int, int]]:
    """(member, source rank) of every ``copy_`` that ``fn()`` issues, in order, from the
    source's address (each slot's ``peer_views``)."""
    from torch.overrides import TorchFunctionMode

    where = {v.data_ptr(): (m, r) for m, s in enumerate(slots) for r, v in enumerate(s.peer_views)}
    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.copy_:
                seen.append(where.get(args[1].data_ptr(), ("unknown", args[1].data_ptr())))
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def _rank(rank, world, base):
    import torch_ce
    from torch_ce.runtime import gather, native
    from torch_ce.runtime import windows as W

    gen = torch.Generator().manual_seed(base + rank)
    shards = [randn((5, 7), torch.float32, gen), randn((33,), torch.float32, gen)]
    refs = [reference_all_gather(s) for s in shards]
    group = dist.group.WORLD
    assert len(torch_ce.bind(shards, group=group).bound) == len(shards)
    slots = [W.lookup(s) for s in shards]
    res = {}
    for order in ("rotated", "fixed"):
        with native.peer_order_as(order):
            res[order] = _issued_reads(lambda: gather.gather_slots(shards, slots, world), slots)
            outs = [wait(o) for o in torch.ops.magi.ce_all_gather_coalesced(shards, world, group.group_name)]
        res[f"{order}_exact"] = [bool(torch.equal(o, r)) for o, r in zip(outs, refs, strict=True)]
    return res


def test_fallback_reads_rotated_and_exact():
    for rank, r in enumerate(run_ranks(_rank, WS, seed_base(), timeout=120)):
        peers = [(rank + 1) % WS, (rank + 2) % WS]
        assert r["rotated"] == [(m, p) for p in peers + [rank] for m in (0, 1)], (rank, r)
        fixed = [p for p in range(WS) if p != rank]
        assert r["fixed"] == [(m, p) for p in fixed + [rank] for m in (0, 1)], (rank, r)
        assert r["rotated_exact"] == r["fixed_exact"] == [True, True], (rank, r)
