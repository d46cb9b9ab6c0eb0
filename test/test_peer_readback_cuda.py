"""The peer read-back at bind (NOTE [peer read-back at bind] in torch_ce/runtime/readback.py)
on one GPU, through the gathers' own CUDA copy path.

Symmetric memory refuses two ranks on one device, so a window here is a loopback pair (as
``cuda_helpers.register_loopback``): this rank's copy and its "peer"'s are two device
buffers, published by the CUDA transport's own ``publish_slot`` through a stand-in for the
symmetric-memory handle. The reads go where the gathers' go: the C++ gather's batched
peer copies when the kernels are built (counted through ``native.gather_bound``), else the
pure-torch per-peer ``copy_`` (``cuda_torch_fallback``). Checked:

- ``write_word`` / ``read_words``: each rank's canary comes back, in group order, and the
  probe leaves no slot behind in the C++ index;
- a peer address that maps other memory (a mapping that does not reach the peer's window)
  reads that memory, not the canary;
- ``read_back`` with a stand-in round (the peer's canary written when the "peer" posts it):
  a healthy pair passes, the bad mapping fails its pool with ``Reason.PEER_READBACK`` naming
  the peer, a raising read fails it too, ``bind_readback=False`` reads nothing;
- ``alias`` (the move's re-pointing, NOTE [inference tensors at bind]) keeps a CUDA slot
  view's storage and gives the kind asked for.

Skipped without a GPU. Self-contained: one spawned rank (gloo group of one), no NCCL.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from mp_harness import count_gathers, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NBYTES = 4096


class _Handle:
    """The part of a symmetric-memory handle ``cuda.publish_slot`` uses: every rank's
    buffer, typed, at an element offset."""

    def __init__(self, bufs):
        self.bufs = bufs

    def get_buffer(self, rank, shape, dtype, storage_offset=0):
        n = math.prod(shape)
        return self.bufs[rank].view(dtype)[storage_offset:storage_offset + n].view(shape)


def _window(pos: int, bufs, group, index: int = 0):
    """A loopback window: this rank is ``pos`` of the pair, ``bufs`` the two copies."""
    from torch_ce.runtime import windows as W

    return W.Window(("readback-loopback", pos, index), index, NBYTES, group, (0, 1), pos,
                    bufs[pos].device, bufs[pos], handle=_Handle(bufs),
                    peer_base_ptrs=[b.data_ptr() for b in bufs])


class _Round:
    """A stand-in for the bind's round, as rank ``pos`` of ranks (0, 1) sees it: the
    "peer" posts ``peer_canaries`` (writing each into its copy first, as a rank does) and
    reports nothing wrong."""

    def __init__(self, pos: int, peer_bufs: dict, peer_canaries: dict):
        self.rank, self.peer = pos, 1 - pos
        self.peer_bufs, self.peer_canaries = peer_bufs, peer_canaries
        self.phases = []

    def exchange(self, phase, payload):
        self.phases.append(phase)
        if phase == "readback-canary":
            for key, value in self.peer_canaries.items():
                self.peer_bufs[key].view(torch.int64)[0] = value
            torch.cuda.synchronize()
            return {self.rank: payload, self.peer: dict(self.peer_canaries)}
        return {self.rank: payload, self.peer: {}}


def _plan(w):
    from torch_ce.runtime import binding
    from torch_ce.runtime import window_pools as WP
    from torch_ce.runtime import windows as W

    return binding._PoolPlan(w.pool_key, WP.WindowPool(w.pool_key), [], W.Layout([], [w.nbytes]), [w])


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import torch_ce
    from torch_ce.runtime import inference_tensors, native, readback
    from torch_ce.runtime.eligibility import Reason

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch_ce.config.update(cuda_torch_fallback=True)  # without the C++ kernels: per-peer copy_
    g = dist.group.WORLD
    out = dict(native=native.loaded(), code=int(Reason.PEER_READBACK))
    counts = count_gathers()
    slots_before = native.slot_count()
    keep = []
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh canaries

    def canary():
        return int(torch.randint(1, 2**62, (1,), generator=gen))

    # 1. write and read back, both positions
    reads = {}
    for pos in (0, 1):
        bufs = [torch.zeros(NBYTES, dtype=torch.uint8, device=dev) for _ in range(2)]
        keep.append(bufs)
        w = _window(pos, bufs, g)
        mine, theirs = canary(), canary()
        readback.write_word(w, mine)
        bufs[1 - pos].view(torch.int64)[0] = theirs
        torch.cuda.synchronize()
        want = [mine, theirs] if pos == 0 else [theirs, mine]
        reads[pos] = (readback.read_words(w), want)
    out["reads"] = {p: got == want for p, (got, want) in reads.items()}
    out["slots_left"] = native.slot_count() - slots_before
    out["gathers"] = dict(counts)

    # 2. a peer address that maps other memory: that memory is what comes back
    bufs = [torch.zeros(NBYTES, dtype=torch.uint8, device=dev) for _ in range(2)]
    other = torch.full((NBYTES,), 7, dtype=torch.uint8, device=dev)
    keep += [bufs, other]
    w = _window(0, bufs, g)
    w.peer_base_ptrs[1] = other.data_ptr()
    w.handle = _Handle([bufs[0], other])
    readback.write_word(w, canary())
    bufs[1].view(torch.int64)[0] = canary()
    torch.cuda.synchronize()
    got = readback.read_words(w)
    out["misread"] = dict(got=got[1], other=int(other.view(torch.int64)[0]), canary=int(bufs[1].view(torch.int64)[0]))

    # 3. the decision, with a stand-in round
    def decide(broken: bool, raising: bool = False):
        bufs = [torch.zeros(NBYTES, dtype=torch.uint8, device=dev) for _ in range(2)]
        other = torch.zeros(NBYTES, dtype=torch.uint8, device=dev)
        keep.extend([bufs, other])
        w = _window(0, bufs, g)
        if broken:
            w.peer_base_ptrs[1] = other.data_ptr()
            w.handle = _Handle([bufs[0], other])
        rnd = _Round(0, {"0/0": bufs[1]}, {"0/0": canary()})
        real = readback.read_words
        if raising:
            def fail(w_):
                raise RuntimeError("injected copy error")
            readback.read_words = fail
        try:
            verdict = readback.read_back([_plan(w)], rnd, torch_ce.config.bind_readback)
        finally:
            readback.read_words = real
        return {i: (int(r.code), r.text) for i, r in verdict.items()}, rnd.phases

    out["healthy"] = decide(False)
    out["broken"] = decide(True)
    out["raising"] = decide(False, raising=True)
    torch_ce.config.update(bind_readback=False)
    try:
        out["off"] = decide(True)
    finally:
        torch_ce.config.update(bind_readback=True)

    # 4. the move's alias of a CUDA slot view
    view = bufs[0].view(torch.float32)[:16].view(4, 4)
    ali = [inference_tensors.alias(view, inf) for inf in (True, False)]
    out["alias"] = [(a.is_inference(), a.data_ptr() == view.data_ptr(), tuple(a.shape)) for a in ali]
    torch.cuda.synchronize()
    return out


def test_peer_readback_on_one_gpu():
    (r,) = run_ranks(_rank, 1, timeout=300)
    print(r)
    assert r["reads"] == {0: True, 1: True}, r
    assert r["slots_left"] == 0, r  # the probe's registration is gone
    if r["native"]:
        assert r["gathers"]["native"] == 2 and r["gathers"]["torch"] == 0, r  # the C++ gather read
    else:
        assert r["gathers"]["torch"] == 2, r
    m = r["misread"]
    assert m["got"] == m["other"] != m["canary"], m

    verdict, phases = r["healthy"]
    assert verdict == {} and phases == ["readback-canary", "readback"], r["healthy"]
    verdict, phases = r["broken"]
    assert list(verdict) == [0] and verdict[0][0] == r["code"], r["broken"]
    assert "peer read-back at bind failed" in verdict[0][1] and "from rank 1's window #0" in verdict[0][1], verdict
    verdict, _ = r["raising"]
    assert list(verdict) == [0] and "injected copy error" in verdict[0][1], r["raising"]
    verdict, phases = r["off"]
    assert verdict == {} and phases == [], r["off"]

    assert r["alias"] == [(True, True, (4, 4)), (False, True, (4, 4))], r["alias"]
