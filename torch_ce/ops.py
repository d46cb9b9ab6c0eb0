"""The ``magi`` ops: copy-engine all-gathers of bound shards, and the bind step.

Signatures mirror ``_c10d_functional.all_gather_into_tensor[_coalesced]`` so a graph node
can be retargeted without rebuilding its args:

    magi::ce_all_gather(Tensor shard, int group_size, str group_name) -> Tensor
    magi::ce_all_gather_coalesced(Tensor[] shards, int group_size, str group_name) -> Tensor[]

Output: a fresh tensor of ``group_size * shard.shape[0]`` rows, rank r's shard at row
``r * rows``. The shard must have been bound (``torch_ce.bind`` or the compiled bind step);
a shard whose binding was refused by agreement is gathered by the group's collective
backend instead (NOTE [agreement before anything moves] in runtime/agreement.py). On CUDA the C++
kernels' outputs carry c10d work: ``_c10d_functional.wait_tensor`` orders the consumer
after the copies. The host transport (CPU) and the opted-in pure-torch CUDA fallback copy
on the current stream (runtime/gather.py).

    magi::ce_all_gather_dim(Tensor shard, int group_size, str group_name, int gather_dim) -> Tensor

A Shard(``gather_dim``) weight gathered into its final layout (NOTE [Shard(1) reads] in
passes/gate.py): ``gather_dim`` of the output is ``group_size`` times the shard's, rank r's
shard at ``[..., r*h:(r+1)*h, ...]`` along it (``gather_dim`` 0 is ``ce_all_gather``). What
``cat(all_gather(shard).split(shard.shape[0]), gather_dim)`` computes, without the
intermediate. Strided one-sided reads; the output carries c10d work on CUDA like
``ce_all_gather``'s (wait_tensor). Refused by agreement: the collective, waited, then the
re-split, on every rank.

    magi::ce_all_gather_padded(Tensor shard, int rows, int group_size, str group_name) -> Tensor

The gather of an uneven ``Shard(0)`` weight (NOTE [uneven Shard(0): padded slots] in
runtime/windows.py): ``shard`` has at most ``rows`` rows (the short ranks' fewer, or none),
``rows`` is the largest shard's (the same on every rank); the output is what the
collective gathers of the shards zero-padded to ``rows``: ``group_size * rows`` rows, rank r's
at row ``r * rows``, the padding past the weight's last row (the graph slices it off after
the wait, as before). A refused weight is padded and gathered by the collective.

    magi::ce_gather_rows(Tensor shard, Tensor ids, int group_size, str group_name) -> Tensor

``embedding(full table, ids)`` without the full table (NOTE [row gathers] in
passes/rows.py): a fresh ``[*ids.shape, *shard.shape[1:]]`` tensor, each row read from the
rank that owns it. Synchronous on the current stream (no c10d work, no wait_tensor): on
CUDA a small SM kernel reads the peers' windows (``rows_kernel`` in csrc/ce_rows.cu), on
CPU the host transport's views. A shard whose binding was refused by agreement is gathered
in full by the collective and looked up, on every rank.

    magi::ce_row_positions(Tensor ids) -> Tensor

``arange(ids.numel()).view(ids.shape)`` (int64), as a buffer: the graph's lookup reads the
row gather's output through it, ``embedding(rows.view(-1, dim), positions)``, so Inductor
fuses the lookup as it fuses ``embedding(table, ids)`` in the plain graph (NOTE [row
gathers fuse as lookups] in passes/rows.py).

    magi::ce_bind(Tensor(a!)[] shards, int[] group_sizes, str[] group_names, str[] names,
                  str[] reasons, int[] rows=[]) -> ()

The bind step the compiler inserts at the head of a graph (NOTE [run-time bind] in
runtime/bind_step.py). Declared as mutating its shards so Inductor keeps every read of them
after it; it moves them into windows on its first run and costs one dict lookup after.
``rows`` (given when some weight is an uneven Shard(0)): each shard's padded slot rows, 0
for an even one.

    magi::ce_stage(Tensor(a!)[] params, str[] dtypes, int[] group_sizes, str[] group_names,
                   str[] names, str[] reasons, bool refresh, int[] rows=[],
                   bool static=False) -> ()
    magi::ce_staged(Tensor[] params, str[] dtypes, str[] group_names, bool static=False) -> Tensor[]

The stage step the compiler inserts at the head of a training graph (NOTE [training:
staged windows and step fences] in runtime/staging.py). ``ce_stage`` binds a staging slot
per weight and dtype on its first run; with ``refresh`` (a forward) it then fences, copies
each weight (cast) into its slot and fences again on every run. It is declared as mutating
its weights (it writes none) so that Inductor keeps it even when this rank refused every
weight (the rank must still take part in the bind round its peers wait in) and orders
``ce_staged`` after it. ``ce_staged`` returns the slots of the weights the compile side
found eligible (the gathers' inputs); a slot refused at run time comes back as a plain
cast that the gather hands to the collective. ``rows``: padded slots (uneven Shard(0));
``static``: an inference graph's cast slots, made once and never refreshed (NOTE [cast
slots] in runtime/staging.py).

    magi::ce_reduce_scatter(Tensor input, str reduce_op, int group_size, str group_name,
                            str name="") -> Tensor
    magi::ce_reduce_scatter_coalesced(Tensor[] inputs, str reduce_op, int group_size,
                                      str group_name, str name="") -> Tensor[]

A gradient reduce-scatter without a collective (NOTE [copy-engine reduce-scatter] in
runtime/reduce_scatter/__init__.py): the arguments of ``_c10d_functional.reduce_scatter_tensor[
_coalesced]`` (``reduce_op`` "sum" or "avg", fp32 or bf16 inputs whose dim 0 splits in
``group_size`` chunks) and the bucket's ``name`` for errors. Output: a fresh
``[rows / group_size, ...]`` tensor per input, this rank's chunk summed over the group in
group index order. Nothing to bind first: the receive workspaces are the run time's. On
the host transport the op completes before it returns (``wait_tensor`` is a no-op).

    magi::ce_prefetch(Tensor(a!)[] shards, int group_size, str group_name) -> ()

Gathers the next call's first weights at the end of this one and parks the outputs for
the next gathers of ``shards`` (NOTE [cross-call prefetch] in runtime/prefetch.py). Declared as
mutating its shards only so Inductor keeps it (it has no output); it writes nothing.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .runtime import native, prefetch
from .runtime import reduce_scatter as RS
from .runtime import windows as W
from .runtime.gather import gather_rows, gather_slot_dim, gather_slots
from .runtime.versions import check as check_versions
from .runtime.window_pools import on_release

_FUNCTIONAL = torch.ops._c10d_functional


def _collective_gather(shard: torch.Tensor, group_size: int, group_name: str,
                       wait: bool = False) -> torch.Tensor:
    """A refused shard's gather by the group's collective backend, in program order.

    # NOTE [gloo: one functional collective in flight]
    Two or more ``_c10d_functional`` collectives in flight at once on a gloo group corrupt
    the heap on torch 2.13's CPU wheel ("malloc(): unaligned tcache chunk detected", or a
    segfault, within a minute on 2 loaded cores; one at a time, and the same pattern
    through ``dist.all_gather_into_tensor(async_op=True)``, never crashed:
    bench/compare/gloo_inflight.py). So on CPU a fallback gather is waited here (its
    graph's ``wait_tensor`` is then a no-op), and the reorder leaves graphs with collectives
    on gloo in Inductor's order (passes/reorder.py). On CUDA (NCCL) nothing changes.
    ``wait``: the caller consumes the result at once (a row gather's lookup)."""
    out = _FUNCTIONAL.all_gather_into_tensor(shard.contiguous(), group_size, group_name)
    if wait or out.device.type == "cpu":
        out = _FUNCTIONAL.wait_tensor(out)
    return out


def _unbound_error(t: torch.Tensor, group_name: str, op: str = "ce_all_gather") -> RuntimeError:
    return RuntimeError(
        f"torch_ce: magi::{op} got a tensor that is not bound to a symmetric window "
        f"(shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}, data_ptr {t.data_ptr():#x}, "
        f"group {group_name!r}). Bind the weight shards first with "
        "torch_ce.bind(module_or_params, group=...), or compile with "
        "torch_ce.enable(transport='copy_engine') and let the bind step do it."
    )


def _check_group(slot: W.Slot, group_size: int, group_name: str) -> None:
    w = slot.window
    if group_size != w.group_size:
        raise RuntimeError(
            f"torch_ce: group_size {group_size} does not match the window's group of "
            f"{w.group_size} ranks {list(w.group_ranks)} for shard {slot.name or tuple(slot.shape)}"
        )
    if group_name != w.group.group_name:
        import torch.distributed as dist

        pg = torch._C._distributed_c10d._resolve_process_group(group_name)
        if tuple(dist.get_process_group_ranks(pg)) != w.group_ranks:
            raise RuntimeError(
                f"torch_ce: group {group_name!r} is not the group the shard was bound to "
                f"(ranks {list(w.group_ranks)})"
            )


def _check_live(group_name: str) -> None:
    """A destroyed (or never created) group raises here, before any read or collective."""
    try:
        torch._C._distributed_c10d._resolve_process_group(group_name)
    except RuntimeError as e:
        raise RuntimeError(
            f"torch_ce: magi::ce_all_gather got group {group_name!r}, which is not a live "
            "process group on this rank (destroyed, or never created). Gather before "
            "destroying the group, and call torch_ce.release_all() when tearing down."
        ) from e


def gather(shards: Sequence[torch.Tensor], group_size: int, group_name: str) -> list[torch.Tensor]:
    """Gather a bucket: bound members by one-sided reads (one submission), the rest by
    the collective backend in program order (identical on every rank)."""
    if group_size == 1:  # nothing to gather, unless the shard belongs to a larger group
        for s in shards:
            entry = W.lookup(s)
            if isinstance(entry, W.Slot):
                _check_group(entry, group_size, group_name)
        return [s.clone() for s in shards]
    _check_live(group_name)
    outs: list[torch.Tensor | None] = [None] * len(shards)
    entries = [W.lookup(s) for s in shards]
    for s, entry in zip(shards, entries):
        if isinstance(entry, W.Slot):
            check_versions(entry)  # NOTE [the version net]: before any parked value is used
    if prefetch.any_parked():  # NOTE [cross-call prefetch]
        for i, o in prefetch.take(shards, group_name).items():
            outs[i] = o
    bound_idx, slots = [], []
    for i, (s, entry) in enumerate(zip(shards, entries)):
        if outs[i] is not None:
            continue
        if isinstance(entry, W.Slot):
            _check_group(entry, group_size, group_name)
            bound_idx.append(i)
            slots.append(entry)
        elif isinstance(entry, W.Fallback):
            outs[i] = _collective_gather(s, group_size, group_name)
        else:
            raise _unbound_error(s, group_name)
    if slots:
        bouts = gather_slots([shards[i] for i in bound_idx], slots, group_size)
        for i, o in zip(bound_idx, bouts):
            outs[i] = o
    return outs  # type: ignore[return-value]


def ce_all_gather(shard: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return gather([shard], group_size, group_name)[0]


def ce_all_gather_coalesced(
    shards: list[torch.Tensor], group_size: int, group_name: str
) -> list[torch.Tensor]:
    return gather(shards, group_size, group_name)


def ce_all_gather_dim(shard: torch.Tensor, group_size: int, group_name: str, gather_dim: int) -> torch.Tensor:
    """A bound Shard(``gather_dim``) shard gathered by strided one-sided reads into the
    weight's final layout; refused by agreement (the same on every rank): the collective
    gather, waited, re-split. An unbound shard raises, as in ``gather``."""
    if not 0 <= gather_dim < shard.dim():
        raise RuntimeError(f"torch_ce: magi::ce_all_gather_dim: gather_dim {gather_dim} outside "
                           f"a {shard.dim()}-d shard")
    if group_size == 1:
        entry = W.lookup(shard)
        if isinstance(entry, W.Slot):
            _check_group(entry, group_size, group_name)
        return shard.clone()
    _check_live(group_name)
    entry = W.lookup(shard)
    if isinstance(entry, W.Slot):
        _check_group(entry, group_size, group_name)
        check_versions(entry)
        return gather_slot_dim(shard, entry, group_size, gather_dim)
    if isinstance(entry, W.Fallback):
        full = _collective_gather(shard, group_size, group_name, wait=True)
        return torch.cat(full.split(shard.shape[0]), gather_dim)
    raise _unbound_error(shard, group_name, "ce_all_gather_dim")


def ce_all_gather_padded(shard: torch.Tensor, rows: int, group_size: int, group_name: str) -> torch.Tensor:
    """``gather`` of the ``rows``-row padded slot that ``shard`` views the first rows of;
    a refused shard zero-padded to ``rows`` and gathered by the collective."""
    if group_size > 1:
        _check_live(group_name)
    hit = W.padded(shard)
    if isinstance(hit, tuple):
        slot, full = hit
        if slot.shape[0] != rows:
            raise RuntimeError(
                f"torch_ce: magi::ce_all_gather_padded of {rows} rows got a shard bound into a "
                f"slot of {slot.shape[0]} rows ({slot.name})")
        return gather([full], group_size, group_name)[0]
    if isinstance(hit, W.Fallback) or group_size == 1:
        pad = [0, 0] * (shard.dim() - 1) + [0, rows - shard.shape[0]]
        padded = torch.constant_pad_nd(shard, pad, 0.0)
        if group_size == 1:
            return padded.clone()
        return _collective_gather(padded, group_size, group_name)
    raise _unbound_error(shard, group_name, "ce_all_gather_padded")


def ce_gather_rows(shard: torch.Tensor, ids: torch.Tensor, group_size: int, group_name: str,
                   padded_rows: int = 0, rows: int = 0) -> torch.Tensor:
    """Rows ``ids`` of the gathered table: read from their owners if ``shard`` is bound,
    else (refused by agreement: identically on every rank) the full collective gather and
    ``embedding``. An unbound shard raises, as in ``gather``. ``padded_rows``: an uneven
    table's padded slot (NOTE [uneven Shard(0): padded slots]) of a ``rows``-row table."""
    if padded_rows:
        return _gather_rows_padded(shard, ids, group_size, group_name, padded_rows, rows)
    if group_size == 1:
        entry = W.lookup(shard)
        if isinstance(entry, W.Slot):
            _check_group(entry, group_size, group_name)
        return torch.embedding(shard, ids)
    _check_live(group_name)
    entry = W.lookup(shard)
    if isinstance(entry, W.Slot):
        _check_group(entry, group_size, group_name)
        check_versions(entry)
        return gather_rows(shard, entry, ids)
    if isinstance(entry, W.Fallback):
        return torch.embedding(_collective_gather(shard, group_size, group_name, wait=True), ids)
    raise _unbound_error(shard, group_name, "ce_gather_rows")


def ce_row_positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.numel(), device=ids.device).view(ids.shape)


def _gather_rows_padded(shard, ids, group_size, group_name, padded_rows, rows):
    """Row r of an uneven table is on rank ``r // padded_rows`` (torch.chunk's layout):
    the even row gather of the padded slots, with the table's own bounds."""
    flat = ids.reshape(-1)
    if ids.is_cuda:
        torch._assert_async(((flat >= 0) & (flat < rows)).all(),
                            "torch_ce: ce_gather_rows: index out of range")
    elif flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
        raise IndexError("index out of range in self")
    if group_size > 1:
        _check_live(group_name)
    hit = W.padded(shard)
    if isinstance(hit, tuple):
        slot, full = hit
        _check_group(slot, group_size, group_name)
        check_versions(slot)
        return gather_rows(full, slot, ids)
    if isinstance(hit, W.Fallback) or group_size == 1:
        table = ce_all_gather_padded(shard, padded_rows, group_size, group_name)
        if table.device.type != "cpu" and group_size > 1:
            table = _FUNCTIONAL.wait_tensor(table)
        return torch.embedding(table[:rows], ids)
    raise _unbound_error(shard, group_name, "ce_gather_rows")


def ce_stage(params, dtypes, group_sizes, group_names, names, reasons, refresh, rows=(),
             static=False) -> None:
    from .runtime.staging import run_stage_step

    run_stage_step(params, dtypes, group_sizes, group_names, names, reasons, refresh, rows, static)


def ce_staged(params, dtypes, group_names, static=False) -> list[torch.Tensor]:
    from .runtime.staging import staged_slots

    return staged_slots(params, dtypes, group_names, static)


def ce_prefetch(shards: list[torch.Tensor], group_size: int, group_name: str) -> None:
    prefetch.prefetch(shards, group_size, group_name)


def ce_reduce_scatter(input: torch.Tensor, reduce_op: str, group_size: int, group_name: str,
                      name: str = "") -> torch.Tensor:
    return RS.reduce_scatter([input], reduce_op, group_size, group_name, name)[0]


def ce_reduce_scatter_coalesced(inputs: list[torch.Tensor], reduce_op: str, group_size: int,
                                group_name: str, name: str = "") -> list[torch.Tensor]:
    return RS.reduce_scatter(inputs, reduce_op, group_size, group_name, name)


def ce_bind(shards, group_sizes, group_names, names, reasons, rows=()) -> None:
    from .runtime.bind_step import run_bind_step

    run_bind_step(shards, group_sizes, group_names, names, reasons, rows)


# Defined with torch.library.Library rather than custom_op: the dispatcher then calls the
# Python kernel directly (~3 us per call instead of ~12 us), which matters on the hot path.
_lib = torch.library.Library("magi", "DEF")
_lib.define("ce_all_gather(Tensor shard, int group_size, str group_name) -> Tensor")
_lib.define("ce_all_gather_coalesced(Tensor[] shards, int group_size, str group_name) -> Tensor[]")
_lib.define(
    "ce_bind(Tensor(a!)[] shards, int[] group_sizes, str[] group_names, str[] names, "
    "str[] reasons, int[] rows=[]) -> ()"
)
_lib.define("ce_prefetch(Tensor(a!)[] shards, int group_size, str group_name) -> ()")
_lib.define(
    "ce_stage(Tensor(a!)[] params, str[] dtypes, int[] group_sizes, str[] group_names, str[] names, "
    "str[] reasons, bool refresh, int[] rows=[], bool static=False) -> ()"
)
_lib.define("ce_all_gather_dim(Tensor shard, int group_size, str group_name, int gather_dim) -> Tensor")
_lib.define("ce_staged(Tensor[] params, str[] dtypes, str[] group_names, bool static=False) -> Tensor[]")
_lib.define("ce_gather_rows(Tensor shard, Tensor ids, int group_size, str group_name, "
            "int padded_rows=0, int rows=0) -> Tensor")
_lib.define("ce_row_positions(Tensor ids) -> Tensor")
_lib.define("ce_all_gather_padded(Tensor shard, int rows, int group_size, str group_name) -> Tensor")
_lib.define("ce_reduce_scatter(Tensor input, str reduce_op, int group_size, str group_name, "
            "str name=\"\") -> Tensor")
_lib.define("ce_reduce_scatter_coalesced(Tensor[] inputs, str reduce_op, int group_size, "
            "str group_name, str name=\"\") -> Tensor[]")
# The Python kernel under its own name: the C++ kernels hand it every bucket they do not
# serve (NOTE [native gather path] in csrc/ce_gather.cu). Never traced, so no fake impl.
_private = torch.library.Library("torch_ce", "DEF")
_private.define("gather_python(Tensor[] shards, int group_size, str group_name) -> Tensor[]")
_private.define("gather_dim_python(Tensor shard, int group_size, str group_name, int gather_dim) -> Tensor")
# The native reduce-scatter's reduction without the CUDA kernel (a library built without
# nvcc: NOTE [native reduce-scatter path] in csrc/ce_reduce_scatter.cu calls it).
_private.define("rs_reduce_fallback(Tensor[] owns, Tensor(a!)[] outs, Tensor recv_half, int index, int[] offs, "
                "int op, float factor) -> ()")

_native = native.load()
on_release(native.clear)
on_release(RS.release)
for _key in ("CPU", "CUDA"):
    _private.impl("gather_python", gather, _key)
    _private.impl("rs_reduce_fallback", RS.reduce_fallback, _key)
    _private.impl("gather_dim_python", ce_all_gather_dim, _key)
    _lib.impl("ce_bind", ce_bind, _key)
    _lib.impl("ce_prefetch", ce_prefetch, _key)
    _lib.impl("ce_stage", ce_stage, _key)
    _lib.impl("ce_staged", ce_staged, _key)
    _lib.impl("ce_gather_rows", ce_gather_rows, _key)  # one per forward: Python is fine
    _lib.impl("ce_row_positions", ce_row_positions, _key)
    # Python on CUDA too: it hands the padded slot's full view to the C++ gather.
    _lib.impl("ce_all_gather_padded", ce_all_gather_padded, _key)
    _lib.impl("ce_reduce_scatter", ce_reduce_scatter, _key)
    _lib.impl("ce_reduce_scatter_coalesced", ce_reduce_scatter_coalesced, _key)
    if _key == "CUDA" and _native:
        continue  # the C++ kernels are registered for CUDA by the library itself
    _lib.impl("ce_all_gather", ce_all_gather, _key)
    _lib.impl("ce_all_gather_coalesced", ce_all_gather_coalesced, _key)
    _lib.impl("ce_all_gather_dim", ce_all_gather_dim, _key)


from . import fake_impls  # noqa: E402,F401  (registers the fake impls beside the ops)
