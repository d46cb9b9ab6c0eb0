"""Gate: which weight all-gathers may move to the copy engine, and why the rest may not.

Decisions use only facts that are identical on every rank (the graph, its meta values, the
AOT metadata, the config), so every rank decides the same and the FX graph cache stays
valid across ranks. A gather is eligible when:

  * the graph is an inference graph, or a training graph with ``config.training`` (NOTE
    [training: staged windows and step fences] in runtime/staging.py);
  * its input is exactly a parameter's local shard: a placeholder, no view; a training
    graph may cast it first (mixed precision: the cast is what its staging slot holds),
    and so may an inference graph with ``config.cast_slots`` (NOTE [cast slots] in
    runtime/staging.py);
  * it is a single Shard(0) gather: its output is used as is (a 2-D placement is gathered
    again), or, for an uneven Shard(0), sliced to the weight's rows after the wait, with
    the short ranks' shards zero-padded before it (``uneven_rows``: NOTE [uneven Shard(0):
    padded slots] in runtime/windows.py); or an even Shard(d), d >= 1, whose re-split the
    rewrite folds into the reads (NOTE [Shard(1) reads]);
  * the shard is contiguous, static-shaped, on a device the transport serves, and at least
    ``symm_min_shard_mib`` large: ``shard_refusal`` (runtime/eligibility.py), the predicate
    the run-time bind applies to the live shard, so the two cannot disagree;
  * the graph does not mutate that weight (other inputs it may: NOTE [mutated inputs are
    refused per weight]).

``serving_refusal`` asks the same questions from facts that are the same on every rank
even when shards are uneven (no local shard shape): the reshard pass tags exactly the
gathers it serves (NOTE [reshard decides alike on every rank] in reshard.py).

# NOTE [inference graphs bind in place, training graphs stage]
An inference graph's weights are bound in place (the parameter views its window) and read
with no step barrier: weights are static. A training graph's weights change every step,
so peers read a staging slot that holds the weight (or its param_dtype cast), refreshed
between two fences at the head of each forward (runtime/staging.py); the optimizer never
writes a window. A gather of an input the graph mutates keeps the collective either way
(NOTE [mutated inputs are refused per weight]); the graph's other gathers do not.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ..config import Config
from ..runtime.eligibility import Reason, Refusal, shard_refusal
from . import fx_utils as U

aten = torch.ops.aten

# Producers that tell why a gather input is not the local shard itself.
_CAST_OPS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}
_PAD_OPS = {aten.constant_pad_nd.default}
_RESPLIT_OPS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_SLICE_OPS = {aten.slice.Tensor, aten.narrow.default}
_COPY_OPS = {aten.clone.default, aten.contiguous.default}


@dataclasses.dataclass
class Seed:
    """One weight all-gather and the gate's verdict on it."""

    gather: fx.Node
    shard: fx.Node  # the gather input
    wait: fx.Node | None
    group_size: int
    group_name: str
    reason: Refusal | None = None  # None: eligible
    # Training graphs: the gather reads a staging slot of this dtype (the weight's own, or
    # the param_dtype cast the graph applied before the gather). None: bound in place.
    stage_dtype: torch.dtype | None = None
    nbytes: int = 0
    # The parameter placeholder the gather input comes from (directly, or through a cast,
    # pad or view): the bind step lists it even when refused, so that every rank agrees
    # over the same candidates (NOTE [agreement before anything moves] in agreement.py).
    weight: fx.Node | None = None
    # NOTE [Shard(1) reads]: the dim the gathered blocks are concatenated along (0: a plain
    # Shard(0) gather); for d >= 1, ``resplit`` is the cat that rebuilds the weight.
    gather_dim: int = 0
    resplit: fx.Node | None = None
    # An uneven Shard(0) gather: the rows every rank's (padded) shard has, read from the
    # gather's output shape (the same on every rank); the short ranks' pad node goes.
    padded_rows: int = 0
    pad: fx.Node | None = None  # this rank's pad before the gather (a short rank), if any
    # An inference graph's cast gather served by a cast slot (never refreshed).
    cast_slot: bool = False
    # NOTE [unread gathers]: nothing reads this weight gather's result; the passes drop it
    # (its reason is ``UNREAD_GATHER``).
    unread: bool = False

    @property
    def eligible(self) -> bool:
        return self.reason is None


