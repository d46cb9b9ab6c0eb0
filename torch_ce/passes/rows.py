"""Rows: a weight read only by embedding lookups gathers just the rows its ids name.

Post-grad graph (torch 2.13) of ``F.embedding(ids, w)`` / ``nn.Embedding`` on a
SimpleFSDP weight, after ``rewrite``::

    %ag : magi.ce_all_gather(%w, 2, '0')
    %wt : _c10d_functional.wait_tensor(%ag)
    %embedding : aten.embedding.default(%wt, %ids[, padding_idx, scale_grad_by_freq, sparse])

After::

    %ce_gather_rows_default : magi.ce_gather_rows(%w, %ids, 2, '0')

# NOTE [row gathers]
A forward that looks up a few thousand tokens gathered the whole embedding table first
(Llama3-8B: 1 GiB gathered, 501 MiB read from the peer per rank) before any compute could
start. ``magi.ce_gather_rows`` reads only the rows ``ids`` names from the ranks that own
them (row r lives on rank ``r // rows_per_rank`` at local row ``r % rows_per_rank``),
into the lookup's own ``[*ids.shape, dim]`` output. It runs on the current stream and
needs no wait (ops.py), so the reorder counts it as compute (inductor_lowering.py).

Decided per weight, not per gather: every eligible gather of the weight must feed only
embedding lookups (the gathered tensor as their weight) or nothing. torchtitan's
``Embedding.forward`` reads its parametrized weight twice (``isinstance(self.weight,
DTensor)``, then ``self.weight``): two gathers, the first one never read, which the gate
drops on every rank before this pass (NOTE [unread gathers] in gate.py). The lookups
become row gathers and the weight's gathers are dropped: a CE gather is a one-sided read, so
dropping it on every rank (the decision is the graph's, the same on every rank) leaves no
peer waiting, also when the bind falls back to the collective (the op gathers in full
then, on every rank). A weight any other node reads (a tied LM head; an output) keeps all
its gathers full: the table is gathered in this forward anyway. ``max_norm`` shows as
``aten.embedding_renorm`` between the gather and the lookup (it renormalizes the gathered
rows in place): refused as well. ``padding_idx``, ``scale_grad_by_freq`` and ``sparse``
change only the backward (aten's embedding forward is an ``index_select``) and row gathers
are made only in inference graphs (a training graph's gathers read staging slots, so its
embeddings are gathered in full: manager.py), so lookups with them are row gathers too.

An uneven table (NOTE [uneven Shard(0): padded slots] in runtime/windows.py) is looked up
through the row slice after its padded gather; row r then lives on rank ``r // R`` for
the padded row count R, the same rule, so the op gets R and the table's rows (for the
bounds check) and the slice goes with the gather. A table gathered from a cast slot keeps
its full gathers ("gathered from a cast slot").
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..runtime.eligibility import Reason, Refusal
from . import fx_utils as U
from .gate import Seed

aten = torch.ops.aten

_IDS_DTYPES = (torch.int64, torch.int32)
_OTHER_READ = Refusal(Reason.ROWS_OTHER_READ,
                      "full gather: the gathered weight is also read by something other than an "
                      "embedding lookup (e.g. a tied LM head)")
_MAX_NORM = Refusal(Reason.ROWS_MAX_NORM,
                    "full gather: embedding max_norm renormalizes the gathered weight in place")
_CAST = Refusal(Reason.ROWS_CAST, "full gather: the table is gathered from a cast slot")


@dataclasses.dataclass
class RowWeight:
    """A weight whose gathered table embedding lookups read, and the verdict."""

    weight: fx.Node  # the shard placeholder
    seeds: list[Seed]  # its eligible gathers
    # (embedding node, its ids, the gather it reads); the ids are kept apart because the
    # rewrite erases the embedding node (and its args with it).
    lookups: list[tuple[fx.Node, fx.Node, Seed]] = dataclasses.field(default_factory=list)
    reason: Refusal | None = None  # None: every lookup becomes a row gather

    @property
    def row_bytes(self) -> int:
        val = self.weight.meta["val"]
        n = 1
        for d in val.shape[1:]:  # not val[0]: an uneven table's shard may have no rows
            n *= int(d)
        return n * val.element_size()

    @property
    def rows(self) -> int | None:
        """Rows looked up per forward (the ids' numel, summed); None if one is dynamic."""
        total = 0
        for _, ids, _ in self.lookups:
            n = U.numel(ids.meta.get("val"))
            if n is None:
                return None
            total += n
        return total

    def account(self) -> dict:
        """What explain() shows for this weight (report.GraphRecord.bound[...]["rows"])."""
        rows = self.rows
        return dict(lookups=len(self.lookups), rows=rows, row_bytes=self.row_bytes,
                    bytes_per_forward=None if rows is None else rows * self.row_bytes,
                    reason=str(self.reason) if self.reason else "",
                    code=int(self.reason.code) if self.reason else 0)


def _is_lookup(u: fx.Node, wait: fx.Node) -> bool:
    if u.op != "call_function" or u.target is not aten.embedding.default:
        return False
    ids = u.args[1].meta.get("val") if isinstance(u.args[1], fx.Node) else None
    return (u.args[0] is wait and wait not in u.args[1:] and ids is not None
            and ids.dtype in _IDS_DTYPES)


def find(seeds: list[Seed]) -> list[RowWeight]:
    """Every weight with an embedding read of an eligible gather, with its verdict."""
    by_weight: dict[fx.Node, RowWeight] = {}
    for s in seeds:
        if s.eligible:  # eligible: the gather input is the placeholder, with one wait
            key = s.weight if s.weight is not None else s.shard
            by_weight.setdefault(key, RowWeight(key, [])).seeds.append(s)
    out = []
    for rw in by_weight.values():
        # Decided from graph facts every rank shares (the cast is on every rank), so every
        # rank keeps the same full gathers.
        if any(s.cast_slot for s in rw.seeds):
            if any(u.op == "call_function" and u.target is aten.embedding.default
                   for s in rw.seeds for u in _readers(s.wait)):
                rw.reason = _CAST
                out.append(rw)
            continue
        renorm = False
        for s in rw.seeds:
            # An uneven table (NOTE [uneven Shard(0): padded slots]): every reader of the
            # wait is a row slice (gate.uneven_rows), and the lookups read the slice.
            tables = list(s.wait.users) if s.padded_rows else [s.wait]
            for u in [u for t in tables for u in t.users]:
                if _is_lookup(u, u.args[0] if u.args and u.args[0] in tables else s.wait):
                    rw.lookups.append((u, u.args[1], s))
                elif u.op == "call_function" and u.target is aten.embedding_renorm.default:
                    renorm = True
                elif rw.reason is None:
                    rw.reason = _OTHER_READ
        if renorm:
            rw.reason = _MAX_NORM
        if rw.lookups or renorm:
            out.append(rw)
    return out


def _slice_end(sl: fx.Node) -> int:
    """Rows an uneven table's row slice keeps (the table's rows)."""
    return int(sl.meta["val"].shape[0])


def _readers(wait: fx.Node) -> list[fx.Node]:
    """The wait's users, and the users of its row slices (an uneven table's lookups)."""
    out = []
    for u in wait.users:
        out.append(u)
        if u.op == "call_function" and u.target in (aten.slice.Tensor, aten.narrow.default):
            out.extend(u.users)
    return out


def rewrite(graph: fx.Graph, weights: list[RowWeight]) -> set[int]:
    """Lookups -> ``magi.ce_gather_rows``; the weight's gathers go. Returns the ids of the
    seeds removed (they take no part in bucketing)."""
    gone: set[int] = set()
    for rw in weights:
        if rw.reason is not None:
            continue
        for lookup, ids, s in rw.lookups:
            # An uneven table: the padded slot's rows and the table's (the slice's end,
            # for the bounds check): row r is on rank r // padded rows, as in the gather.
            extra = (s.padded_rows, _slice_end(lookup.args[0])) if s.padded_rows else ()
            with graph.inserting_before(lookup):
                rows = graph.call_function(U.magi.ce_gather_rows.default,
                                           (rw.weight, ids, s.group_size, s.group_name, *extra))
            rows.meta["val"] = lookup.meta.get("val")
            lookup.replace_all_uses_with(rows)
            graph.erase_node(lookup)
        for s in rw.seeds:
            for sl in list(s.wait.users):  # an uneven table's row slices, now unread
                if not sl.users:
                    graph.erase_node(sl)
            graph.erase_node(s.wait)
            graph.erase_node(s.gather)
            gone.add(id(s))
    return gone
