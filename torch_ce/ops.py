"""The ``magi`` ops: copy-engine all-gathers of bound shards, and the bind step.

Signatures mirror ``_c10d_functional.all_gather_into_tensor[_coalesced]`` so a graph node
can be retargeted without rebuilding its args:

    magi::ce_all_gather(Tensor shard, int group_size, str group_name) -> Tensor
    magi::ce_all_gather_coalesced(Tensor[] shards, int group_size, str group_name) -> Tensor[]

Output: a fresh tensor of ``group_size * shard.shape[0]`` rows, rank r's shard at row
``r * rows``. The shard must have been bound (``torch_ce.bind`` or the compiled bind step);
a shard whose binding was refused by agreement is gathered by the group's collective
backend instead (NOTE [agreement before anything moves] in binding.py). On CUDA the
outputs carry c10d work: ``_c10d_functional.wait_tensor`` orders the consumer after the
copies. The host transport (CPU) completes before returning.

    magi::ce_bind(Tensor(a!)[] shards, int[] group_sizes, str[] group_names, str[] names,
                  str[] reasons) -> ()

The bind step the compiler inserts at the head of a graph (NOTE [run-time bind] in
passes/bind_step.py). Declared as mutating its shards so Inductor keeps every read of them
after it; it moves them into windows on its first run and costs one dict lookup after.

    magi::ce_all_gather.peers(Tensor shard, int group_size, str group_name) -> Tensor
    magi::ce_all_gather_coalesced.peers(Tensor[] shards, int group_size, str group_name) -> Tensor[]
    magi::ce_linear(Tensor input, Tensor shard, Tensor peer_rows, int group_size,
                    str group_name) -> Tensor

The ``peers`` gathers read only the other ranks' rows: ``(group_size - 1) * rows`` rows,
rank order, this rank's left out. ``ce_linear`` is ``input @ weight.T`` for the gathered
weight given as this rank's shard plus those peer rows: this rank's columns of the output
are computed straight from the shard (NOTE [own rows in place] in passes/own_rows.py).

    magi::ce_prefetch(Tensor(a!)[] shards, int group_size, str group_name) -> ()

Gathers the next call's first weights at the end of this one and parks the outputs for
the next gathers of ``shards`` (NOTE [cross-call prefetch] in prefetch.py). Declared as
mutating its shards only so Inductor keeps it (it has no output); it writes nothing.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import native, prefetch
from . import windows as W

_FUNCTIONAL = torch.ops._c10d_functional


def _unbound_error(t: torch.Tensor, group_name: str) -> RuntimeError:
    return RuntimeError(
        "torch_ce: magi::ce_all_gather got a tensor that is not bound to a symmetric window "
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


def _out_like(t: torch.Tensor, rows_of: int) -> torch.Tensor:
    return t.new_empty((rows_of * t.shape[0], *t.shape[1:]))


def group_rank(group_name: str) -> int:
    """This process's rank in the group ``group_name``."""
    return torch._C._distributed_c10d._resolve_process_group(group_name).rank()


def drop_own_rows(full: torch.Tensor, rows: int, rank: int) -> torch.Tensor:
    """A full gather's rows minus this rank's block (the ``peers`` layout)."""
    return torch.cat([full[: rank * rows], full[(rank + 1) * rows:]])


def gather(shards: Sequence[torch.Tensor], group_size: int, group_name: str,
           peers_only: bool = False) -> list[torch.Tensor]:
    """Gather a bucket: bound members by one-sided reads (one submission), the rest by
    the collective backend in program order (identical on every rank). ``peers_only``:
    the outputs hold the other ranks' rows only (the ``.peers`` overloads)."""
    if group_size == 1:  # nothing to gather, unless the shard belongs to a larger group
        for s in shards:
            entry = W.lookup(s)
            if isinstance(entry, W.Slot):
                _check_group(entry, group_size, group_name)
        return [s[:0].clone() if peers_only else s.clone() for s in shards]
    _check_live(group_name)
    outs: list[torch.Tensor | None] = [None] * len(shards)
    if prefetch.any_parked() and not peers_only:  # NOTE [cross-call prefetch]
        for i, o in prefetch.take(shards, group_name).items():
            outs[i] = o
    bound_idx, slots = [], []
    for i, s in enumerate(shards):
        if outs[i] is not None:
            continue
        entry = W.lookup(s)
        if isinstance(entry, W.Slot):
            _check_group(entry, group_size, group_name)
            bound_idx.append(i)
            slots.append(entry)
        elif isinstance(entry, W.Fallback):
            outs[i] = _FUNCTIONAL.all_gather_into_tensor(s.contiguous(), group_size, group_name)
            if peers_only:
                full = _FUNCTIONAL.wait_tensor(outs[i])
                outs[i] = drop_own_rows(full, s.shape[0], group_rank(group_name))
        else:
            raise _unbound_error(s, group_name)
    if slots:
        bouts = [_out_like(shards[i], group_size - 1 if peers_only else group_size) for i in bound_idx]
        if bouts[0].device.type == "cuda":
            from . import cuda_transport as tr
        else:
            from . import host_transport as tr
        tr.gather_into(bouts, slots, peers_only)
        for i, o in zip(bound_idx, bouts):
            outs[i] = o
    return outs  # type: ignore[return-value]