def _placeholder_index(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}


def _aot_metadata():
    try:
        from torch._guards import TracingContext

        tc = TracingContext.try_get()
        return tc.fw_metadata if tc is not None else None
    except Exception:
        return None


_TRAINING = Refusal(Reason.TRAINING_GRAPH, "graph needs gradients (training) and config.training is off")


def is_training_graph(graph: fx.Graph, is_inference: bool | None = None) -> bool:
    """Whether the graph needs gradients (a forward or backward of a training step)."""
    if is_inference is not None:
        return not is_inference
    for n in graph.nodes:
        # AOTAutograd names the inputs of training graphs primals_* / tangents_*.
        if n.op == "placeholder" and n.name.startswith(("primals_", "tangents_")):
            return True
    md = _aot_metadata()
    return md is not None and any(getattr(i, "requires_grad", False) for i in md.input_info)


def is_backward_graph(graph: fx.Graph) -> bool:
    return any(n.op == "placeholder" and n.name.startswith("tangents_") for n in graph.nodes)


def graph_reason(graph: fx.Graph, is_inference: bool | None = None,
                 cfg: Config | None = None) -> Refusal | None:
    """Why no gather of this graph may use CE (None: any may)."""
    from ..config import config

    cfg = cfg or config
    if is_training_graph(graph, is_inference) and not cfg.training:
        return _TRAINING
    return None


# ---------------------------------------------------------------------------------------
# Mutated inputs, per weight
# ---------------------------------------------------------------------------------------

# NOTE [mutated inputs are refused per weight]
# A graph may update some of its inputs in place: a buffer (BatchNorm's running stats, an
# MoE layer's train-mode token counts), a KV cache, rarely a weight. Only a *gathered*
# weight that the graph mutates is unsafe on the copy engines: its owner would write it
# while peers read it one-sidedly (in place), or its staging slot would hold the value of
# before the write (training). So the gate refuses exactly the gathers of mutated inputs
# (they stay on the collective, which reads the value at the gather, as the plain run
# does) and serves every other gather; a mutated buffer that is never gathered changes
# nothing. Which inputs a graph mutates is AOTAutograd's metadata (``input_info``), the
# same on every rank; a placeholder maps to its input index by its name (``primals_<k>``
# in training graphs, forward and backward alike; ``arg<k>_1`` in inference graphs) or,
# failing that, by its position (a backward's other placeholders are saved activations,
# not inputs). Inputs are counted as AOTAutograd flattens them (a DTensor parameter is one
# input, its local shard), as ``_is_weight`` counts ``static_input_indices``.
_MUTATED = Refusal(Reason.MUTATING_GRAPH,
                   "the graph mutates this weight in place (it may change under a peer's read)")


def _input_index(ph: fx.Node, pos: int, backward: bool) -> int | None:
    import re

    m = re.fullmatch(r"primals_(\d+)", ph.name)
    if m:
        return int(m.group(1)) - 1
    m = re.fullmatch(r"arg(\d+)_1", ph.name)
    if m:
        return int(m.group(1))
    return None if backward else pos


def mutated_inputs(graph: fx.Graph) -> set[fx.Node]:
    """The placeholders whose input the graph mutates (data or metadata)."""
    md = _aot_metadata()
    if md is None:
        return set()
    idx = {i for i, info in enumerate(md.input_info)
           if getattr(info, "mutates_data", False) or getattr(info, "mutates_metadata", False)}
    if not idx:
        return set()
    backward = is_backward_graph(graph)
    out = set()
    for ph, pos in _placeholder_index(graph).items():
        if ph.name.startswith("tangents_"):
            continue
        k = _input_index(ph, pos, backward)
        if k is None:  # a backward's saved activation: not an input of the step
            continue
        if k in idx:
            out.add(ph)
    return out


def _mutation_reason(weight: fx.Node | None, mutated: set[fx.Node]) -> Refusal | None:
    return _MUTATED if weight is not None and weight in mutated else None


def _is_weight(ph: fx.Node, idx: int) -> bool:
    desc = ph.meta.get("desc")
    if desc is not None and getattr(desc, "attr", None) == "_local_tensor":
        return True
    md = _aot_metadata()
    if md is not None and md.static_input_indices is not None:
        return idx in md.static_input_indices
    return desc is None  # hand-built graphs: trust the caller


