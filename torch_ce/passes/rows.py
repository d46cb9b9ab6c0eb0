"""Rows: a weight read only by embedding lookups gathers just the rows its ids name.

Post-grad graph (torch 2.13) of ``F.embedding(ids, w)`` / ``nn.Embedding`` on a
SimpleFSDP weight, after ``rewrite``::

    %ag : magi.ce_all_gather(%w, 2, '0')
    %wt : _c10d_functional.wait_tensor(%ag)
    %embedding : aten.embedding.default(%wt, %ids[, padding_idx, scale_grad_by_freq, sparse])

After::

    %ce_gather_rows_default : magi.ce_gather_rows(%w, %ids, 2, '0')      [*ids.shape, dim]
    %view : aten.view.default(%ce_gather_rows_default, [N, dim])         N = ids.numel()
    %ce_row_positions_default : magi.ce_row_positions(%ids)              arange(N), ids' shape
    %embedding : aten.embedding.default(%view, %ce_row_positions_default[, padding_idx, ...])

An inference graph that casts the table first (``param_dtype``) gathers its cast slot
(NOTE [cast slots] in runtime/staging.py), and the lookup reads the slot's rows::

    %st : magi.ce_stage([%w], ['bfloat16'], ..., True)      (the bind: the cast, once)
    %sl : magi.ce_staged([%w], ['bfloat16'], ['0'], True)
    %s0 : getitem(%sl, 0)                                     (the bf16 cast slot)
    %ce_gather_rows_default : magi.ce_gather_rows(%s0, %ids, 2, '0')   (and the lookup, as above)

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
bounds check) and the slice goes with the gather.

A table gathered from a cast slot (a ``param_dtype`` inference graph) is looked up in the
slot: the op reads the rows of what the gather read (the cast slot registered as bound,
its padded slot when uneven, or at a run-time refusal the plain cast registered as the
collective's: ops.ce_gather_rows), never the fp32 shard. The slot holds exactly the cast
the plain graph gathers, so the rows are its rows, bit for bit: the lookup of the gathered
cast table reads nothing else. The slot costs what it costs anyway (the bind makes it for
the weight), and no rows are cast per call.

# NOTE [row gathers fuse as lookups]
The row gather's output is not handed to the lookup's users directly: the lookup stays and
reads it, ``embedding(rows.view(N, dim), positions)`` with ``positions`` an int64 buffer
holding ``arange(N)`` in the ids' shape (``magi.ce_row_positions``), the same values as
``embedding(table, ids)``. What it keeps is Inductor's view of the lookup: in the plain
graph the lookup is a pointwise read of two buffers (the ids, and the gathered table
through them) that Inductor inlines into its users, and how many buffers an inlined chain
reads decides where Inductor stores an intermediate (``realize_reads_threshold``: a
residual stream read by two users is stored once its chain reads more than 4 buffers).
With low-precision activations a stored intermediate is rounded to bf16 and an inlined
one is not (Inductor computes in fp32 inside a kernel), so a lookup of one buffer (the
rows alone) moved a store of a HF Llama's residual stream by one layer: outputs 1 bf16 ulp
off the plain compile. Read through its positions the lookup reads two buffers again, at
the same place, and the kernels are the plain graph's (bit-identical outputs: test/
test_hf_models_host.py, bf16 ``param_dtype``). The positions cost an ``arange`` of the
ids per lookup; the rows are read once more (from the op's output, inside the fused
kernel), as the plain graph reads the gathered table's rows.
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


@dataclasses.dataclass
class RowWeight:
    """A weight whose gathered table embedding lookups read, and the verdict."""

    weight: fx.Node  # the shard placeholder
    seeds: list[Seed]  # its eligible gathers
    # (embedding node, its ids, the gather it reads); the ids are kept apart because the
    # rewrite erases the embedding node (and its args with it).
    lookups: list[tuple[fx.Node, fx.Node, Seed]] = dataclasses.field(default_factory=list)
    reason: Refusal | None = None  # None: every lookup becomes a row gather

    def _row_bytes(self, seed: Seed | None) -> int:
        """Bytes of one row as ``seed`` gathers it: in its cast slot's dtype, if it has one."""
        val = self.weight.meta["val"]
        n = 1
        for d in val.shape[1:]:  # not val[0]: an uneven table's shard may have no rows
            n *= int(d)
        if seed is not None and seed.cast_slot and seed.stage_dtype is not None:
            return n * seed.stage_dtype.itemsize
        return n * val.element_size()

    @property
    def row_bytes(self) -> int:
        return self._row_bytes(self.seeds[0] if self.seeds else None)

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
        per = None if rows is None else sum(
            U.numel(ids.meta.get("val")) * self._row_bytes(s) for _, ids, s in self.lookups)
        return dict(lookups=len(self.lookups), rows=rows, row_bytes=self.row_bytes,
                    bytes_per_forward=per,
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
        # A cast-slot gather's lookups read the slot (NOTE [row gathers]): as any other.
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


def rewrite(graph: fx.Graph, weights: list[RowWeight]) -> set[int]:
    """Lookups -> ``magi.ce_gather_rows`` of what their gather reads (after
    ``rewrite.rewrite``: the shard, or its cast slot); the weight's gathers go. Returns the
    ids of the seeds removed (they take no part in bucketing)."""
    gone: set[int] = set()
    for rw in weights:
        if rw.reason is not None:
            continue
        for lookup, ids, s in rw.lookups:
            # An uneven table: the padded slot's rows and the table's (the slice's end,
            # for the bounds check): row r is on rank r // padded rows, as in the gather.
            extra = (s.padded_rows, _slice_end(lookup.args[0])) if s.padded_rows else ()
            with graph.inserting_before(lookup):
                # s.shard: the placeholder, or the cast slot (the staged getitem) that the
                # retargeted gather reads (rewrite.rewrite ran first).
                rows = graph.call_function(U.magi.ce_gather_rows.default,
                                           (s.shard, ids, s.group_size, s.group_name, *extra))
                # NOTE [row gathers fuse as lookups]: the lookup stays, reading the rows.
                n = U.numel(ids.meta.get("val"))
                dims = list(lookup.meta["val"].shape[ids.meta["val"].dim():])
                table = graph.call_function(aten.view.default, (rows, [-1 if n is None else n, *dims]))
                positions = graph.call_function(U.magi.ce_row_positions.default, (ids,))
            val, ids_val = lookup.meta["val"], ids.meta["val"]
            rows.meta["val"] = val
            table.meta["val"] = val.view(-1 if n is None else n, *dims)
            positions.meta["val"] = ids_val.new_empty(ids_val.shape, dtype=torch.int64)
            lookup.args = (table, positions, *lookup.args[2:])
        for s in rw.seeds:
            for sl in list(s.wait.users):  # an uneven table's row slices, now unread
                if not sl.users:
                    graph.erase_node(sl)
            graph.erase_node(s.wait)
            graph.erase_node(s.gather)
            gone.add(id(s))
    return gone