def ce_all_gather(shard: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return gather([shard], group_size, group_name)[0]


def ce_all_gather_coalesced(
    shards: list[torch.Tensor], group_size: int, group_name: str
) -> list[torch.Tensor]:
    return gather(shards, group_size, group_name)


def ce_all_gather_peers(shard: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return gather([shard], group_size, group_name, peers_only=True)[0]


def ce_all_gather_coalesced_peers(
    shards: list[torch.Tensor], group_size: int, group_name: str
) -> list[torch.Tensor]:
    return gather(shards, group_size, group_name, peers_only=True)


def linear_split(inp: torch.Tensor, shard: torch.Tensor, peer_rows: torch.Tensor,
                 group_size: int, rank: int) -> torch.Tensor:
    """``inp @ full.T`` where ``full`` is the gathered weight: rank ``rank``'s rows are
    ``shard``, the others' are ``peer_rows`` in rank order. One matmul per contiguous block
    of the output's columns, each written in place (the C++ kernel does the same)."""
    rows = shard.shape[0]
    if inp.dim() != 2 or shard.dim() != 2 or peer_rows.dim() != 2:
        raise RuntimeError(f"torch_ce: magi::ce_linear takes 2-D tensors, got input "
                           f"{tuple(inp.shape)}, shard {tuple(shard.shape)}, peer rows {tuple(peer_rows.shape)}")
    if (peer_rows.shape[0] != (group_size - 1) * rows or peer_rows.shape[1] != shard.shape[1]
            or inp.shape[1] != shard.shape[1] or not 0 <= rank < group_size):
        raise RuntimeError(
            f"torch_ce: magi::ce_linear: input {tuple(inp.shape)}, shard {tuple(shard.shape)} and "
            f"peer rows {tuple(peer_rows.shape)} do not make one weight of {group_size} x {rows} rows "
            f"(rank {rank})")
    out = inp.new_empty((inp.shape[0], group_size * rows))
    before, after = rank * rows, (group_size - 1 - rank) * rows
    if before:
        torch.mm(inp, peer_rows[:before].t(), out=out[:, :before])
    torch.mm(inp, shard.t(), out=out[:, before:before + rows])
    if after:
        torch.mm(inp, peer_rows[before:].t(), out=out[:, before + rows:])
    return out


def ce_linear(inp: torch.Tensor, shard: torch.Tensor, peer_rows: torch.Tensor, group_size: int,
              group_name: str) -> torch.Tensor:
    return linear_split(inp, shard, peer_rows, group_size, group_rank(group_name) if group_size > 1 else 0)


def ce_prefetch(shards: list[torch.Tensor], group_size: int, group_name: str) -> None:
    prefetch.prefetch(shards, group_size, group_name)


def ce_bind(shards, group_sizes, group_names, names, reasons) -> None:
    from .passes.bind_step import run_bind_step

    run_bind_step(shards, group_sizes, group_names, names, reasons)


# Defined with torch.library.Library rather than custom_op: the dispatcher then calls the
# Python kernel directly (~3 us per call instead of ~12 us), which matters on the hot path.
_lib = torch.library.Library("magi", "DEF")
_lib.define("ce_all_gather(Tensor shard, int group_size, str group_name) -> Tensor")
_lib.define("ce_all_gather_coalesced(Tensor[] shards, int group_size, str group_name) -> Tensor[]")
_lib.define(
    "ce_bind(Tensor(a!)[] shards, int[] group_sizes, str[] group_names, str[] names, "
    "str[] reasons) -> ()"
)
_lib.define("ce_prefetch(Tensor(a!)[] shards, int group_size, str group_name) -> ()")
_lib.define("ce_all_gather.peers(Tensor shard, int group_size, str group_name) -> Tensor")
_lib.define("ce_all_gather_coalesced.peers(Tensor[] shards, int group_size, str group_name) -> Tensor[]")
_lib.define("ce_linear(Tensor input, Tensor shard, Tensor peer_rows, int group_size, str group_name) -> Tensor")
# The Python kernel under its own name: the C++ kernels hand it every bucket they do not
# serve (NOTE [native gather path] in csrc/ce_torch.cpp). Never traced, so no fake impl.
_private = torch.library.Library("torch_ce", "DEF")
_private.define("gather_python(Tensor[] shards, int group_size, str group_name, bool peers_only=False) "
                "-> Tensor[]")

_native = native.load()
W.on_release(native.clear)
for _key in ("CPU", "CUDA"):
    _private.impl("gather_python", gather, _key)
    _lib.impl("ce_bind", ce_bind, _key)
    _lib.impl("ce_prefetch", ce_prefetch, _key)
    if _key == "CUDA" and _native:
        continue  # the C++ kernels are registered for CUDA by the library itself
    _lib.impl("ce_all_gather", ce_all_gather, _key)
    _lib.impl("ce_all_gather_coalesced", ce_all_gather_coalesced, _key)
    _lib.impl("ce_all_gather.peers", ce_all_gather_peers, _key)
    _lib.impl("ce_all_gather_coalesced.peers", ce_all_gather_coalesced_peers, _key)
    _lib.impl("ce_linear", ce_linear, _key)


from . import fake_impls  # noqa: E402,F401  (registers the fake impls beside the ops)
