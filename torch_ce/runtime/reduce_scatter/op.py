"""What magi::ce_reduce_scatter[_coalesced] do for one bucket: check it, decide whether the
copy engines serve it (an ``RsRefusal`` when not: the group's collective runs instead, on
every rank alike), then launch and complete one call on its group's workspace; and count
what each bucket did (``served``, what explain() reads).

    reduce_scatter                     the op
      spec.spec_of                     the bucket's checks and signature, once per bucket
      _verdict -> workspace.get        the group's workspace, opened or grown, or a refusal
      _collective                      a refused bucket
      launch.launch, launch.complete   step 1, steps 2-4 (or the outputs' c10d work)
      note                             the accounting
"""
from __future__ import annotations

import dataclasses
import logging
import platform
from typing import Sequence

import torch

from ...config import config
from ...rs_reasons import RsReason, RsRefusal
from .. import native
from . import host_flags as HF
from . import launch as L
from . import watchdog
from . import workspace as W
from .flags import ReduceScatterError
from .spec import premul_factor, spec_of

log = logging.getLogger("torch_ce")

_FUNCTIONAL = torch.ops._c10d_functional


def reduce_scatter(inputs: Sequence[torch.Tensor], reduce_op: str, group_size: int,
                   group_name: str, name: str = "",
                   outs: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """A bucket's reduce-scatter (NOTE [copy-engine reduce-scatter]): one output per input,
    ``[rows / group_size, ...]``, this rank's chunk summed over the group.

    With ``outs`` (contiguous, one per input, FSDP2's reduce-scatter hook), the results go
    there and the call is complete in stream order when this returns: on CUDA its
    completion is enqueued now and the current stream waits for it, so no ``wait_tensor``
    is needed (the caller's stream orders what reads them)."""
    name = name or f"a bucket of {len(inputs)} input(s)"
    spec = spec_of(inputs, reduce_op, group_size, name)
    if outs is not None and (len(outs) != len(inputs) or any(
            not o.is_contiguous() or o.dtype != x.dtype or o.numel() * group_size != x.numel()
            for o, x in zip(outs, inputs))):
        raise ReduceScatterError(f"torch_ce: reduce-scatter of {name}: outs must be contiguous, one "
                                 f"per input, of its dtype and 1/{group_size} of its elements")
    if group_size == 1:
        factor = premul_factor(reduce_op)
        return _into(outs, [x * factor if factor is not None else x.clone() for x in inputs])
    pg, ranks, i = _group(group_name, group_size, name)
    ws, why = _verdict(pg, ranks, i, inputs[0], spec, name)
    if why is not None:
        note(name, spec.nbytes, why)
        return _collective(inputs, reduce_op, group_size, group_name, outs)
    call = L.launch(ws, inputs, reduce_op, name, spec, outs, register=outs is None)
    if inputs[0].device.type == "cpu" or outs is not None:
        L.complete(call, wait_current=outs is not None)  # the host: done; given outputs: in stream order
    else:
        L.register(call)  # a graph's wait_tensor completes it
    note(name, spec.nbytes)
    return call.outs


_GROUPS: dict = {}  # group name -> (its process group, its ranks, this rank's index): a lookup cache


def _group(group_name: str, group_size: int, name: str) -> tuple:
    """(the process group, its ranks, this rank's index), cached per name while the name
    resolves to the same process group (a group made again under an old name is looked up
    again)."""
    try:
        pg = torch._C._distributed_c10d._resolve_process_group(group_name)
    except RuntimeError as e:
        raise ReduceScatterError(
            f"torch_ce: magi::ce_reduce_scatter of {name} got group {group_name!r}, which is not a "
            "live process group on this rank") from e
    known = _GROUPS.get(group_name)
    if known is None or known[0] is not pg:
        import torch.distributed as dist

        ranks = tuple(dist.get_process_group_ranks(pg))
        known = _GROUPS[group_name] = (pg, ranks, ranks.index(dist.get_rank()))
    if len(known[1]) != group_size:
        raise ReduceScatterError(f"torch_ce: magi::ce_reduce_scatter of {name}: group_size "
                                 f"{group_size} but group {group_name!r} has ranks {list(known[1])}")
    return known


def _verdict(pg, ranks: tuple, index: int, x: torch.Tensor, spec, name: str) -> tuple:
    """(the group's workspace, None), or (None, why the bucket stays on the collective).
    The same verdict on every rank: the same build, host kind and sizes everywhere."""
    dev = x.device
    why = None
    if dev.type == "cuda" and not native.has_stream_flags():
        why = RsReason.NO_FLAG_OPS.says()
    elif dev.type == "cuda":
        why = one_queue_refusal()
    elif dev.type == "cpu":
        why = host_order_refusal()
    if why is not None:
        return None, why
    ws = W.get(pg, ranks, index, x.dtype, dev, spec.need, name, spec.sig)
    if ws is None:
        return None, RsReason.OVER_CAP.says(nbytes=W.workspace_bytes(len(ranks), spec.need, x.dtype))
    return ws, None


def one_queue_refusal() -> RsRefusal | None:
    """Why a CUDA reduce-scatter stays on the collective under one hardware queue: there
    only a host store releases a dead peer's stream wait, so the flags must live in host
    memory, and only the native completion's reduction kernel reads the poison word that
    keeps the released call's outputs NaN (runtime/reduce_scatter/host_flags.py). None where
    that serves, or with more than one queue."""
    if not HF.one_queue() or HF.wanted():
        return None
    why = ("config.rs_host_flags is False" if config.rs_host_flags is False
           else HF.unavailable() or "host-mapped flags are off")
    return RsReason.ONE_QUEUE.says(why=why)


def host_order_refusal() -> RsRefusal | None:
    """Why the host transport cannot run here: it relies on x86's store order (NOTE
    [reduce-scatter workspaces]); None on x86."""
    m = platform.machine().lower()
    if m in ("x86_64", "amd64", "i386", "i686", "x86"):
        return None
    return RsReason.HOST_NOT_X86.says(machine=platform.machine())


def _collective(inputs, reduce_op: str, group_size: int, group_name: str, outs) -> list[torch.Tensor]:
    """The group's functional collective, per input (given ``outs``: waited and copied in)."""
    res = []
    factor = premul_factor(reduce_op)
    for x in inputs:
        op = reduce_op
        if factor is not None:  # the functional collective has no premul: scale, then sum
            x, op = x * factor, "sum"
        out = _FUNCTIONAL.reduce_scatter_tensor(x.contiguous(), op, group_size, group_name)
        if x.device.type == "cpu":
            out = _FUNCTIONAL.wait_tensor(out)  # NOTE [gloo: one functional collective in flight]
        res.append(out)
    if outs is not None:
        res = [_FUNCTIONAL.wait_tensor(r) for r in res]
    return _into(outs, res)


def _into(outs, res: list) -> list:
    if outs is None:
        return res
    for o, r in zip(outs, res):
        o.copy_(r.view(o.shape))
    return list(outs)


# ---------------------------------------------------------------------------------------
# What each bucket did
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Served:
    """What one bucket's reduce-scatters did in this process (explain() reads it)."""

    name: str
    calls: int = 0
    ce_bytes: int = 0  # input bytes reduced without the collective
    collective_bytes: int = 0
    reason: str = ""  # why a call ran on the collective


served: dict[str, Served] = {}  # bucket name -> what its calls did in this process


def note(name: str, nbytes: int, why: RsRefusal | None = None) -> None:
    """Count one call of bucket ``name``: on the copy engines, or (``why``) on the
    collective, saying why once per bucket and reason."""
    s = served.get(name)
    if s is None:
        served[name] = s = Served(name)
    s.calls += 1
    if why is None:
        s.ce_bytes += nbytes
        return
    s.collective_bytes += nbytes
    reason = str(why)
    if reason and s.reason != reason:
        s.reason = reason
        log.warning("torch_ce: reduce-scatter %s stays on the collective: %s", name, reason)


def release() -> None:
    """Forget every pool, count, group and watched call (torch_ce.release_all)."""
    W.release()
    L.release()
    watchdog.release()
    served.clear()
    _GROUPS.clear()
