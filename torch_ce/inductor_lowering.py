"""How Inductor sees the magi ops: FallbackKernels, and which of them are transfers.

The CE ops and the bind step lower to FallbackKernels (the generated code calls the op).
Inductor counts a FallbackKernel as compute (``is_collective`` only knows
``_CollectiveKernel``), so the reorder asks ``_issues_transfer`` instead (NOTE [CE ops are
transfers] in passes/reorder.py). The cost of a transfer is in passes/cost.py; ``ce_launch_info`` is what it reads.

``magi.ce_gather_rows`` is compute, not a transfer: it runs on the current stream and has
no wait, so hoisting it would hide nothing (its SM kernel runs in line with the compute
either way), and it reads a few rows, not a table (NOTE [row gathers] in passes/rows.py);
so is ``magi.ce_row_positions``, the index its lookup reads the rows through.
"""
from __future__ import annotations

import functools

import torch


@functools.cache
def register_lowerings() -> None:
    """Register the magi ops as Inductor fallbacks (once per process)."""
    from torch._inductor import lowering

    from . import ops  # noqa: F401  (the ops must exist)

    magi = torch.ops.magi
    if magi.ce_staged.default not in lowering.lowerings:
        lowering.register_lowering(magi.ce_staged.default, type_promotion_kind=None)(_staged_lowering)
    for op in (magi.ce_reduce_scatter.default, magi.ce_reduce_scatter_coalesced.default):
        if op not in lowering.lowerings:
            lowering.register_lowering(op, type_promotion_kind=None)(functools.partial(_reduce_scatter_lowering, op))
    for op in (magi.ce_all_gather, magi.ce_all_gather_coalesced, magi.ce_all_gather_dim, magi.ce_bind,
               magi.ce_prefetch, magi.ce_gather_rows, magi.ce_row_positions, magi.ce_stage,
               magi.ce_all_gather_padded,
               magi.ce_reduce_scatter, magi.ce_reduce_scatter_coalesced):
        for overload in op.overloads():
            target = getattr(op, overload)
            if target not in lowering.lowerings:
                lowering.make_fallback(target, warn=False)


def _staged_lowering(*args, **kwargs):
    """``magi.ce_staged`` as a FallbackKernel whose outputs Inductor never reuses.

    # NOTE [staging slots are not Inductor's buffers]
    ``ce_staged`` returns views of window memory (the staging slots the gathers read), not
    fresh tensors. Inductor treats an extern kernel's outputs as its own: once the last
    gather has read a slot, its memory planner may hand the buffer to a later kernel of the
    same size (``buf9 = buf2; del buf2  # reuse``) or let a pointwise kernel write into it
    in place, i.e. write this step's activations into a window its peers read. On Llama3-8B
    shapes that overwrote the layer weights' slots in the first step (docs/perf-notes.md,
    the staging check). ``never_reuse_buffers`` keeps both from
    happening."""
    from torch._inductor import lowering
    from torch._inductor.virtualized import V

    outs = lowering.fallback_handler(torch.ops.magi.ce_staged.default, add_to_fallback_set=False)(*args, **kwargs)
    for o in outs:
        V.graph.never_reuse_buffers.add(o.get_name())
    return outs


def _reduce_scatter_lowering(op, inputs, *args, **kwargs):
    """A CE reduce-scatter as a FallbackKernel whose inputs Inductor never reuses: on CUDA
    its copy and reduce streams read them until its wait (NOTE [copy-engine
    reduce-scatter]), and Inductor's memory planner only knows the current stream."""
    from torch._inductor import lowering
    from torch._inductor.virtualized import V

    outs = lowering.fallback_handler(op, add_to_fallback_set=False)(inputs, *args, **kwargs)
    for x in inputs if isinstance(inputs, (list, tuple)) else [inputs]:
        try:
            V.graph.never_reuse_buffers.add(x.get_name())
        except (AttributeError, NotImplementedError):
            pass  # not a buffer (a view of one: its base is then kept by the view's users)
    return outs


def _issues_transfer(snode) -> bool:
    """True for NCCL collective launches and for the CE gather ops."""
    from torch._inductor import ir

    node = getattr(snode, "node", None)
    if node is None or isinstance(node, ir._WaitKernel):  # a wait subclasses the kernel
        return False
    if isinstance(node, ir._CollectiveKernel):
        return True
    return ce_launch_info(snode) is not None


def ce_launch_info(snode) -> tuple[int, int, str] | None:
    """(bytes per rank, group size, device type) of a CE gather launch node (a prefetch
    included), else None. A CE reduce-scatter moves what a gather of its output chunk
    would (each rank's chunk to each peer): its bytes per rank are its input's / W."""
    magi = torch.ops.magi
    node = getattr(snode, "node", None)
    op = getattr(node, "op_overload", None)
    if op in (magi.ce_reduce_scatter.default, magi.ce_reduce_scatter_coalesced.default):
        for origin in getattr(node, "origins", ()) or ():
            if origin.target is op:
                xs = origin.args[0] if isinstance(origin.args[0], (list, tuple)) else [origin.args[0]]
                vals = [x.meta["val"] for x in xs]
                w = int(origin.args[2])
                return sum(int(v.numel()) * v.element_size() for v in vals) // w, w, vals[0].device.type
        return None
    if op not in (magi.ce_all_gather.default, magi.ce_all_gather_coalesced.default,
                  magi.ce_all_gather_dim.default, magi.ce_prefetch.default,
                  magi.ce_all_gather_padded.default):
        return None
    for origin in getattr(node, "origins", ()) or ():
        if origin.target is op and op is magi.ce_all_gather_padded.default:
            # (shard, rows, group_size, group_name): every rank reads rows-row slabs.
            v, rows = origin.args[0].meta["val"], int(origin.args[1])
            return rows * _row_numel(v) * v.element_size(), int(origin.args[2]), v.device.type
        if origin.target is op:
            shards = origin.args[0] if isinstance(origin.args[0], (list, tuple)) else [origin.args[0]]
            vals = [s.meta["val"] for s in shards]
            nbytes = sum(int(v.numel()) * v.element_size() for v in vals)
            return nbytes, int(origin.args[1]), vals[0].device.type
    return None




def _row_numel(v) -> int:
    n = 1
    for d in v.shape[1:]:
        n *= int(d)
    return n
