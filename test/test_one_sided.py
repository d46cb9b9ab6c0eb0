"""The host transport's gathers are one-sided: a rank gathers while its peers sleep.

A transport that is a collective in disguise (a barrier per gather, a peer that must
publish or send its rows at gather time, a silent fallback to gloo) passes every exactness
test, because there every rank gathers together. Here one rank (the reader) gathers the
bound shards many times while every other rank sits in ``time.sleep`` (no collective, no
torch_ce call) until the reader sets a store key; then the roles rotate. A gather that
needed its peers hangs (the sleepers give up after ``SLEEP_LIMIT_S`` and the run fails) or
returns wrong data (compared exactly with gloo's gather of the same shards, taken while
all ranks were present). The sleepers keep their windows alive until the reader is done.

A control checks the set-up itself: a real gloo all-gather that rank 0 starts before its
gathers is still incomplete after them (the sleeping peers join it only when they wake).
"""
from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from mp_harness import quiet_warnings, run_ranks
from mp_harness import randn as _rand
from mp_harness import reference_all_gather as _ref_gather
from mp_harness import seed_base as _base
from mp_harness import wait as _wait

GATHERS = 50
SLEEP_LIMIT_S = 60.0  # a sleeper's wait for the reader (a hung reader fails the run here)
# Several shapes and dtypes, sizes that are not multiples of the 512-byte slot.
SPECS = (((7, 5), torch.float32), ((33,), torch.bfloat16), ((4, 3, 2), torch.float16),
         ((129, 4), torch.float32), ((2, 300), torch.bfloat16))


def _sleep_until(store, key: str) -> None:
    """Sleep (polling the store, which is no collective) until ``key`` is set."""
    deadline = time.monotonic() + SLEEP_LIMIT_S
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise AssertionError(f"the reader never set {key!r} within {SLEEP_LIMIT_S} s: its "
                                 "gathers waited for the sleeping peers (not one-sided)")
        time.sleep(0.05)


def _rank_one_sided(rank, ws, base):
    quiet_warnings()
    torch.set_num_threads(1)
    import torch_ce

    torch_ce.config.update(cost_mode="default")  # no calibration gathers inside bind
    store = dist.distributed_c10d._get_default_store()
    world = dist.group.WORLD
    gname = world.group_name
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=SLEEP_LIMIT_S))
    gen = torch.Generator().manual_seed(base + rank)  # different data on every rank
    shards = [_rand(shape, dtype, gen) for shape, dtype in SPECS]
    res = torch_ce.bind(shards, group=world)  # collective: agrees, opens, moves
    assert len(res.bound) == len(SPECS), f"not every shard was bound: {res!r}"
    refs = [_ref_gather(s) for s in shards]  # gloo, every rank present
    control_done_early = None
    for reader in range(ws):
        done = f"one_sided_done_{reader}"
        dist.barrier()  # the last collective before the one-sided phase
        if rank != reader:
            _sleep_until(store, done)
            if reader == 0:  # join the control's collective only now
                _ref_gather(shards[0].clone(), control)
            continue
        try:
            pending = None
            if reader == 0:  # control: a real collective cannot finish without the peers
                cout = shards[0].new_empty((ws * shards[0].shape[0], *shards[0].shape[1:]))
                pending = dist.all_gather_into_tensor(cout, shards[0].clone(), group=control, async_op=True)
            for i in range(GATHERS):
                if i % 2:
                    outs = [_wait(o) for o in torch.ops.magi.ce_all_gather_coalesced(shards, ws, gname)]
                else:
                    outs = [torch_ce.all_gather(s, world) for s in shards]
                for j, (o, r) in enumerate(zip(outs, refs, strict=True)):
                    assert torch.equal(o, r), f"reader {reader}, gather {i}, shard {j} ({SPECS[j]}) differs"
            if pending is not None:
                time.sleep(0.2)  # time enough for a collective that needed nobody else
                control_done_early = pending.is_completed()
        finally:
            store.set(done, "1")  # the sleepers may leave (and later release their windows)
        if pending is not None:
            pending.wait()
            assert torch.equal(cout, refs[0]), "control gather differs"
    return dict(control_done_early=control_done_early)


@pytest.mark.parametrize("ws", [2, 3])
def test_gathers_need_no_peer(ws):
    results = run_ranks(_rank_one_sided, ws, _base(), timeout=120)
    assert results[0]["control_done_early"] is False, "control: a gloo all-gather finished while its peers slept"
