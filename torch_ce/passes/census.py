"""Census: the weight all-gathers of a graph that the gate does not judge, and whether a
graph is a joint (forward + loss + backward) training graph.

# NOTE [every gather is counted]
The gate judges ``all_gather_into_tensor``, the form a SimpleFSDP weight gather has when
torch_ce's pass sees it first. Other passes can get there before it: graph_trainer's
``joint_transformer_block_bucketing_reordering_pass`` (and Inductor's FX bucketing) turns
the per-weight gathers of a bucket into one ``bucketing._pre_bucket_all_gather`` (the
members copied into one buffer) + ``all_gather_into_tensor_out(..., out=)``; a
functionalized post-grad graph carries the ``_out`` form under ``auto_functionalized``;
``all_gather_into_tensor_coalesced`` gathers a list. None of these is a weight gather the
copy engines could serve as it is, but each moves weight bytes over the collective, and a
report that left them out read "100.0% of 0 gathered B" for a training step that gathers
every weight. So ``bucketed_gathers`` lists every member of every such collective, named by
the graph input it comes from, with the bytes it writes (the member's shard, in the
bucket's output dtype, times the group size): the manager records them as collective
bytes with ``BUCKETED`` (or the reason its caller gives), never as nothing.

# NOTE [a joint graph is never an inference graph]
graph_trainer traces forward, loss and backward into one graph with no input that requires
grad, so Inductor compiles it with ``is_inference=True``. Taken as an inference graph, its
weights would be bound in place (the optimizer then writes a window peers read with no
fence) or read from cast slots made once (stale after the first optimizer step). A graph
that holds backward nodes (``meta["autograd_backward"]``, what make_fx and Dynamo set when
tracing ``torch.autograd.grad``) or gradient reduce-scatters (over the group it gathers
weights over) is a training graph, whatever the flag says (``is_joint_graph``): its
gathers read staging slots refreshed between the step fences (NOTE [training: staged
windows and step fences] in runtime/staging.py).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..runtime.eligibility import Reason, Refusal
from . import fx_utils as U

c10d = torch.ops._c10d_functional

try:  # registers torch.ops.bucketing.* (the bucketed forms below); absent ops stay absent
    import torch._inductor.fx_passes.bucketing  # noqa: F401
except ImportError:
    pass

BUCKETED = Refusal(
    Reason.BUCKETED,
    "gathered by a bucketed collective of several weights (bucketed before torch_ce's pass; "
    "under torchtitan's graph_trainer: --compile.pass_pipeline torch_ce)")

NCCL_TRANSPORT = Refusal(
    Reason.NCCL_TRANSPORT,
    'transport="nccl" (torch_ce.enable(transport="copy_engine") puts eligible gathers on the copy engines)')


def _op(name: str, overload: str = "default"):
    """An op overload, or None when this torch lacks it."""
    ns, _, op = name.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        return None


# The ops the census counts, each with the torch module that makes graphs hold it: a torch
# without that module has no such gathers to count; one with it but without the op renamed
# it (``missing_ops``, asserted on every CI leg by test/test_torch_features.py).
CENSUS_OPS = {
    "_c10d_functional.all_gather_into_tensor_out": "torch.distributed._functional_collectives",
    "_c10d_functional.all_gather_into_tensor_coalesced": "torch.distributed._functional_collectives",
    "bucketing._pre_bucket_all_gather": "torch._inductor.fx_passes.bucketing",
    "_c10d_functional.reduce_scatter_tensor": "torch.distributed._functional_collectives",
    "_c10d_functional.reduce_scatter_tensor_coalesced": "torch.distributed._functional_collectives",
}


def missing_ops() -> list[str]:
    """Census ops this torch should have (their producer is here) but does not resolve."""
    from .install import has_feature

    return [name for name, producer in CENSUS_OPS.items() if has_feature(producer) and _op(name) is None]


def _ops(*names) -> frozenset:
    assert all(n in CENSUS_OPS for n in names), names
    return frozenset(o for o in (_op(n) for n in names) if o is not None)


_OUT = _ops("_c10d_functional.all_gather_into_tensor_out")
_COALESCED = _ops("_c10d_functional.all_gather_into_tensor_coalesced")
_PRE_BUCKET = _ops("bucketing._pre_bucket_all_gather")
_REDUCE_SCATTER = _ops("_c10d_functional.reduce_scatter_tensor", "_c10d_functional.reduce_scatter_tensor_coalesced")
_GATHER_FORMS = _OUT | _COALESCED  # besides all_gather_into_tensor: group name in args[2]
_AUTO_FUNCTIONALIZED = {getattr(torch.ops.higher_order, n, None) for n in
                        ("auto_functionalized", "auto_functionalized_v2")} - {None}


@dataclasses.dataclass
class Member:
    """One weight's share of a collective the gate does not judge."""

    gather: fx.Node  # the collective (or its auto_functionalized wrapper)
    source: fx.Node | None  # the graph input it comes from (through casts and views), if any
    nbytes: int  # what the collective writes for it: shard bytes x group size
    form: str  # the collective's op, for the log


