"""The gather of bound slots: one function for the ops and the calibration; and the row
gather of embedding lookups (``gather_rows``, NOTE [row gathers] in passes/rows.py). Here
the kernel that serves each is chosen (``kernel_path`` says which, for ``explain()``).

On CUDA with the C++ kernels loaded it is their gather (NOTE [native gather path] in
csrc/ce_gather.cu). Everywhere else it is ``copy_peers``: per-peer ``copy_`` of each
slot's ``peer_views`` on the *current* stream, in the C++ gather's peer order. On CPU that
is the host transport's memcpy (it completes before returning); on CUDA it is the opted-in fallback
(``config.cuda_torch_fallback``), ordered by the current stream alone, so its outputs
carry no c10d work and ``wait_tensor`` on them returns at once (it waits only on work
registered for the tensor).

A CUDA row gather runs the CUDA row kernel when nvcc built it (csrc/ce_rows.cu, through
``native.gather_rows``), else the Triton one (runtime/rows_triton.py), else ``take_rows``
with one loud warning: ``row_path()``. The Triton kernel reads its owners' addresses from
a device table made when the slot is registered (``windows.on_cuda_slot``), outside any
capture.

This module is entered from above only (ops.py, explain()): it imports ``native`` and
``windows``, which never import it (test/test_layout.py).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from typing import Sequence

import torch

from . import native, rows_triton
from . import windows as W
from .eligibility import Reason
from .window_pools import on_release
from .windows import Slot

log = logging.getLogger("torch_ce")


def peer_order(rank: int, world: int, order: str = "rotated") -> list[int]:
    """The peers ``rank`` reads, in order (NOTE [peer order] in csrc/ce_copy.h; the same
    sequence as its ``read_plan`` without the own rows): rotated ``rank+1, ..., rank-1``
    (mod ``world``), so at each step every rank reads a different peer; ``"fixed"``:
    ``0, 1, ..., world-1``, where every rank reads rank 0 first."""
    if order == "fixed":
        return [k for k in range(world) if k != rank]
    return [(rank + k) % world for k in range(1, world)]


def copy_peers(outs: Sequence[torch.Tensor], slots: Sequence[Slot]) -> None:
    """One-sided reads: rank r's copy of each member lands at rows [r*rows, (r+1)*rows).
    Peer-major in ``native.peer_order()``'s order (rotation only: no chunking), this
    rank's own rows last."""
    mode = native.peer_order()[0]
    views = [out.view(slot.group_size, *slot.shape) for out, slot in zip(outs, slots)]
    orders = [peer_order(s.window.rank, s.group_size, mode) + [s.window.rank] for s in slots]
    for k in range(slots[0].group_size):
        for view, slot, order in zip(views, slots, orders):
            view[order[k]].copy_(slot.peer_views[order[k]])


def gather_slots(shards: Sequence[torch.Tensor], slots: Sequence[Slot], group_size: int) -> list[torch.Tensor]:
    """Fresh outputs of ``group_size`` x rows for bound ``shards`` (their ``slots``, whose
    group the caller checked)."""
    if shards[0].is_cuda and native.loaded():
        return native.gather_bound(list(shards), group_size)
    outs = [s.new_empty((group_size * s.shape[0], *s.shape[1:])) for s in shards]
    copy_peers(outs, slots)
    return outs


def gather_dim_shape(shape, group_size: int, dim: int) -> list[int]:
    """The gathered weight's shape of a Shard(``dim``) shard (NOTE [Shard(1) reads] in
    passes/gate.py): ``shape`` with dim ``dim`` times ``group_size``."""
    full = list(shape)
    full[dim] *= group_size
    return full


