"""Padded slabs (uneven Shard(0)) and cast slots through the C++ gather, on one GPU.

One rank with loopback slots (as test/test_native_cuda.py: the "peer" copy is a second
local tensor, since symmetric memory refuses two ranks on one device). A padded slot
(NOTE [uneven Shard(0): padded slots] in torch_ce/runtime/windows.py) is registered the
way the bind registers it: the slot's full ``ceil``-row view as the bound tensor, the
weight as a view of its first rows (none, for an empty shard), the rest zeros; then
``magi.ce_all_gather_padded`` must return exactly the concatenation of both ranks' full
slots, i.e. the collective's gather of the zero-padded shards, whose first ``rows`` rows
are the weight; a row gather of an uneven table must equal ``embedding``. A cast slot (NOTE [cast slots] in torch_ce/runtime/staging.py) is a
bf16 slot of an fp32 weight: ``magi.ce_staged(..., static=True)`` hands it to the
gather, exact, and an in-place update of the weight afterwards raises.

Skipped without a GPU or without the built C++ library. On the 1-GPU machine:

    python3 -m pytest -q -s test/test_uneven_cuda.py
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mp_harness import count_gathers, run_ranks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        not any(f.startswith("_ce_torch") for f in os.listdir(os.path.join(
            os.path.dirname(__file__), "..", "torch_ce", "runtime"))),
        reason="the C++ gather kernels are not built (CPU torch or no nvcc)"),
]


def _wait(t):
    return torch.ops._c10d_functional.wait_tensor(t)


def padded_loopback(full_mine, full_peer, group, pos, live_rows, cast_of=None):
    """Register ``full_mine`` as a 2-rank padded slot (its peer's copy ``full_peer``), the
    way the bind does; returns the weight: a view of ``full_mine``'s first ``live_rows``
    rows (``cast_of``: a cast slot of that fp32 weight instead; returns it)."""
    from torch_ce.runtime import windows as W

    nbytes = full_mine.numel() * full_mine.element_size()
    w = W.Window(("loopback", group.group_name, full_mine.data_ptr()), 0, nbytes, group,
                 (pos, 1 - pos), pos, full_mine.device, full_mine.view(-1).view(torch.uint8), used=nbytes)
    slot = W.Slot(w, 0, nbytes, tuple(full_mine.shape), full_mine.dtype, "padded-loopback")
    pair = [full_mine, full_peer] if pos == 0 else [full_peer, full_mine]
    slot.peer_ptrs = [t.data_ptr() for t in pair]
    slot.peer_views = list(pair)
    live = full_mine[:live_rows]
    if cast_of is None:
        W.register_padded(full_mine, slot, live)
        return live
    W.register_cast_slot(cast_of, full_mine.dtype, slot, live, full_mine)
    from torch_ce.runtime import versions

    versions.watch_slots([(slot, cast_of, "loopback", [])])  # as a bind watches a cast slot
    return cast_of


# (rows of the weight, rows per slot, rank position, trailing shape, dtype)
PADDED = (
    (5, 3, 0, (64,), torch.float32),     # the long rank: 3 of 3 rows live
    (5, 3, 1, (64,), torch.float32),     # the short rank: 2 live rows, 1 padding row
    (1, 1, 1, (4096,), torch.bfloat16),  # an empty shard: 0 live rows
    (9, 5, 1, (7, 3), torch.float16),    # 3-D, odd sizes
    (2 * 4096 - 1, 4096, 1, (2048,), torch.bfloat16),  # 16 MiB slabs
)


def _padded_case(dev, gen, rows, per, pos, tail, dtype):
    """(weight, full slots in rank order, expected gathered weight)."""
    full = torch.randn((2 * per, *tail), generator=gen, device=dev).to(dtype)
    # torch.chunk's split: rank 0 the first ``per`` rows, rank 1 the rest.
    counts = [min(per, rows), max(0, rows - per)]
    full[rows:].zero_()  # the padding, zero on every rank (the bind writes it once)
    slabs = [full[:per].clone(), full[per:].clone()]
    return slabs, counts, full[:rows].cpu(), full.cpu()


def _rank_padded(rank, world):
    from torch_ce.runtime import native

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev).manual_seed(os.getpid())
    g = dist.group.WORLD
    res = dict(loaded=native.loaded(), cases=[])
    py = count_gathers()
    keep = []
    for rows, per, pos, tail, dtype in PADDED:
        slabs, counts, weight, whole = _padded_case(dev, gen, rows, per, pos, tail, dtype)
        mine, peer = slabs[pos], slabs[1 - pos]
        shard = padded_loopback(mine, peer, g, pos, counts[pos])
        keep.append((mine, peer, shard))
        torch.cuda._sleep(int(2e7))  # the current stream is busy: the copies must order after it
        out = _wait(torch.ops.magi.ce_all_gather_padded(shard, per, 2, g.group_name))
        got = (out * 1).cpu()  # a consumer right after the wait
        res["cases"].append(dict(
            case=(rows, per, pos, tail, str(dtype)), live=counts[pos],
            shape=tuple(got.shape) == tuple(whole.shape),
            whole_exact=bool(torch.equal(got, whole)),
            weight_exact=bool(torch.equal(got[:rows], weight)),
            padding_zero=bool((got[rows:] == 0).all()),
        ))
    # The padded op is Python; it hands the full slot to the C++ gather (no per-peer copy_).
    res["counts"] = dict(py)
    # A row gather of an uneven table (7 rows: 4 + 3, this rank the short one): the C++
    # row kernel reads row r from rank r // 4.
    slabs, counts, weight, _ = _padded_case(dev, gen, 7, 4, 1, (256,), torch.bfloat16)
    shard = padded_loopback(slabs[1], slabs[0], g, 1, counts[1])
    keep.append((slabs, shard))
    ids = torch.randint(0, 7, (5, 9), device=dev)
    rows = torch.ops.magi.ce_gather_rows(shard, ids, 2, g.group_name, 4, 7)
    res["rows_exact"] = bool(torch.equal(rows.cpu(), torch.embedding(weight, ids.cpu())))
    return res


def test_padded_slabs_exact_on_loopback():
    (r,) = run_ranks(_rank_padded, 1, timeout=300)
    print(r)
    assert r["loaded"], r
    for c in r["cases"]:
        assert c["shape"] and c["whole_exact"] and c["weight_exact"] and c["padding_zero"], c
    assert any(c["live"] == 0 for c in r["cases"]), "no empty shard was gathered"
    assert r["counts"] == {"native": len(PADDED), "torch": 0}, r
    assert r["rows_exact"], r


def _rank_cast(rank, world):
    from torch_ce.runtime import native

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev).manual_seed(os.getpid())
    g = dist.group.WORLD
    res = dict(loaded=native.loaded())
    py = count_gathers()
    # Even: an fp32 weight of 256 x 128, its bf16 slot; the peer's slot is another bf16 copy.
    w = torch.randn(256, 128, generator=gen, device=dev)
    mine = w.to(torch.bfloat16)
    peer = torch.randn(256, 128, generator=gen, device=dev).to(torch.bfloat16)
    padded_loopback(mine, peer, g, 1, 256, cast_of=w)
    (slot,) = torch.ops.magi.ce_staged([w], ["bfloat16"], [g.group_name], True)
    res["slot_is_window"] = slot.data_ptr() == mine.data_ptr()
    out = _wait(torch.ops.magi.ce_all_gather_padded(slot, 256, 2, g.group_name))
    res["even_exact"] = bool(torch.equal(out.cpu(), torch.cat([peer, w.to(torch.bfloat16)]).cpu()))
    # Uneven: 7 fp32 rows on the short rank of a 16-row weight (8 per slot), cast to bf16.
    w2 = torch.randn(7, 96, generator=gen, device=dev)
    full = torch.zeros(8, 96, device=dev, dtype=torch.bfloat16)
    full[:7] = w2.to(torch.bfloat16)
    peer2 = torch.randn(8, 96, generator=gen, device=dev).to(torch.bfloat16)
    padded_loopback(full, peer2, g, 1, 7, cast_of=w2)
    (slot2,) = torch.ops.magi.ce_staged([w2], ["bfloat16"], [g.group_name], True)
    out2 = _wait(torch.ops.magi.ce_all_gather_padded(slot2, 8, 2, g.group_name))
    exp2 = torch.cat([peer2, w2.to(torch.bfloat16), torch.zeros(1, 96, device=dev, dtype=torch.bfloat16)])
    res["uneven_exact"] = bool(torch.equal(out2.cpu(), exp2.cpu()))
    res["counts"] = dict(py)
    # The weight changes in place after the slot was made: the next read raises.
    with torch.no_grad():
        w.mul_(2.0)
    try:
        torch.ops.magi.ce_staged([w], ["bfloat16"], [g.group_name], True)
        res["changed"] = "no error"
    except RuntimeError as e:
        res["changed"] = str(e)
    return res


def test_cast_slots_exact_on_loopback():
    (r,) = run_ranks(_rank_cast, 1, timeout=300)
    print(r)
    assert r["loaded"], r
    assert r["slot_is_window"] and r["even_exact"] and r["uneven_exact"], r
    assert r["counts"] == {"native": 2, "torch": 0}, r
    assert "changed in place outside torch_ce.updating_weights" in r["changed"], r