def is_joint_graph(graph: fx.Graph) -> bool:
    """A forward + backward graph (NOTE [a joint graph is never an inference graph]): a
    node traced in the backward, or a reduce-scatter over a group that the graph also
    gathers weights over (FSDP's gradients; a tensor-parallel reduce-scatter is on another
    group)."""
    gather_groups, scatter_groups = set(), set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.meta.get("autograd_backward", False):
            return True
        if n.target in _REDUCE_SCATTER and len(n.args) > 3:
            scatter_groups.add(str(n.args[3]))
        elif (U.is_all_gather(n) or n.target in _GATHER_FORMS) and len(n.args) > 2:
            gather_groups.add(str(n.args[2]))
    return bool(gather_groups & scatter_groups)


def source_of(x) -> fx.Node | None:
    """The placeholder ``x`` comes from through single-tensor-input nodes, if any."""
    seen = 0
    while isinstance(x, fx.Node) and x.op == "call_function" and seen < 16:
        ins = [a for a in x.all_input_nodes]
        if len(ins) != 1:
            return None
        x, seen = ins[0], seen + 1
    return x if isinstance(x, fx.Node) and x.op == "placeholder" else None


def _nbytes(node, dtype=None) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return 0
    n = U.numel(val)
    if n is None:
        return 0
    return n * (dtype or val.dtype).itemsize


def _pre_bucket_of(x) -> fx.Node | None:
    """The ``_pre_bucket_all_gather`` whose output ``x`` narrows (its bucket's buffer)."""
    for _ in range(4):
        if not isinstance(x, fx.Node) or x.op != "call_function":
            return None
        if x.target in _PRE_BUCKET:
            return x
        x = x.args[0] if x.args else None
    return None


def _bucket_members(pre: fx.Node, group_size: int, gather: fx.Node, form: str) -> list[Member]:
    from torch._inductor.fx_passes.bucketing import _ALL_DTYPES

    ins = list(pre.args[0])
    out_dtypes = pre.args[3] if len(pre.args) > 3 else pre.kwargs.get("out_dtype_ints")
    out = []
    for i, a in enumerate(ins):
        dt = _ALL_DTYPES[out_dtypes[i]] if out_dtypes is not None else None
        out.append(Member(gather, source_of(a), _nbytes(a, dt) * group_size, form))
    return out


def _members_of(n: fx.Node, inp, group_size: int, form: str) -> list[Member]:
    pre = _pre_bucket_of(inp)
    if pre is not None:
        return _bucket_members(pre, group_size, n, form)
    return [Member(n, source_of(inp), _nbytes(inp) * group_size, form)]


def bucketed_gathers(graph: fx.Graph) -> list[Member]:
    """Every member of every weight gather the gate does not judge (NOTE [every gather
    is counted]), in program order: ``all_gather_into_tensor_out`` (plain or under
    ``auto_functionalized``), ``all_gather_into_tensor_coalesced``, and an
    ``all_gather_into_tensor`` of a ``_pre_bucket_all_gather`` buffer (the gate sees that
    one as a gather of a non-input)."""
    out: list[Member] = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in _OUT:
            out += _members_of(n, n.args[0], int(n.args[1]), "all_gather_into_tensor_out")
        elif n.target in _AUTO_FUNCTIONALIZED and n.args and n.args[0] in _OUT:
            out += _members_of(n, n.kwargs.get("input"), int(n.kwargs.get("group_size") or 0),
                               "auto_functionalized(all_gather_into_tensor_out)")
        elif n.target in _COALESCED:
            for a in n.args[0]:
                out += _members_of(n, a, int(n.args[1]), "all_gather_into_tensor_coalesced")
        elif U.is_all_gather(n) and _pre_bucket_of(n.args[0]) is not None:
            out += _members_of(n, n.args[0], int(n.args[1]), "all_gather_into_tensor")
    return out


def judged_by_gate(gather: fx.Node) -> bool:
    """Whether the gate judges this ``all_gather_into_tensor`` (not a bucket's buffer)."""
    return U.is_all_gather(gather) and _pre_bucket_of(gather.args[0]) is None
