"""Fake (meta) impls of the magi ops: shapes only, no data, no binding, no process group.

Because the ops take ``(tensor, group_size, group_name)`` like the functional collectives,
tracing needs no live group.
"""
from __future__ import annotations

import torch


@torch.library.register_fake("magi::ce_all_gather")
def _ce_all_gather_fake(shard: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return shard.new_empty((group_size * shard.shape[0], *shard.shape[1:]))


@torch.library.register_fake("magi::ce_all_gather_coalesced")
def _ce_all_gather_coalesced_fake(shards, group_size: int, group_name: str):
    return [s.new_empty((group_size * s.shape[0], *s.shape[1:])) for s in shards]


@torch.library.register_fake("magi::ce_all_gather_dim")
def _ce_all_gather_dim_fake(shard: torch.Tensor, group_size: int, group_name: str, gather_dim: int):
    full = list(shard.shape)
    full[gather_dim] *= group_size
    return shard.new_empty(full)


@torch.library.register_fake("magi::ce_all_gather_padded")
def _ce_all_gather_padded_fake(shard: torch.Tensor, rows: int, group_size: int, group_name: str):
    # The same shape on every rank, whatever this rank's shard holds (uneven Shard(0)).
    return shard.new_empty((group_size * rows, *shard.shape[1:]))


@torch.library.register_fake("magi::ce_bind")
def _ce_bind_fake(shards, group_sizes, group_names, names, reasons, rows=()) -> None:
    return None


@torch.library.register_fake("magi::ce_prefetch")
def _ce_prefetch_fake(shards, group_size: int, group_name: str) -> None:
    return None


@torch.library.register_fake("magi::ce_gather_rows")
def _ce_gather_rows_fake(shard: torch.Tensor, ids: torch.Tensor, group_size: int, group_name: str,
                         padded_rows: int = 0, rows: int = 0):
    return shard.new_empty((*ids.shape, *shard.shape[1:]))


@torch.library.register_fake("magi::ce_row_positions")
def _ce_row_positions_fake(ids: torch.Tensor):
    return ids.new_empty(ids.shape, dtype=torch.int64)


@torch.library.register_fake("magi::ce_stage")
def _ce_stage_fake(params, dtypes, group_sizes, group_names, names, reasons, refresh, rows=(),
                   static=False) -> None:
    return None


@torch.library.register_fake("magi::ce_staged")
def _ce_staged_fake(params, dtypes, group_names, static=False):
    return [p.new_empty(p.shape, dtype=getattr(torch, d)) for p, d in zip(params, dtypes)]


@torch.library.register_fake("magi::ce_reduce_scatter")
def _ce_reduce_scatter_fake(input: torch.Tensor, reduce_op: str, group_size: int, group_name: str,
                            name: str = ""):
    return input.new_empty((input.shape[0] // group_size, *input.shape[1:]))


@torch.library.register_fake("magi::ce_reduce_scatter_coalesced")
def _ce_reduce_scatter_coalesced_fake(inputs, reduce_op: str, group_size: int, group_name: str,
                                      name: str = ""):
    return [x.new_empty((x.shape[0] // group_size, *x.shape[1:])) for x in inputs]
