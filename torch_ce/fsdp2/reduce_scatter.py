"""FSDP2's gradient reduce-scatter on the copy engines: ``set_custom_reduce_scatter``'s comm,
set per param group.

FSDP2 (``fully_shard``) reduce-scatters one flat bucket per param group and backward:
``reduce_scatter_input`` of W * n elements (every gradient of the group, chunk j of each
back to back in rank j's n, padded) into ``reduce_output`` of n, on its reduce-scatter
stream, with ``op`` AVG, SUM or ``PREMUL_SUM(factor)`` (``set_gradient_divide_factor``;
torchtitan's 1.0 gives ``PREMUL_SUM(1.0)``). That is exactly one copy-engine
reduce-scatter call (NOTE [copy-engine reduce-scatter] in
runtime/reduce_scatter/__init__.py) of one input, its result written into FSDP2's own
output, complete in stream order when the hook returns: FSDP2 records its event on that
stream next, and HSDP's all-reduce across replicas runs after it on NCCL as before.

Every rank runs its groups' backward reduce-scatters in the same order (autograd's), so
the protocol's calls pair up; a rank whose order differs gets the protocol's error naming
both calls, never a wrong sum. What the protocol does not take (another op, ``async_op``,
a group of one, a refused transport) runs FSDP2's default collective, with the reason in
``served`` (explain()), as an ``RsReason``.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..rs_reasons import RsReason
from ..runtime import reduce_scatter as RS


def op_text(op, divide_factor: float | None = None) -> str | None:
    """FSDP2's reduce op as the protocol's text, or None where it has none. A
    ``PREMUL_SUM`` whose factor torch does not expose (torch < 2.12 has no
    ``ReduceOp.factor``) is ``1 / divide_factor``, as FSDP2 made it
    (``_get_gradient_divide_factors``)."""
    kind = getattr(op, "op", op)  # a ReduceOp object (PREMUL_SUM) or a RedOpType
    if kind == dist.ReduceOp.SUM:
        return "sum"
    if kind == dist.ReduceOp.AVG:
        return "avg"
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if not isinstance(factor, (int, float)) and divide_factor:
            factor = 1 / divide_factor
        if isinstance(factor, (int, float)):
            return f"premul_sum({float(factor)!r})"
    return None


def _divide_factor(module) -> float | None:
    """The gradient divide factor FSDP2 made this module's op from (None: not set), of its
    first param group (every group of a module gets the module's setting)."""
    from .groups import param_groups

    try:
        pgs = param_groups(module._get_fsdp_state())
    except AttributeError:
        return None
    return getattr(pgs[0], "gradient_divide_factor", None) if pgs else None


# FSDP2's comm interface. This module is imported only where FSDP2 is used (the first
# enable(reduce_scatter="copy_engine")), so its import costs nothing elsewhere.
from torch.distributed.fsdp._fully_shard._fsdp_collectives import ReduceScatter  # noqa: E402


class CopyEngineReduceScatter(ReduceScatter):
    """The ``ReduceScatter`` FSDP2 calls: ``allocate`` as its default, ``__call__`` the
    protocol into ``output_tensor``. It holds its module weakly (the module's FSDP2 param
    group holds the comm)."""

    def __init__(self, name: str, param_group=None):
        self.name = name
        self._group = weakref.ref(param_group) if param_group is not None else (lambda: None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False):
        pg = self._group()
        text = op_text(op, getattr(pg, "gradient_divide_factor", None) if pg is not None else None)
        nbytes = input_tensor.numel() * input_tensor.element_size()
        why = None
        if text is None:
            why = RsReason.FSDP2_OP.says(op=op)
        elif async_op:
            why = RsReason.FSDP2_ASYNC.says()
        elif input_tensor.dtype not in RS.DTYPES:
            why = RsReason.FSDP2_DTYPE.says(dtype=input_tensor.dtype)
        if why is not None:
            RS.note(self.name, nbytes, why)
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                              async_op=async_op)
        RS.reduce_scatter([input_tensor], text, group.size(), group.group_name, self.name,
                          outs=[output_tensor])
        return None


def install_group(param_group, reason_sink=None, name: str = "") -> bool:
    """Install the copy-engine reduce-scatter on one FSDP2 param group (what
    ``set_custom_reduce_scatter`` sets, per group: it refuses a module with several), its
    calls named ``fsdp2 <name>`` in explain(). Returns True."""
    del reason_sink  # every group takes it; a call it cannot serve says why (RsReason)
    param_group._reduce_scatter_comm = CopyEngineReduceScatter(f"fsdp2 {name}", param_group)
    return True


def install(module, group: dist.ProcessGroup | None = None, reason_sink=None,
            name: str | None = None) -> bool:
    """Install the copy-engine reduce-scatter on every param group of ``module`` (an
    ``FSDPModule``), named ``fsdp2 <name>`` (default: the module's class; ``<name>[i]``
    per group where it has several). ``group`` is FSDP2's own (it passes it at every
    call). ``uninstall`` puts FSDP2's default back."""
    from .groups import param_groups

    del group
    name = name or type(module).__name__
    pgs = param_groups(module._get_fsdp_state())
    for i, pg in enumerate(pgs):
        install_group(pg, reason_sink, name if len(pgs) == 1 else f"{name}[{i}]")
    return bool(pgs)


def uninstall(module) -> None:
    """Put FSDP2's default reduce-scatter back on every param group of ``module``."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    from .groups import param_groups

    for pg in param_groups(module._get_fsdp_state()):
        if isinstance(pg._reduce_scatter_comm, CopyEngineReduceScatter):
            pg._reduce_scatter_comm = DefaultReduceScatter()
