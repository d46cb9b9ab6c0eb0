"""What magi::ce_reduce_scatter[_coalesced] do: push, signal, wait, one reduction.

# NOTE [copy-engine reduce-scatter]
A gradient reduce-scatter of a bucket over a group of W ranks, rank i (its index in the
group), without a collective and without a barrier (the workspaces and flags: NOTE
[reduce-scatter workspaces] in rs_workspace.py). Each input is cut in W equal chunks
along dim 0, as ``reduce_scatter_tensor`` does; a bucket's slice for rank j is its
inputs' chunks j, back to back. Call n of the pool uses half h = n % 2:

  1. push     for each peer j, from i+1 on (so the ranks do not all start at rank 0):
              wait free[h, j] (j reduced what i pushed into its half h two calls ago),
              copy the slice for j into j's recv[h, i], set j's data[h, i]
  2. wait     for each peer j: wait data[h, j] (j pushed i's slice)
  3. reduce   output = sum over group index 0, 1, ..., W-1 of chunk i, this rank's own
              read in place from its input (never copied), the peers' from recv[h, j];
              in fp32 (bf16 inputs: rounded once at the end); ``avg`` divides by W after
  4. free     for each peer j: set j's free[h, i]

Nothing waits for anything but (a) the data the reduction needs and (b) a half a peer has
not finished with. The summation order is fixed (group index order) and the same on every
rank, so results are deterministic run to run; at W = 2 a sum of two is order-free, so
they are bit-identical to the collective's.

Every rank runs every step; a peer that never pushes is a ``ReduceScatterError`` naming
the bucket and the peer within ``rs_timeout_s``, and its peers' waits end at once.

Host transport (CPU): the four steps run in the op (memcpy into the peers' mappings,
flag words); its ``wait_tensor`` has nothing to wait for. A bucket whose slice does not
fit a workspace under ``rs_workspace_cap_mib`` runs the group's collective instead, on
every rank (the sizes are the same on all), and says so once per bucket.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch

from . import rs_workspace as RW
from .rs_workspace import DATA, FREE, ReduceScatterError

log = logging.getLogger("torch_ce")

REDUCE_OPS = ("sum", "avg")
DTYPES = (torch.float32, torch.bfloat16)
_FUNCTIONAL = torch.ops._c10d_functional


@dataclasses.dataclass
class Served:
    """What one bucket's reduce-scatters did in this process (explain() reads it)."""

    name: str
    calls: int = 0
    ce_bytes: int = 0  # input bytes reduced on the copy engines (host transport on CPU)
    collective_bytes: int = 0
    reason: str = ""  # why a call ran on the collective


served: dict[str, Served] = {}


def _group(group_name: str, group_size: int, name: str) -> tuple[tuple, int]:
    import torch.distributed as dist

    try:
        pg = torch._C._distributed_c10d._resolve_process_group(group_name)
    except RuntimeError as e:
        raise ReduceScatterError(
            f"torch_ce: magi::ce_reduce_scatter of {name} got group {group_name!r}, which is not a "
            "live process group on this rank") from e
    ranks = tuple(dist.get_process_group_ranks(pg))
    if len(ranks) != group_size:
        raise ReduceScatterError(f"torch_ce: magi::ce_reduce_scatter of {name}: group_size "
                                 f"{group_size} but group {group_name!r} has ranks {list(ranks)}")
    return ranks, ranks.index(dist.get_rank())


def _check(inputs: Sequence[torch.Tensor], reduce_op: str, group_size: int, name: str) -> None:
    if reduce_op not in REDUCE_OPS:
        raise ReduceScatterError(f"torch_ce: magi::ce_reduce_scatter of {name}: reduce_op must be "
                                 f"one of {REDUCE_OPS}, got {reduce_op!r}")
    if not inputs:
        raise ReduceScatterError(f"torch_ce: magi::ce_reduce_scatter_coalesced of {name}: no inputs")
    for x in inputs:
        if x.dtype not in DTYPES or x.dtype != inputs[0].dtype:
            raise ReduceScatterError(
                f"torch_ce: magi::ce_reduce_scatter of {name}: inputs must share one dtype of "
                f"{[str(d) for d in DTYPES]}, got {[str(t.dtype) for t in inputs]}")
        if x.dim() == 0 or x.shape[0] % group_size:
            raise ReduceScatterError(
                f"torch_ce: magi::ce_reduce_scatter of {name}: an input of shape {tuple(x.shape)} "
                f"does not split in {group_size} equal chunks along dim 0")


