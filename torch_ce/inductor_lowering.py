"""How Inductor sees the magi ops: FallbackKernels, and which of them are transfers.

The CE ops and the bind step lower to FallbackKernels (the generated code calls the op).
Inductor counts a FallbackKernel as compute (``is_collective`` only knows
``_CollectiveKernel``), so the reorder asks ``_issues_transfer`` instead (NOTE [CE ops are
transfers] in passes/reorder.py). The cost of a transfer is in passes/cost.py.
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
    for op in (magi.ce_all_gather, magi.ce_all_gather_coalesced, magi.ce_bind, magi.ce_prefetch):
        for overload in op.overloads():
            target = getattr(op, overload)
            if target not in lowering.lowerings:
                lowering.make_fallback(target, warn=False)


def _issues_transfer(snode) -> bool:
    """True for NCCL collective launches and for the CE gather ops."""
    from torch._inductor import ir

    from .passes.cost import ce_launch_info

    node = getattr(snode, "node", None)
    if node is None or isinstance(node, ir._WaitKernel):  # a wait subclasses the kernel
        return False
    if isinstance(node, ir._CollectiveKernel):
        return True
    return ce_launch_info(snode) is not None