# NOTE [unread gathers]
# torchtitan's ``Embedding.forward`` reads its parametrized weight twice
# (``isinstance(self.weight, DTensor)``, then ``self.weight``), so an inference graph gathers
# the table twice and never reads the first result: collectives are not dead-code
# eliminated. Such a gather cannot be judged like a live one: with an uneven Shard(0) only
# the short ranks pad before it, and no slice after its wait tells the others that the
# weight is uneven, so a verdict that asked would differ by rank (one rank's collective
# with nobody to meet it: a hang). Whether a result is read is a fact of the graph, the same
# on every rank: every rank drops the gather (``drop_unread``), whatever its shard. The
# joint graph's reshard pass leaves it untagged (``serving_refusal``), as plain would.


def unread(gather: fx.Node, wait: fx.Node | None) -> bool:
    """Nothing reads the gather's result (NOTE [unread gathers])."""
    return wait is not None and not wait.users and list(gather.users) == [wait]


UNREAD_GATHER = Refusal(Reason.UNREAD, "gather result never read (dropped on every rank)")


def drop_unread(graph: fx.Graph, seeds: list[Seed]) -> None:
    """Erase the unread gathers (``Seed.unread``), their waits, and the pad or cast before
    them when nothing else reads it."""
    for s in seeds:
        if not s.unread:
            continue
        x = s.gather.args[0]
        graph.erase_node(s.wait)
        graph.erase_node(s.gather)
        U.erase_unread_chain(graph, x)


def _chain(x: fx.Node) -> tuple[list[fx.Node], fx.Node]:
    """Walk up single-tensor-input nodes from ``x``: (nodes passed, where it stopped)."""
    seen, cur = [], x
    while cur.op == "call_function" and len(seen) < 8:
        seen.append(cur)
        tensor_args = [a for a in cur.args if isinstance(a, fx.Node)]
        if len(tensor_args) != 1:
            break
        cur = tensor_args[0]
    return seen, cur


_GATHER_OF_GATHER = Refusal(Reason.GATHER_OF_GATHER, "gather of a gathered tensor (multi-dim placement)")


def _input_reason(x: fx.Node, ph_index: dict[fx.Node, int]) -> Refusal:
    """Why a non-placeholder gather input is not a parameter's local shard."""
    seen, cur = _chain(x)
    if any(U.is_wait(n) for n in seen):
        return _GATHER_OF_GATHER
    if cur.op != "placeholder":
        return Refusal(Reason.NOT_A_GRAPH_INPUT, "gather input is not directly a graph input")
    targets = {n.target for n in seen}
    if targets & _CAST_OPS:
        return Refusal(Reason.CAST_BEFORE_GATHER,
                       "cast before gather (store inference weights in the compute dtype)")
    if targets & _PAD_OPS:
        return Refusal(Reason.PAD_BEFORE_GATHER, "pad before gather (uneven Shard(0))")
    if not _is_weight(cur, ph_index[cur]):
        # e.g. an activation: computed from an input that is not a parameter.
        return Refusal(Reason.NOT_A_GRAPH_INPUT,
                       "gather input is not directly a graph input (computed from a non-parameter input)")
    val = cur.meta.get("val")
    if targets & _COPY_OPS and val is not None and not val.is_contiguous():
        # DTensor makes a non-contiguous local shard contiguous before gathering it.
        return Refusal(Reason.NON_CONTIGUOUS,
                       "non-contiguous shard (copied to a contiguous tensor before the gather)")
    return Refusal(Reason.VIEW_OR_COPY,
                   "gather input is a view or copy of a graph input, not the shard itself")


# NOTE [uneven pads are not a rank's fact]
# Before an uneven Shard(0) gather DTensor pads the shards to ``ceil(rows / W)`` rows. Torch
# 2.11-2.14 pad only the short ranks' shards (the others' graphs have no pad node); torch
# 2.15 pads every rank, the long ranks by zero rows (``constant_pad_nd(w, [0, 0, 0, 0])``).
# So neither the pad node nor its amount is the same on every rank: a pad of zero or more
# rows appended to dim 0 is accepted alike, and the verdict is ``uneven_rows``' (the
# gathered shape and the slices after the wait), never "did this rank pad".


