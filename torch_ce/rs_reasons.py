"""Why a gradient reduce-scatter stays on the collective: one enumerated reason for the
places that decide, the compile pass (passes/reduce_scatter.py ``judge``), FSDP2's hook
(fsdp2/reduce_scatter.py), the eager path (runtime/eager.py) and the op at run time
(runtime/reduce_scatter/op.py).

A leaf that imports nothing of torch_ce, so the compile side and the run time may both
import it (docs/DESIGN.md, "who may import whom"). Each member has a stable code and the
sentence a person reads, a template of the facts it names: ``RsReason.X.says(**facts)``
is the ``RsRefusal`` whose ``str()`` is that sentence (what explain() shows).
"""
from __future__ import annotations

import dataclasses
import enum


class RsReason(enum.IntEnum):
    """Why a bucket's reduce-scatter stays on the collective (codes are stable)."""

    def __new__(cls, code: int, text: str):
        member = int.__new__(cls, code)
        member._value_ = code
        member.text = text
        return member

    # The compile pass, on a graph's meta values: the same verdict on every rank.
    OFF = 1, "reduce_scatter='collective' (the default; set it to 'copy_engine')"
    NO_SHAPE = 2, "no shape on its input (not a traced tensor)"
    REDUCE_OP = 3, "reduce op {op!r} (CE reduces {ops})"
    GROUP_OF_ONE = 4, "a group of one rank"
    DTYPE = 5, "dtype {dtypes} (CE reduces one of fp32, bf16)"
    DIM0 = 6, "dim 0 does not split in equal chunks"
    HOST_TRANSPORT_OFF = 7, "host_transport is off"
    DEVICE = 8, "device {device}"
    # FSDP2's reduce-scatter hook, per call: what the protocol does not take.
    FSDP2_OP = 20, "FSDP2 asked for reduce op {op!r}, which the protocol does not take"
    FSDP2_ASYNC = 21, "FSDP2 asked for an async_op reduce-scatter (a Work to wait on)"
    FSDP2_DTYPE = 22, "its gradients are {dtype} (the protocol takes fp32 and bf16)"
    # The eager path: the backward of a gather outside compiled graphs (runtime/eager.py).
    EAGER = 30, ("the backward of a gather outside compiled graphs (DTensor's reduce-scatter; "
                 "the copy-engine reduce-scatter serves compiled graphs and FSDP2's hook)")
    # The op, per call at run time: the same build, host kind and sizes on every rank.
    NO_FLAG_OPS = 40, "the C++ library (csrc/ce_ops.cu) with the stream flag ops is not built or not loaded"
    ONE_QUEUE = 41, ("CUDA_DEVICE_MAX_CONNECTIONS=1: a dead peer's stream wait could only be released "
                     "through host-mapped flags, and {why}, so the copy-engine reduce-scatter would not "
                     "be hang-free")
    HOST_NOT_X86 = 42, ("the host transport's reduce-scatter relies on x86 store order (TSO) and this "
                        "host is {machine}")
    OVER_CAP = 43, "its workspace ({nbytes:,d} B) passes rs_workspace_cap_mib"

    def says(self, **facts) -> RsRefusal:
        """This reason with its facts filled in."""
        return RsRefusal(self, self.text.format(**facts))


@dataclasses.dataclass(frozen=True)
class RsRefusal:
    """A reason and the sentence a person reads (``str()`` gives the sentence)."""

    code: RsReason
    text: str

    def __str__(self) -> str:
        return self.text
