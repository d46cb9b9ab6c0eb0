"""The C++ kernels of the magi gathers (csrc/ce_torch.cpp, NOTE [native gather path]).

Loaded once, at import of ``torch_ce.ops``, when the library was built (CUDA build of
torch and nvcc at install) and ``TORCH_CE_NATIVE`` is not 0. Loaded, they are the one CUDA
gather: ``magi::ce_all_gather[_coalesced]`` on CUDA, and the bound members of whatever
bucket they hand to the Python kernel (``gather_bound``). Their slot index mirrors the
registry of ``windows.py``, whose ``register``/``release_all`` alone write it.

The order of a gather's peer reads (NOTE [peer order] in csrc/ce_copy.h) is read once from
the environment and can be changed at run time (``peer_order_as``, for A/B runs):

  TORCH_CE_PEER_ORDER       rotated (default) | rotated-member | fixed (the first order:
                            every rank reads rank 0 first)
  TORCH_CE_PEER_CHUNK_MIB   0 (default: whole slabs) or the piece size of the chunked
                            interleave, rounded down to 512 bytes

The pure-torch fallback follows the rotation (``gather.copy_peers``), not the chunking.

Not loaded, CUDA weights stay on the collective (``kernel_refusal`` refuses them at bind,
with one loud warning) unless ``config.cuda_torch_fallback`` opts in to per-peer ``copy_``
(runtime/gather.py). CPU weights need nothing compiled: the host transport's memcpy is
their kernel.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import math
import os
import threading
import warnings

import torch

from .eligibility import Reason, Refusal, refusal

log = logging.getLogger("torch_ce")

_state: list = []  # [loaded: bool, why not: str] once decided
# Test hook: device types whose gather kernel counts as missing ("cpu" lets a CPU test
# take the path a CUDA job without the C++ kernels takes).
_force_unavailable: set[str] = set()
_warned: set[str] = set()
_warn_lock = threading.Lock()

_FIX = ("install a CUDA build of torch and nvcc, then `pip install --no-build-isolation -e .` "
        "from the torch_ce source tree (without TORCH_CE_SKIP_CUDA_BUILD; unset TORCH_CE_NATIVE=0)")


def library_path() -> str | None:
    found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ce_torch*.so")))
    return found[0] if found else None


# NOTE [peer order] in csrc/ce_copy.h: name -> the C++ enum PeerOrder.
PEER_ORDERS = {"fixed": 0, "rotated": 1, "rotated-member": 2}
_peer: dict = {}  # "order", "chunk_bytes": from the environment on first use


def chunk_bytes(mib: float) -> int:
    """``mib`` MiB as a piece size: whole 512-byte multiples (slot alignment, the copy
    engines' best), at least 512; 0 stays 0 (off)."""
    if not (isinstance(mib, (int, float)) and math.isfinite(mib) and mib >= 0):
        raise ValueError(f"torch_ce: peer chunk must be a finite number of MiB >= 0, got {mib!r}")
    return 0 if mib == 0 else max(512, int(mib * 2**20) // 512 * 512)


def _peer_from_env() -> dict:
    order = os.environ.get("TORCH_CE_PEER_ORDER", "").strip().lower() or "rotated"
    if order not in PEER_ORDERS:
        raise ValueError(f"torch_ce: TORCH_CE_PEER_ORDER={order!r}: expected one of {sorted(PEER_ORDERS)}")
    raw = os.environ.get("TORCH_CE_PEER_CHUNK_MIB", "").strip() or "0"
    try:
        chunk = chunk_bytes(float(raw))
    except ValueError:
        raise ValueError(f"torch_ce: TORCH_CE_PEER_CHUNK_MIB={raw!r}: expected a number of "
                         "MiB >= 0") from None
    return dict(order=order, chunk_bytes=chunk)


def peer_order() -> tuple[str, int]:
    """(order name, chunk bytes) of the gathers' peer reads now."""
    if not _peer:
        _peer.update(_peer_from_env())
    return _peer["order"], _peer["chunk_bytes"]


@contextlib.contextmanager
def peer_order_as(order: str | None = None, chunk_mib: float | None = None):
    """Gathers issued inside use this peer-read order and/or chunk (None: keep); the
    previous setting comes back on exit (A/B runs: bench ops, bench e2e)."""
    prev = peer_order()
    if order is not None and order not in PEER_ORDERS:
        raise ValueError(f"torch_ce: peer order {order!r}: expected one of {sorted(PEER_ORDERS)}")
    _peer.update(order=prev[0] if order is None else order,
                 chunk_bytes=prev[1] if chunk_mib is None else chunk_bytes(chunk_mib))
    _push_peer_order()
    try:
        yield
    finally:
        _peer.update(order=prev[0], chunk_bytes=prev[1])
        _push_peer_order()


def _push_peer_order() -> None:
    order, chunk = peer_order()
    if loaded():
        torch.ops.torch_ce_native.set_peer_order(PEER_ORDERS[order], chunk)


def load() -> bool:
    """Load the C++ kernels once; False (the reason kept for ``kernel_refusal``) when they
    cannot serve."""
    if _state:
        return _state[0]
    ok, why = False, ""
    if os.environ.get("TORCH_CE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        why = "TORCH_CE_NATIVE=0"
    elif torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU build"
    elif library_path() is None:
        why = "csrc/ce_torch.cpp was not built (needs nvcc and a CUDA build of torch at install)"
    else:
        try:
            torch.ops.load_library(library_path())
            ok = True
        except (OSError, RuntimeError) as e:
            why = f"cannot load {library_path()}: {e}"
    if not ok:
        log.debug("torch_ce: C++ gather kernels not in use: %s", why)
    _state[:] = [ok, why]
    _push_peer_order()  # the environment's order (a bad value raises here, loudly)
    return ok


def loaded() -> bool:
    return bool(_state and _state[0])


def _missing(device_type: str) -> str | None:
    """Why ``device_type`` has no gather kernel here (None: it has one)."""
    if device_type in _force_unavailable:
        return f"disabled for {device_type!r} by native._force_unavailable (a test hook)"
    if device_type == "cuda" and not load():
        return _state[1]
    return None


def kernel_refusal(device_type: str) -> Refusal | None:
    """Why a ``device_type`` shard must stay on the collective for want of a gather kernel
    (None: a kernel serves it). Without the C++ kernels a CUDA gather would be per-peer
    ``copy_`` calls (slower than NCCL), so they are refused unless
    ``config.cuda_torch_fallback`` opts in; the first such refusal warns, loudly, once."""
    why = _refusal(device_type)
    if why is not None and why.code == Reason.NO_GATHER_KERNEL:
        _warn_once(device_type, _missing(device_type))
    return why


def _refusal(device_type: str) -> Refusal | None:
    from ..config import config

    if device_type == "cuda" and not torch.cuda.is_available():
        return refusal(Reason.CUDA_UNAVAILABLE, "CUDA unavailable")
    why = _missing(device_type)
    if why is None or (device_type == "cuda" and config.cuda_torch_fallback):
        return None
    return refusal(Reason.NO_GATHER_KERNEL,
                   f"no {device_type} gather kernel ({why}): stays on the collective")


def _warn_once(device_type: str, why: str) -> None:
    with _warn_lock:
        if device_type in _warned:
            return
        _warned.add(device_type)
    msg = (f"torch_ce: transport='copy_engine' but the C++ gather kernels (csrc/ce_torch.cpp) "
           f"are not available: {why}. Every {device_type} weight gather stays on the "
           f"collective backend (NCCL); nothing runs on the copy engines. To fix: {_FIX}. "
           "To use the slow pure-torch fallback (per-peer copy_, slower than NCCL) instead: "
           "TORCH_CE_CUDA_TORCH_FALLBACK=1 or torch_ce.config.update(cuda_torch_fallback=True).")
    log.warning("%s", msg)
    warnings.warn(msg, stacklevel=3)


def kernel_path(device_type: str) -> str:
    """Which gather serves bound ``device_type`` shards, in words (for ``explain()``)."""
    if device_type not in ("cuda", "cpu"):
        return f"none: gathers stay on the collective (unsupported device {device_type})"
    refused = _refusal(device_type)
    if refused is not None:
        return f"none: gathers stay on the collective ({refused.text})"
    if device_type == "cpu":
        return "host transport (shared-memory memcpy)"
    if loaded():
        return "C++ kernels (csrc/ce_torch.cpp)"
    return "pure-torch fallback (opted in, slow)"


def register_slot(slot) -> None:
    """Mirror a published CUDA slot into the C++ index (keyed by this rank's address).
    Called by ``windows.register`` only."""
    w = slot.window
    torch.ops.torch_ce_native.register_slot(
        int(slot.peer_ptrs[w.rank]), [int(p) for p in slot.peer_ptrs], w.rank, slot.nbytes,
        slot.dtype, list(slot.shape), w.group.group_name)


def unregister(key: int) -> None:
    """Drop the C++ index's entry at ``key`` (``windows.register`` replaced it)."""
    if loaded():
        torch.ops.torch_ce_native.unregister_slot(int(key))


def clear() -> None:
    if loaded():
        torch.ops.torch_ce_native.clear_slots()


def slot_count() -> int:
    return int(torch.ops.torch_ce_native.slot_count()) if loaded() else 0


def gather_bound(shards: list[torch.Tensor], group_size: int) -> list[torch.Tensor]:
    """The C++ gather of bound CUDA shards, for the buckets the Python kernel handled."""
    return torch.ops.torch_ce_native.gather_bound(list(shards), group_size)


def gather_rows(shard: torch.Tensor, ids: torch.Tensor, group_size: int) -> torch.Tensor:
    """The C++ row gather of a bound CUDA shard (NOTE [row kernel] in csrc/ce_rows.cu)."""
    return torch.ops.torch_ce_native.gather_rows(shard, ids, group_size)


def set_split_local_copy(split: bool) -> None:
    """Copy this rank's own rows on a second copy stream (default) or inside the peer batch."""
    if loaded():
        torch.ops.torch_ce_native.set_split_local_copy(bool(split))


@contextlib.contextmanager
def split_local_copy_as(split: bool):
    """Gathers issued inside copy this rank's own rows on the second copy stream (True, the
    default) or inside the peer batch (False); back to the default on exit (A/B runs:
    bench ops' ce1_inbatch, bench e2e's ce_inbatch)."""
    set_split_local_copy(split)
    try:
        yield
    finally:
        set_split_local_copy(True)


def set_prefetch_pending(pending: bool) -> None:
    """While prefetched outputs are parked, hand every bucket to the Python kernel, which
    knows the park (NOTE [cross-call prefetch] in prefetch.py)."""
    if loaded():
        torch.ops.torch_ce_native.set_prefetch_pending(bool(pending))