def _end_pad(x) -> fx.Node | None:
    """``x`` if it is a zero ``constant_pad_nd`` that appends rows (none or more) to dim 0
    only: what DTensor does to an uneven Shard(0) shard before the gather (NOTE [uneven
    pads are not a rank's fact]), used only here."""
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _PAD_OPS
            and len(x.users) == 1 and isinstance(x.args[0], fx.Node)):
        return None
    pad = list(x.args[1])
    value = x.args[2] if len(x.args) > 2 else x.kwargs.get("value", 0.0)
    val = x.args[0].meta.get("val")
    if val is None or len(pad) != 2 * val.dim() or value != 0:
        return None
    if any(pad[:-1]) or pad[-1] < 0:
        return None
    return x


def uneven_rows(gather: fx.Node, wait: fx.Node | None, group_size: int) -> int:
    """Rows per rank of an uneven Shard(0) gather (0: not one).

    Decided from facts every rank shares: the gather's output has ``group_size * R`` rows
    and every user of its wait slices dim 0 to fewer (the weight's rows, the padding past
    them). The short ranks' pad before the gather is *not* asked: it exists only there, and
    this decision (the reshard pass's too) must be the same on every rank."""
    out = gather.meta.get("val")
    if wait is None or out is None or not wait.users or group_size < 2:
        return 0
    try:
        full = int(out.shape[0])
    except Exception:
        return 0
    if full % group_size:
        return 0
    for u in wait.users:
        if not (u.op == "call_function" and u.target in _SLICE_OPS and _truncates_rows(u, wait)
                and _slice_from_zero(u)):
            return 0
    return full // group_size


def _slice_from_zero(s: fx.Node) -> bool:
    if s.target is aten.narrow.default:
        return s.args[2] == 0
    start = s.args[2] if len(s.args) > 2 else s.kwargs.get("start", 0)
    step = s.args[4] if len(s.args) > 4 else s.kwargs.get("step", 1)
    return start in (0, None) and step in (1, None)


def _truncates_rows(s: fx.Node, wait: fx.Node) -> bool:
    """A dim-0 slice/narrow that drops gathered rows (a full-range slice is a no-op)."""
    dim = s.args[1] if len(s.args) > 1 else s.kwargs.get("dim", 0)
    if dim != 0:
        return False
    out, full = s.meta.get("val"), wait.meta.get("val")
    if out is None or full is None:
        return True
    return out.shape[0] != full.shape[0]


def _output_reason(wait: fx.Node | None, padded: bool = False) -> Refusal | None:
    """Why the gathered tensor is not used as is (a Shard(0) on one mesh dim; ``padded``:
    an uneven one, whose row slices after the wait ``uneven_rows`` accepted)."""
    if wait is None:
        return Refusal(Reason.NO_SINGLE_WAIT, "gather without a single wait_tensor")
    if padded:
        return None
    for u in wait.users:
        if u.op != "call_function":
            continue
        if u.target in _SLICE_OPS and _truncates_rows(u, wait):
            return Refusal(Reason.UNEVEN_SHARD, "uneven Shard(0) (gathered rows are sliced)")
        if u.target in _RESPLIT_OPS:
            return Refusal(Reason.NOT_SHARD0, "not Shard(0) (gathered rows are re-split)")
        if U.is_all_gather(u):
            return _GATHER_OF_GATHER
    return None


# NOTE [Shard(1) reads]
# A weight placed Shard(d), d >= 1 (torchtitan's graph_trainer shards routed experts
# [num_experts, out, in] on dim 1 when efsdp * ep > num_experts) is gathered along dim 0
# and re-split in the post-grad graph (torch 2.13, inference and training forward):
#
#     %ag : all_gather_into_tensor(%w, W, g)          %w: [E, h, D] -> [W*E, h, D]
#     %wt : wait_tensor(%ag)
#     %sp : aten.split.Tensor(%wt, E)                 (dim 0, one block per rank)
#     %b0 : getitem(%sp, 0) ... %b{W-1} : getitem(%sp, W-1)
#     %cat : aten.cat([%b0, ..., %b{W-1}], 1)         [E, W*h, D]
#
# Peer r's block is the slice [:, r*h:(r+1)*h] of the result: ``prod(shape[:d])`` rows of
# ``prod(shape[d:])`` contiguous elements each, a fixed pitch apart. The copy engines can
# write that slice directly (a strided 2-D copy per peer), so the gather and the re-split
# become one ``magi.ce_all_gather_dim(%w, W, g, d)`` whose output is the weight in its
# final layout (passes/rewrite.py ``rewrite_dim``; runtime/gather.py ``copy_peers_dim``;
# the CUDA strided reads in csrc/ce_gather.cu). Only this exact, even pattern qualifies:
# a re-split of uneven size (split_with_sizes), of other blocks, in another order, or with
# any other reader of the blocks stays refused.