def copy_peers_dim(out: torch.Tensor, slot: Slot, dim: int) -> None:
    """One-sided strided reads: rank r's shard lands at ``out[..., r*h:(r+1)*h, ...]`` (h =
    its size along ``dim``), i.e. ``prod(shape[:dim])`` row blocks of ``prod(shape[dim:])``
    elements, a ``group_size`` times wider pitch apart in ``out``. The same peer order as
    ``copy_peers``, this rank's own block last."""
    outer = 1
    for n in slot.shape[:dim]:
        outer *= int(n)
    view = out.view(outer, slot.group_size, -1)
    order = peer_order(slot.window.rank, slot.group_size, native.peer_order()[0]) + [slot.window.rank]
    for r in order:
        view[:, r].copy_(slot.peer_views[r].reshape(outer, -1))


def gather_slot_dim(shard: torch.Tensor, slot: Slot, group_size: int, dim: int) -> torch.Tensor:
    """A fresh gathered weight of a bound Shard(``dim``) ``shard`` (its ``slot``, whose group
    the caller checked), in its final layout: the C++ strided reads on CUDA (NOTE [strided
    reads] in csrc/ce_copy.h), else ``copy_peers_dim``."""
    if shard.is_cuda and native.loaded():
        return native.gather_bound_dim([shard], group_size, [dim])[0]
    out = shard.new_empty(gather_dim_shape(shard.shape, group_size, dim))
    copy_peers_dim(out, slot, dim)
    return out


# NOTE [strided reads] in csrc/ce_copy.h: name -> the C++ enum DimStrategy.
DIM_STRATEGIES = {"rows": 0, "2d": 1, "3d": 2}


@contextlib.contextmanager
def dim_strategy_as(name: str):
    """Shard(d) gathers issued inside hand their strided blocks to the copy engines as
    ``name`` (NOTE [strided reads]: "rows", one batch entry per row block; "2d", one
    cudaMemcpy2DAsync per peer block; "3d", the default, one cudaMemcpy3DBatchAsync); the
    default comes back on exit. An A/B switch for bench/compare/dim1_cost.py and the GPU
    tests; without the C++ kernels it changes nothing."""
    if name not in DIM_STRATEGIES:
        raise ValueError(f"torch_ce: dim strategy {name!r}: expected one of {sorted(DIM_STRATEGIES)}")
    if not native.loaded():
        yield
        return
    prev = native.dim_strategy()
    native.set_dim_strategy(DIM_STRATEGIES[name])
    try:
        yield
    finally:
        native.set_dim_strategy(prev)


_rows: list = []  # [path, why] once decided


def row_path() -> tuple[str | None, str]:
    """(kernel, why) of CUDA row gathers: "cuda" (csrc/ce_rows.cu, built by nvcc),
    "triton" (runtime/rows_triton.py), or None (``take_rows``) with the reason."""
    if not _rows:
        if not native.loaded():
            _rows[:] = [None, "the C++ kernels are not loaded"]
        elif native.build_info()[2] == "cuda":
            _rows[:] = ["cuda", ""]
        else:
            why = rows_triton.unavailable()
            _rows[:] = [None, why] if why else ["triton", ""]
    return _rows[0], _rows[1]


_row_tables: dict = {}  # this rank's key -> (device table of owners' addresses, slot)


def _mirror_row_table(key: int, slot: Slot | None) -> None:
    """``windows.on_cuda_slot``: when the Triton kernel serves the row gather, a published
    CUDA slot's owners' address table, keyed by this rank's address (as the C++ index)."""
    if slot is not None and row_path()[0] == "triton":
        _row_tables[int(slot.peer_ptrs[slot.window.rank])] = (
            rows_triton.table(slot.peer_ptrs, slot.window.device), slot)
    else:
        _row_tables.pop(int(key), None)


W.on_cuda_slot(_mirror_row_table)
on_release(_row_tables.clear)

_warned_rows: list = []
_warn_lock = threading.Lock()


