"""The C++ kernels of the magi gathers (csrc/ce_torch.cpp, NOTE [native gather path]).

Loaded once, at import of ``torch_ce.ops``, when the library was built (CUDA build of
torch and nvcc at install) and ``TORCH_CE_NATIVE`` is not 0. Loaded, it serves
``magi::ce_all_gather[_coalesced]`` on CUDA and hands anything but bound shards to the
Python kernel; not loaded, the Python kernel serves everything. The windows' slots are
mirrored into its registry when they are published (``register_slot``).
"""
from __future__ import annotations

import glob
import logging
import os

import torch

log = logging.getLogger("torch_ce")

_state: list = []  # [loaded: bool] once decided


def library_path() -> str | None:
    found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ce_torch*.so")))
    return found[0] if found else None


def load() -> bool:
    """Load the C++ kernels once; False (with the reason logged) when they cannot serve."""
    if _state:
        return _state[0]
    ok, why = False, ""
    if os.environ.get("TORCH_CE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        why = "TORCH_CE_NATIVE=0"
    elif torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU build"
    elif library_path() is None:
        why = "not built (needs nvcc and a CUDA build of torch at install)"
    else:
        try:
            torch.ops.load_library(library_path())
            ok = True
        except (OSError, RuntimeError) as e:
            why = f"cannot load {library_path()}: {e}"
            log.warning("torch_ce: the C++ gather kernels %s; the Python kernels serve "
                        "(rebuild with `pip install --no-build-isolation -e .` against this torch)", why)
    if not ok:
        log.debug("torch_ce: C++ gather kernels not in use: %s", why)
    _state[:] = [ok]
    return ok


def loaded() -> bool:
    return bool(_state and _state[0])


def register_slot(slot) -> None:
    """Mirror a published CUDA slot into the C++ registry (keyed by this rank's address)."""
    w = slot.window
    torch.ops.torch_ce_native.register_slot(
        int(slot.peer_ptrs[w.rank]), [int(p) for p in slot.peer_ptrs], w.rank, slot.nbytes,
        slot.dtype, list(slot.shape), w.group.group_name)


def clear() -> None:
    if loaded():
        torch.ops.torch_ce_native.clear_slots()


def slot_count() -> int:
    return int(torch.ops.torch_ce_native.slot_count()) if loaded() else 0


def set_split_local_copy(split: bool) -> None:
    """Copy this rank's own rows on a second copy stream (default) or inside the peer batch."""
    if loaded():
        torch.ops.torch_ce_native.set_split_local_copy(bool(split))


def set_prefetch_pending(pending: bool) -> None:
    """While prefetched outputs are parked, hand every bucket to the Python kernel, which
    knows the park (NOTE [cross-call prefetch] in prefetch.py)."""
    if loaded():
        torch.ops.torch_ce_native.set_prefetch_pending(bool(pending))


def register_loopback(mine, peer, group, rank: int = 0):
    """Bind ``mine`` as a 2-rank slot whose other rank's copy is the local tensor ``peer``.

    For one-GPU checks and the issue-cost bench: symmetric memory refuses two ranks on one
    device, but the gather mechanics (registry, copy streams, events, batch submission,
    c10d work, graph capture) do not care where the peer copy lives. ``rank`` is this
    rank's position in the pair. Returns the Slot (in both registries); ``release_all``
    forgets it.
    """
    from . import windows as W

    nbytes = mine.numel() * mine.element_size()
    if peer.shape != mine.shape or peer.dtype != mine.dtype or not (mine.is_contiguous() and peer.is_contiguous()):
        raise ValueError("torch_ce: register_loopback needs two contiguous tensors of one shape and dtype")
    w = W.Window(("loopback", group.group_name), 0, nbytes, group, (rank, 1 - rank), rank,
                 mine.device, mine.view(-1).view(torch.uint8), used=nbytes)
    slot = W.Slot(w, 0, nbytes, tuple(mine.shape), mine.dtype, "loopback")
    slot.peer_ptrs = [mine.data_ptr(), peer.data_ptr()][:: 1 if rank == 0 else -1]
    W.register(mine, slot)
    if loaded():
        register_slot(slot)
    return slot
