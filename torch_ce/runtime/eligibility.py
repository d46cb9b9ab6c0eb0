"""One eligibility predicate, with enumerated reasons, for the gate and for bind.

The gate (compile time, on FakeTensor meta values) and the bind (run time, on live shards)
ask the same question of a shard: can a symmetric window hold it and its peers read it?
``shard_refusal`` answers it for both from plain facts (device type, byte size,
contiguity, group size, the config), so the two can never disagree about a shard. What
only one side can see (the graph's shape around a gather; a DTensor's placements; a
peer's verdict) is refused with the other members of ``Reason`` by that side.

Every refusal carries a ``Reason`` (its ``code`` travels in the bind's agreement, so a
peer can say why it refused) and the text a person reads.
"""
from __future__ import annotations

import dataclasses
import enum


class Reason(enum.IntEnum):
    """Why a weight gather stays on the collective backend (codes are stable: they are
    exchanged between ranks)."""

    # Shard facts: shard_refusal (gate and bind alike).
    GROUP_OF_ONE = 1
    EMPTY = 2
    NON_CONTIGUOUS = 3
    DYNAMIC_SHAPE = 4
    CUDA_UNAVAILABLE = 5
    HOST_TRANSPORT_OFF = 6
    UNSUPPORTED_DEVICE = 7
    BELOW_MIN_SIZE = 8
    NO_GATHER_KERNEL = 9
    # Graph facts (gate only).
    TRAINING_GRAPH = 20
    MUTATING_GRAPH = 21
    NOT_A_PARAMETER = 22
    NOT_A_GRAPH_INPUT = 23
    CAST_BEFORE_GATHER = 24
    PAD_BEFORE_GATHER = 25
    VIEW_OR_COPY = 26
    UNEVEN_SHARD = 27
    NOT_SHARD0 = 28
    GATHER_OF_GATHER = 29
    NO_SINGLE_WAIT = 30
    NO_SHAPE = 31
    # Row gathers (gate only): why a weight read by embedding lookups is still gathered
    # in full (passes/rows.py). Its gathers stay ordinary CE gathers.
    ROWS_OTHER_READ = 32
    ROWS_MAX_NORM = 33
    ROWS_CAST = 35  # unused since a cast slot's rows are gathered; kept: codes stay
    # A weight gather whose result nothing reads: dropped on every rank (gate.unread).
    UNREAD = 36
    # A weight gathered by a bucketed collective of several weights (bucketed before the
    # gate saw it: graph_trainer's bucketing, Inductor's): counted, never served
    # (passes/census.py).
    BUCKETED = 37
    # A graph a trainer's pass pipeline ran without torch_ce's passes (torchtitan's
    # graph_trainer with its default pipeline while torch_ce is enabled): every weight
    # gather is counted with the option that turns them on (integrations/torchtitan.py).
    NOT_IN_PIPELINE = 38
    # A graph compiled with transport="nccl": torch_ce leaves it as it is and counts its
    # weight gathers as collective bytes (passes/manager.py).
    NCCL_TRANSPORT = 39
    # Placement and process-group facts (bind only).
    PLACEMENT = 40
    NO_GROUP = 41
    GROUP_SIZE_MISMATCH = 42
    FAKE_GROUP = 43
    TRAINED_WEIGHT = 44  # an inference graph's weight that a training graph stages
    # A window some rank could not read back through the gathers' copy path at bind (a
    # peer mapping that copies nothing or reads other memory): its pool's weights of that
    # bind stay on the collective (NOTE [peer read-back at bind] in runtime/readback.py).
    PEER_READBACK = 45
    # Agreement (bind only).
    DISAGREEMENT = 50
    PEER_REFUSED = 51
    # Anything a caller passes in as free text (a compile-time refusal read back at run
    # time, say).
    OTHER = 99


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A reason code and the sentence a person reads (``str()`` gives the sentence)."""

    code: Reason
    text: str

    def __str__(self) -> str:
        return self.text


def refusal(code: Reason, text: str) -> Refusal:
    return Refusal(code, text)


def shard_refusal(*, device_type: str, nbytes: int | None, numel: int | None, dim: int,
                  contiguous: bool, group_size: int, cfg, min_shard_bytes: int | None = None,
                  kernel_refusal=None) -> Refusal | None:
    """Why a shard with these facts cannot be bound into a window (None: it can).

    ``nbytes``/``numel`` are None for a dynamic shape; ``min_shard_bytes`` overrides the
    config's (``bind(..., min_shard_mib=...)``). ``kernel_refusal(device_type)`` (run
    time only) says whether a gather kernel exists for the device (runtime/native.py).
    """
    if group_size < 2:
        return refusal(Reason.GROUP_OF_ONE, "group of size 1: nothing to gather")
    if nbytes is None or numel is None:
        return refusal(Reason.DYNAMIC_SHAPE, "dynamic shard shape")
    if dim < 1 or numel == 0:
        return refusal(Reason.EMPTY, "empty or 0-d shard")
    if not contiguous:
        return refusal(Reason.NON_CONTIGUOUS, "non-contiguous shard")
    if device_type == "cpu":
        if not cfg.host_transport:
            return refusal(Reason.HOST_TRANSPORT_OFF,
                           "CPU tensor with the CUDA copy-engine transport (host transport off)")
    elif device_type != "cuda":
        return refusal(Reason.UNSUPPORTED_DEVICE, f"unsupported device {device_type}")
    min_bytes = cfg.min_shard_bytes if min_shard_bytes is None else min_shard_bytes
    if nbytes < min_bytes:
        return refusal(Reason.BELOW_MIN_SIZE,
                       f"shard below symm_min_shard_mib ({nbytes} B < {min_bytes} B)")
    if kernel_refusal is not None:
        why = kernel_refusal(device_type)
        if why is not None:
            return why
    return None


# A compile-time refusal travels to the run time as a plain string in the compiled graph
# (the bind / stage step's ``reasons``: cached code holds only rank-independent constants).
# Its code travels with it, so the run time reports the gate's reason, not OTHER.
_CODE_SEP = "|"


def encode(why: Refusal | None) -> str:
    """The string a compiled graph carries for ``why`` ("" when eligible)."""
    return "" if why is None else f"{int(why.code)}{_CODE_SEP}{why.text}"


def decode(s: str) -> Refusal | None:
    """``encode``'s inverse; a string without a code (older graphs, free text) is OTHER."""
    if not s:
        return None
    head, sep, text = s.partition(_CODE_SEP)
    if sep and head.isdigit():
        try:
            return Refusal(Reason(int(head)), text)
        except ValueError:
            pass
    return Refusal(Reason.OTHER, s)