def gather_rows(shard: torch.Tensor, slot: Slot, ids: torch.Tensor) -> torch.Tensor:
    """``embedding(gathered table, ids)`` of a bound ``shard`` (its ``slot``, whose group
    the caller checked): on CUDA with the C++ kernels loaded, the row kernel ``row_path()``
    names (NOTE [row kernel] in csrc/ce_rows.cu); else, or without one, ``take_rows``."""
    if not (shard.is_cuda and native.loaded()):
        return take_rows(slot, ids)
    path, why = row_path()
    if path == "cuda":
        return native.gather_rows(shard, ids, slot.group_size)
    entry = _row_tables.get(shard.data_ptr())
    if path == "triton" and entry is not None:
        peers, mirrored = entry
        if mirrored.group_size != slot.group_size or mirrored.dtype != shard.dtype \
                or tuple(mirrored.shape) != tuple(shard.shape):
            raise RuntimeError("torch_ce: gather_rows: the shard does not match its slot "
                               "(dtype, shape or group size)")
        return rows_triton.gather_rows(peers, mirrored.peer_ptrs, mirrored.shape, mirrored.dtype, ids)
    with _warn_lock:
        first = not _warned_rows
        if first:
            _warned_rows.append(True)
    if first:
        msg = (f"torch_ce: no row-gather kernel ({why}): CUDA embedding lookups of "
               "bound tables use pure-torch indexing (syncs with the host per peer). With "
               f"nvcc the CUDA kernel is built: {native.build_command()}")
        log.warning("%s", msg)
        warnings.warn(msg, stacklevel=2)
    return take_rows(slot, ids)


def kernel_path(device_type: str) -> str:
    """Which gather serves bound ``device_type`` shards, in words (for ``explain()``): the
    library and how it was built, the row gather's kernel; when CUDA kernels are missing,
    the one command that builds them."""
    if device_type not in ("cuda", "cpu"):
        return f"none: gathers stay on the collective (unsupported device {device_type})"
    refused = native.kernel_refusal(device_type, warn=False)
    if refused is not None:
        fix = f". To build the kernels: {native.build_command()}" \
            if refused.code == Reason.NO_GATHER_KERNEL and device_type == "cuda" else ""
        return f"none: gathers stay on the collective ({refused.text}){fix}"
    if device_type == "cpu":
        return "host transport (shared-memory memcpy)"
    if native.loaded():
        tool, headers, _ = native.build_info()
        rows, why = row_path()
        rows_text = {"cuda": "CUDA kernel (csrc/ce_rows.cu)",
                     "triton": "Triton kernel (runtime/rows_triton.py)"}.get(
            rows, f"pure-torch take_rows ({why}; slow: syncs per peer)")
        return (f"C++ kernels (csrc/ce_ops.cu, built by {tool} against CUDA {headers} "
                f"headers); row gather: {rows_text}")
    return f"pure-torch fallback (opted in, slow). To build the kernels: {native.build_command()}"


def take_rows(slot: Slot, ids: torch.Tensor) -> torch.Tensor:
    """Per owner, the rows of ``ids`` it owns, read from its ``peer_views``. Out-of-range ids
    raise ``IndexError`` as ``F.embedding`` does on CPU (on CUDA: a device-side assert, as
    CUDA's embedding; ``nonzero`` syncs once per peer there, which the opted-in slow
    fallback accepts)."""
    rows, world = slot.shape[0], slot.group_size
    flat = ids.reshape(-1)
    if ids.is_cuda:
        torch._assert_async(((flat >= 0) & (flat < rows * world)).all(),
                            "torch_ce: ce_gather_rows: index out of range")
    elif flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows * world):
        raise IndexError("index out of range in self")
    owner = torch.div(flat, rows, rounding_mode="floor")
    local = flat - owner * rows
    out = flat.new_empty((flat.numel(), *slot.shape[1:]), dtype=slot.dtype)
    for r in range(world):
        sel = (owner == r).nonzero().squeeze(1)
        out.index_copy_(0, sel, slot.peer_views[r].index_select(0, local.index_select(0, sel)))
    return out.view(*ids.shape, *slot.shape[1:])
