"""A bucket's spec: what every call of one bucket shares, checked and built once.

The op (runtime/reduce_scatter/op.py) and a launch without one (``launch.launch``: the
loopback helper, the benches) take a call's ``Spec`` from ``spec_of``, which checks the
inputs and builds their signature at a bucket's first call and caches the record by what
the checks read (shapes, dtypes, devices, the reduce op, the group size).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .. import native
from .flags import ReduceScatterError

REDUCE_OPS = ("sum", "avg", "premul_sum(<factor>)")
DTYPES = (torch.float32, torch.bfloat16)


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    """One bucket's checked facts, the same at every call and on every rank."""

    need: int  # elements per rank: each sender's slice, what a workspace must hold
    nbytes: int  # input bytes per call (what ``served`` counts)
    sig: str  # the signature: what its tag and its workspace round compare ("" for a group of one)


_SPECS: dict = {}  # (shapes, dtypes, devices), reduce op, group size -> Spec: a cache of pure functions


def spec_of(inputs: Sequence[torch.Tensor], reduce_op: str, group_size: int, name: str) -> Spec:
    """The ``Spec`` of a call whose inputs pass ``_check`` (which raises otherwise, at
    every call: only good buckets are cached)."""
    key = (tuple([(x.shape, x.dtype, x.device) for x in inputs]), reduce_op, group_size)
    found = _SPECS.get(key)
    if found is None:
        _check(inputs, reduce_op, group_size, name)
        if len(_SPECS) > 4096:
            _SPECS.clear()
        numel = sum(x.numel() for x in inputs)
        sig = signature(inputs, reduce_op, group_size)[1] if group_size > 1 else ""
        _SPECS[key] = found = Spec(numel // group_size, numel * inputs[0].element_size(), sig)
    return found


def _check(inputs: Sequence[torch.Tensor], reduce_op: str, group_size: int, name: str) -> None:
    if reduce_op not in REDUCE_OPS and premul_factor(reduce_op) is None:
        raise ReduceScatterError(f"torch_ce: magi::ce_reduce_scatter of {name}: reduce_op must be "
                                 f"one of {REDUCE_OPS}, got {reduce_op!r}")
    if not inputs:
        raise ReduceScatterError(f"torch_ce: magi::ce_reduce_scatter_coalesced of {name}: no inputs")
    for x in inputs:
        if x.dtype not in DTYPES or x.dtype != inputs[0].dtype or x.device != inputs[0].device:
            raise ReduceScatterError(
                f"torch_ce: magi::ce_reduce_scatter of {name}: inputs must share one device and one "
                f"dtype of {[str(d) for d in DTYPES]}, got {[(str(t.dtype), str(t.device)) for t in inputs]}")
        if x.dim() == 0 or x.shape[0] % group_size:
            raise ReduceScatterError(
                f"torch_ce: magi::ce_reduce_scatter of {name}: an input of shape {tuple(x.shape)} "
                f"does not split in {group_size} equal chunks along dim 0")


def signature(inputs, reduce_op: str, group_size: int) -> tuple[int, str]:
    """(per-rank element count, text) of a call: what its tag and its round compare."""
    numel = sum(x.numel() for x in inputs) // group_size
    shapes = ",".join("x".join(map(str, x.shape)) for x in inputs)
    return numel, f"{numel}|{shapes}|{str(inputs[0].dtype).removeprefix('torch.')}|{reduce_op}"


_OP_CODES: dict = {}  # reduce op -> (native op code, factor)


def op_code(reduce_op: str) -> tuple[int, float]:
    """(the native op code, its factor) of a reduce op (the C++ launch's arguments)."""
    code = _OP_CODES.get(reduce_op)
    if code is None:
        factor = premul_factor(reduce_op)
        code = (native.RS_PREMUL, factor) if factor is not None else (native.RS_OPS[reduce_op], 1.0)
        _OP_CODES[reduce_op] = code
    return code


def premul_factor(reduce_op: str) -> float | None:
    """The factor of ``"premul_sum(<factor>)"`` (FSDP2's ``ReduceOp.PREMUL_SUM``: every
    rank's input times the factor, then summed), None for another op."""
    if reduce_op.startswith("premul_sum(") and reduce_op.endswith(")"):
        try:
            return float(reduce_op[len("premul_sum("):-1])
        except ValueError:
            return None
    return None
