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
  * it is a single Shard(0) gather: its output is used as is (Shard(1) is re-split; a 2-D
    placement is gathered again), or, for an uneven Shard(0), sliced to the weight's rows
    after the wait, with the short ranks' shards zero-padded before it (``uneven_rows``:
    NOTE [uneven Shard(0): padded slots] in runtime/windows.py);
  * the shard is contiguous, static-shaped, on a device the transport serves, and at least
    ``symm_min_shard_mib`` large: ``shard_refusal`` (runtime/eligibility.py), the predicate
    the run-time bind applies to the live shard, so the two cannot disagree.

# NOTE [inference graphs bind in place, training graphs stage]
An inference graph's weights are bound in place (the parameter views its window) and read
with no step barrier: weights are static. A training graph's weights change every step,
so peers read a staging slot that holds the weight (or its param_dtype cast), refreshed
between two fences at the head of each forward (runtime/staging.py); the optimizer never
writes a window. A graph that mutates its inputs keeps the collective either way.
"""
from __future__ import annotations

import dataclasses

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
    # over the same candidates (NOTE [agreement before anything moves] in binding.py).
    weight: fx.Node | None = None
    # An uneven Shard(0) gather: the rows every rank's (padded) shard has, read from the
    # gather's output shape (the same on every rank); the short ranks' pad node goes.
    padded_rows: int = 0
    pad: fx.Node | None = None  # this rank's pad before the gather (a short rank), if any
    # An inference graph's cast gather served by a cast slot (never refreshed).
    cast_slot: bool = False

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
    md = _aot_metadata()
    if md is not None and any(getattr(i, "mutates_data", False) for i in md.input_info):
        return Refusal(Reason.MUTATING_GRAPH,
                       "graph mutates its inputs (weights may change under a peer's read)")
    return None


def _is_weight(ph: fx.Node, idx: int) -> bool:
    desc = ph.meta.get("desc")
    if desc is not None and getattr(desc, "attr", None) == "_local_tensor":
        return True
    md = _aot_metadata()
    if md is not None and md.static_input_indices is not None:
        return idx in md.static_input_indices
    return desc is None  # hand-built graphs: trust the caller


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


def _end_pad(x) -> fx.Node | None:
    """``x`` if it is a zero ``constant_pad_nd`` that appends rows to dim 0 only (what
    DTensor does to a short uneven Shard(0) shard before the gather), used only here."""
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _PAD_OPS
            and len(x.users) == 1 and isinstance(x.args[0], fx.Node)):
        return None
    pad = list(x.args[1])
    value = x.args[2] if len(x.args) > 2 else x.kwargs.get("value", 0.0)
    val = x.args[0].meta.get("val")
    if val is None or len(pad) != 2 * val.dim() or value != 0:
        return None
    if any(pad[:-1]) or pad[-1] <= 0:
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
    out = _output_reason(seed.wait, padded=bool(seed.padded_rows))
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