def shard_dim_resplit(seed: Seed) -> tuple[int, fx.Node] | None:
    """(d, the cat) if the gathered blocks are only re-split along dim 0 into one block per
    rank and concatenated in rank order along dim d >= 1 (NOTE [Shard(1) reads]); else None."""
    found = resplit_of(seed.wait, seed.shard.meta.get("val"), seed.group_size)
    return None if found is None else (found[0], found[-1])


def resplit_of(wait: fx.Node | None, shard_val, W: int) -> tuple[int, fx.Node, list[fx.Node], fx.Node] | None:
    """(d, split, getitems, cat) of the re-split after a gather's ``wait`` (NOTE [Shard(1)
    reads]), for a shard whose meta value is ``shard_val``; None for anything else. Also
    what the reshard pass tags for recompute with the gather (passes/reshard.py)."""
    if wait is None or len(wait.users) != 1 or shard_val is None or shard_val.dim() < 2:
        return None
    if not all(isinstance(n, int) for n in shard_val.shape):
        return None  # dynamic: comparing sizes would add a guard (refused as dynamic anyway)
    sp = next(iter(wait.users))
    if not (sp.op == "call_function" and sp.target is aten.split.Tensor and sp.args[0] is wait):
        return None
    size = sp.args[1] if len(sp.args) > 1 else sp.kwargs.get("split_size")
    sdim = sp.args[2] if len(sp.args) > 2 else sp.kwargs.get("dim", 0)
    if sdim != 0 or size != shard_val.shape[0]:
        return None
    items: dict[int, fx.Node] = {}
    for u in sp.users:
        if not (u.op == "call_function" and u.target is operator.getitem and len(u.users) == 1):
            return None
        items[u.args[1]] = u
    if sorted(items) != list(range(W)):
        return None
    cat = next(iter(items[0].users))
    if not (cat.op == "call_function" and cat.target is aten.cat.default):
        return None
    blocks = cat.args[0]
    cdim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    cdim = cdim + shard_val.dim() if cdim < 0 else cdim
    if list(blocks) != [items[r] for r in range(W)] or not 1 <= cdim < shard_val.dim():
        return None
    if any(next(iter(items[r].users)) is not cat for r in range(W)):
        return None
    return cdim, sp, [items[r] for r in range(W)], cat


def _stage_cast(x, ph_index) -> fx.Node | None:
    """``x`` if it is a dtype cast of a weight placeholder used only by this gather (a
    mixed-precision ``param_dtype`` cast), else None."""
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _CAST_OPS
            and len(x.users) == 1):
        return None
    src = x.args[0]
    if not (isinstance(src, fx.Node) and src.op == "placeholder" and _is_weight(src, ph_index[src])):
        return None
    if x.target is aten._to_copy.default and set(x.kwargs) - {"dtype"}:
        return None  # a device or layout change too
    return x