def _collective(inputs, reduce_op, group_size, group_name) -> list[torch.Tensor]:
    outs = []
    for x in inputs:
        out = _FUNCTIONAL.reduce_scatter_tensor(x.contiguous(), reduce_op, group_size, group_name)
        outs.append(_FUNCTIONAL.wait_tensor(out))  # NOTE [gloo: one functional collective in flight]
    return outs


def _note(name: str, nbytes: int, ce: bool, reason: str = "") -> None:
    s = served.get(name)
    if s is None:
        served[name] = s = Served(name)
    s.calls += 1
    if ce:
        s.ce_bytes += nbytes
    else:
        s.collective_bytes += nbytes
        if reason and s.reason != reason:
            s.reason = reason
            log.warning("torch_ce: reduce-scatter %s stays on the collective: %s", name, reason)


def reduce_scatter(inputs: Sequence[torch.Tensor], reduce_op: str, group_size: int,
                   group_name: str, name: str = "") -> list[torch.Tensor]:
    """A bucket's reduce-scatter (NOTE [copy-engine reduce-scatter]): one output per input,
    ``[rows / group_size, ...]``, this rank's chunk summed over the group."""
    name = name or f"a bucket of {len(inputs)} input(s)"
    _check(inputs, reduce_op, group_size, name)
    if group_size == 1:
        return [x.clone() for x in inputs]
    ranks, i = _group(group_name, group_size, name)
    w = group_size
    flat = [x.contiguous().view(-1) for x in inputs]
    ns = [f.numel() // w for f in flat]
    nbytes = sum(f.numel() for f in flat) * inputs[0].element_size()
    dev = inputs[0].device
    if dev.type != "cpu":
        raise ReduceScatterError(
            f"torch_ce: magi::ce_reduce_scatter of {name} got {dev.type} tensors; only the host "
            "transport (CPU) has it in this build")
    ws = RW.get(ranks, i, inputs[0].dtype, dev, sum(ns), name)
    if ws is None:
        cap = RW.workspace_bytes(w, sum(ns), inputs[0].dtype)
        _note(name, nbytes, False, f"its workspace ({cap:,d} B) passes rs_workspace_cap_mib")
        return _collective(inputs, reduce_op, group_size, group_name)
    h = ws.calls % 2
    ws.calls += 1
    what = f"reduce-scatter {name} (call {ws.calls} of group {list(ranks)})"
    for k in range(1, w):  # 1. push
        j = (i + k) % w
        RW.wait_flag(ws, FREE, h, j, what)
        dst, off = ws.peer_recv[j][h, i], 0
        for f, n in zip(flat, ns, strict=True):
            dst[off:off + n].copy_(f[j * n:(j + 1) * n])
            off += n
        ws.peer_flags[j][DATA, h, i] = 1
    for k in range(1, w):  # 2. wait
        RW.wait_flag(ws, DATA, h, (i + k) % w, what)
    outs, off = [], 0  # 3. reduce, in group index order
    for x, f, n in zip(inputs, flat, ns, strict=True):
        acc = None
        for j in range(w):
            src = f[i * n:(i + 1) * n] if j == i else ws.recv[h, j, off:off + n]
            if acc is None:
                acc = src.to(torch.float32, copy=True)
            else:
                acc.add_(src)
        if reduce_op == "avg":
            acc.div_(w)
        outs.append(acc.to(x.dtype).view(x.shape[0] // w, *x.shape[1:]))
        off += n
    for k in range(1, w):  # 4. free
        j = (i + k) % w
        ws.peer_flags[j][FREE, h, i] = 1
    _note(name, nbytes, True)
    return outs


def release() -> None:
    RW.release()
    served.clear()
