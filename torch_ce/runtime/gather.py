"""The gather of bound slots: one function for the ops and the calibration.

On CUDA with the C++ kernels loaded it is their gather (NOTE [native gather path] in
csrc/ce_torch.cpp). Everywhere else it is ``copy_peers``: per-peer ``copy_`` of each
slot's ``peer_views`` on the *current* stream. On CPU that is the host transport's memcpy
(it completes before returning); on CUDA it is the opted-in fallback
(``config.cuda_torch_fallback``), ordered by the current stream alone, so its outputs
carry no c10d work and ``wait_tensor`` on them returns at once (it waits only on work
registered for the tensor).
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import native
from .windows import Slot


def copy_peers(outs: Sequence[torch.Tensor], slots: Sequence[Slot]) -> None:
    """One-sided reads: rank r's copy of each member lands at rows [r*rows, (r+1)*rows)."""
    for out, slot in zip(outs, slots):
        chunks = out.view(slot.group_size, *slot.shape)
        for r, src in enumerate(slot.peer_views):
            chunks[r].copy_(src)


def gather_slots(shards: Sequence[torch.Tensor], slots: Sequence[Slot], group_size: int) -> list[torch.Tensor]:
    """Fresh outputs of ``group_size`` x rows for bound ``shards`` (their ``slots``, whose
    group the caller checked)."""
    if shards[0].is_cuda and native.loaded():
        return native.gather_bound(list(shards), group_size)
    outs = [s.new_empty((group_size * s.shape[0], *s.shape[1:])) for s in shards]
    copy_peers(outs, slots)
    return outs