def gate(graph: fx.Graph, cfg: Config, is_inference: bool | None = None) -> list[Seed]:
    """Every all_gather_into_tensor of the graph with its verdict, in program order."""
    seeds: list[Seed] = []
    whole = graph_reason(graph, is_inference, cfg)
    training = whole is None and is_training_graph(graph, is_inference)
    cast_slots = whole is None and not training and getattr(cfg, "cast_slots", False)
    ph_index = _placeholder_index(graph)
    mutated = mutated_inputs(graph) if whole is None else set()
    for g in U.find_op_nodes(graph, U.ALL_GATHER):
        x, gs, gname = g.args[0], g.args[1], g.args[2]
        seed = Seed(g, x, U.wait_of(g), int(gs), str(gname))
        # What is gathered (padded to the same rows on every rank when uneven).
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        seed.nbytes = U.nbytes(val) or 0 if val is not None else 0
        seed.padded_rows = uneven_rows(g, seed.wait, seed.group_size)
        inner = x
        if seed.padded_rows:
            seed.pad = _end_pad(x)
            inner = seed.pad.args[0] if seed.pad is not None else x
        cast = _stage_cast(inner, ph_index) if training or cast_slots else None
        src = cast.args[0] if cast is not None else inner
        seed.reason = whole or _seed_reason(seed, src, val, ph_index, cfg)
        if training and val is not None:
            seed.stage_dtype = val.dtype
        elif cast is not None and val is not None:
            seed.stage_dtype, seed.cast_slot = val.dtype, True
        root = _chain(x)[1] if isinstance(x, fx.Node) else None
        if (root is not None and root.op == "placeholder" and _is_weight(root, ph_index[root])
                and not any(U.is_wait(n) for n in _chain(x)[0])):
            seed.weight = root
        # NOTE [mutated inputs are refused per weight]: said first (a mutated weight's
        # gather usually reads the new value, which is not the shard either).
        if whole is None and root is not None and root.op == "placeholder":
            seed.reason = _mutation_reason(root, mutated) or seed.reason
        if whole is None and seed.weight is not None and unread(g, seed.wait):
            # NOTE [unread gathers]: the verdict is the graph's, not this rank's shard.
            seed.unread, seed.reason = True, UNREAD_GATHER
        seeds.append(seed)
    return seeds


def _seed_reason(seed: Seed, x: fx.Node, val, ph_index, cfg: Config) -> Refusal | None:
    """Graph facts first (what only the graph shows), then the shard facts through the
    predicate the run-time bind uses too (runtime/eligibility.py). ``x``: the gather input,
    or the weight a training graph casts before it; ``val``: what is gathered."""
    if x.op != "placeholder":
        return _input_reason(x, ph_index)
    if not _is_weight(x, ph_index[x]):
        return Refusal(Reason.NOT_A_PARAMETER, "gather input is a graph input that is not a parameter")
    dim_cat = shard_dim_resplit(seed)
    if dim_cat is not None:  # NOTE [Shard(1) reads]: the rewrite folds the re-split away
        seed.gather_dim, seed.resplit = dim_cat
    out = None if dim_cat is not None else _output_reason(seed.wait, padded=bool(seed.padded_rows))
    if out:
        return out
    if val is None:
        return Refusal(Reason.NO_SHAPE, "no shape information")
    nbytes = U.nbytes(val)
    static = nbytes is not None
    return shard_refusal(
        device_type=val.device.type,
        nbytes=nbytes,
        numel=int(val.numel()) if static else None,
        dim=val.dim(),
        # A dynamic shape is refused before contiguity is asked (it could add a guard).
        contiguous=bool(val.is_contiguous()) if static else True,
        group_size=seed.group_size,
        cfg=cfg,
    )


# ---------------------------------------------------------------------------------------
# The serving decision from rank-independent facts (the reshard pass asks it)
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class WeightGather:
    """A weight gather and its input chain: parameter placeholder -> optional dtype cast ->
    optional ``constant_pad_nd`` (an uneven Shard(0) pads the short shards, so only some
    ranks' graphs have it) -> all_gather_into_tensor -> wait_tensor."""

    weight: fx.Node
    chain: list[fx.Node]  # the cast and pad between the weight and the gather, in order
    gather: fx.Node
    wait: fx.Node | None

    @property
    def cast(self) -> fx.Node | None:
        return next((n for n in self.chain if n.target in _CAST_OPS), None)


def weight_gather(gather: fx.Node) -> WeightGather | None:
    """The chain of a gather whose input is a graph input, at most cast once and padded
    once (each used only by the next step); None for anything else (an activation, a view,
    a gather of a gather)."""
    chain, x = [], gather.args[0]
    while (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _CAST_OPS | _PAD_OPS
           and len(chain) < 2):
        if len(x.users) != 1:
            return None
        chain.insert(0, x)
        x = x.args[0]
    if not (isinstance(x, fx.Node) and x.op == "placeholder"):
        return None
    if sum(n.target in _PAD_OPS for n in chain) > 1 or sum(n.target in _CAST_OPS for n in chain) > 1:
        return None
    return WeightGather(x, chain, gather, U.wait_of(gather))


