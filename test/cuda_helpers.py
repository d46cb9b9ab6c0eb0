"""Test scaffolding for the C++ kernels on one GPU (not part of the library).

    register_loopback(mine, peer, group, rank=0) -> Slot

Binds ``mine`` as a 2-rank slot whose other rank's copy is the local tensor ``peer``:
symmetric memory refuses two ranks on one device, but the gather mechanics (registry, copy
streams, events, batch submission, c10d work, graph capture) do not care where the peer
copy lives. ``rank`` is this rank's position in the pair. The slot goes through
``windows.register`` (which mirrors it into the C++ index); ``release_all`` forgets it.
Used by test/test_native_cuda.py and, by path, bench/issue_cost.py.
"""
from __future__ import annotations

import torch


def register_loopback(mine: torch.Tensor, peer: torch.Tensor, group, rank: int = 0):
    from torch_ce.runtime import windows as W

    if peer.shape != mine.shape or peer.dtype != mine.dtype or not (mine.is_contiguous() and peer.is_contiguous()):
        raise ValueError("register_loopback needs two contiguous tensors of one shape and dtype")
    nbytes = mine.numel() * mine.element_size()
    w = W.Window(("loopback", group.group_name), 0, nbytes, group, (rank, 1 - rank), rank,
                 mine.device, mine.view(-1).view(torch.uint8), used=nbytes)
    slot = W.Slot(w, 0, nbytes, tuple(mine.shape), mine.dtype, "loopback")
    pair = [mine, peer] if rank == 0 else [peer, mine]
    slot.peer_ptrs = [t.data_ptr() for t in pair]
    slot.peer_views = list(pair)
    W.register(mine, slot)
    return slot