def slot_facts(wg: WeightGather) -> tuple[int | None, int | None, int]:
    """(bytes, elements, dims) of one rank's share of the gathered weight, from the gather's
    output (``group size x ceil(rows / group size)`` rows on every rank, padded or not):
    what a window slot holds, the same number on every rank. A local shard's own size is
    not: an uneven Shard(0) gives the last ranks fewer rows, possibly none."""
    out = gather_val = wg.gather.meta.get("val")
    if wg.wait is not None and wg.wait.meta.get("val") is not None:
        out = wg.wait.meta["val"]
    if out is None:
        out = gather_val
    gs = int(wg.gather.args[1])
    total, nb = U.numel(out), U.nbytes(out)
    if total is None or nb is None or gs < 1:
        return None, None, out.dim()
    return nb // gs, total // gs, out.dim()


def serving_refusal(gather: fx.Node, cfg: Config, *, training: bool, ph_index: dict,
                    mutated: set[fx.Node]) -> Refusal | None:
    """Why the copy engines would not serve this gather (None: they would), decided only
    from facts that are the same on every rank: which parameter is gathered, its input
    chain up to an optional pad (whether a pad is there is *not* asked: only the ranks with
    short shards have one), the gathered output's shape and what reads it, the mutated
    inputs and the config. The gate's verdict on an even shard is the same (same helpers,
    same order), and so is its verdict on an uneven Shard(0) (``uneven_rows``) and on an
    inference cast with ``config.cast_slots``: when a rule widens, it widens here first,
    for every rank at once. ``training``: a training graph (the joint graph is one)."""
    wg = weight_gather(gather)
    if wg is None:
        return Refusal(Reason.NOT_A_GRAPH_INPUT,
                       "gather input is not a parameter's shard (cast and padded at most)")
    if unread(wg.gather, wg.wait):  # NOTE [unread gathers]: asked before the pad is
        return UNREAD_GATHER
    if not _is_weight(wg.weight, ph_index[wg.weight]):
        return Refusal(Reason.NOT_A_PARAMETER, "gather input is a graph input that is not a parameter")
    if training and not cfg.training:
        return _TRAINING
    cast = wg.cast
    # A cast is served where the gate stages it: a training graph's slot, or an inference
    # graph's cast slot with ``config.cast_slots`` (NOTE [cast slots] in runtime/staging.py);
    # only a plain dtype cast (``_stage_cast``).
    if cast is not None and not ((training or getattr(cfg, "cast_slots", False))
                                 and not (cast.target is aten._to_copy.default
                                          and set(cast.kwargs) - {"dtype"})):
        return Refusal(Reason.CAST_BEFORE_GATHER,
                       "cast before gather (store inference weights in the compute dtype)")
    gs = int(wg.gather.args[1])
    # An uneven Shard(0): decided from the gathered shape and the slices after the wait
    # (``uneven_rows``, what the gate asks), never from whether this rank pads.
    padded = uneven_rows(wg.gather, wg.wait, gs)
    pad = next((n for n in wg.chain if n.target in _PAD_OPS), None)
    if pad is not None and not (padded and pad is wg.chain[-1] and _end_pad(pad) is not None):
        # Only a short rank has a pad, and DTensor adds one only before an uneven gather,
        # which every rank sees as such: where the gate refuses a pad, it refuses here too.
        return Refusal(Reason.PAD_BEFORE_GATHER, "pad before gather (uneven Shard(0))")
    # A Shard(d >= 1) gather re-split in rank order is served as one strided read (NOTE
    # [Shard(1) reads]); the re-split's shape facts are the gathered blocks', alike on every rank.
    resplit = resplit_of(wg.wait, wg.gather.args[0].meta.get("val"), gs)
    out = None if resplit is not None else _output_reason(wg.wait, padded=bool(padded))
    if out:
        return out
    why = _mutation_reason(wg.weight, mutated)
    if why:
        return why
    val = wg.gather.meta.get("val")
    if val is None:
        return Refusal(Reason.NO_SHAPE, "no shape information")
    nbytes, numel, dim = slot_facts(wg)
    return shard_refusal(device_type=val.device.type, nbytes=nbytes, numel=numel, dim=dim,
                         contiguous=True,  # the gather input is the shard, cast or padded
                         group_size=int(wg.gather.args[1]), cfg=cfg)
