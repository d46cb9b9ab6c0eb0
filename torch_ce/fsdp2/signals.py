"""Step words: the one-sided signals of a training group's gathers.

# NOTE [FSDP2 training: step words]
In training the weights change at every optimizer step, wherever and however it runs, so a
training group does not read its peers' weights: each rank stages its chunk (FSDP2's own
all-gather input of the call, already cast and padded) into a staging buffer in its
window, and its peers read the buffer. Every rank numbers the group's gathers 1, 2, ...
(FSDP2 runs them in one order on every rank: its own path is a collective), and owns two
words in its window, each written by it alone:

    ready   the last call whose chunk is in this rank's staging buffer
    done    the last call whose reads of every peer's buffer this rank has finished

Call k of the group, on every rank:

    1. wait until every peer's done >= k - 1     (no peer still reads call k-1's bytes)
    2. buffer <- this call's chunk; ready = k
    3. per peer p (rotated order): wait until p's ready >= k, read p's buffer
    4. done = k

- Read after write: a rank reads p's buffer for call k only after p's ready reached k,
  which p stores after it wrote the chunk of call k; x86 keeps stores in order and loads in
  order (TSO), so the bytes are there. p cannot have moved on to call k+1's bytes: it
  writes them only after this rank's done reached k, which this rank stores after its
  reads (step 4 follows step 3).
- Write after read: a rank overwrites its buffer (call k) only after every peer's done
  reached k - 1, i.e. after every peer finished reading call k-1's bytes.
- No barrier: a rank waits only for the word that guards the bytes it touches next, each
  word has one writer, and nothing waits on a rank that is ahead. A late rank delays its
  peers by exactly what they need from it (its chunk, or its leaving theirs).
- No hang: every wait is the group session's (NOTE [sessions: one abort per group
  generation] in runtime/session.py): bounded by ``fsdp2_timeout_s`` (or
  ``enable(timeout_s=...)``); a peer that never arrives is a ``StepWordTimeout`` naming
  the group, the peer, the call and the word, posted as the generation's abort, and a
  failure of any other protocol of the group's generation (a copy-engine reduce-scatter
  of the same backward, an update round) ends the wait as well. The group is then
  poisoned on this rank (each later call raises the same).
Cost per call and group: one local copy of the chunk, two word stores, 2 (W-1) word
loads (a wait that is already satisfied is one load). On CUDA the same steps are stream
operations on words in host memory every rank maps, enqueued by one C++ call (NOTE [FSDP2
step words on CUDA] in csrc/ce_flags.cu, fsdp2/step_words.py): no host thread waits, and
the stream watchdog bounds the waits instead (NOTE [releasing a training gather]).
"""
from __future__ import annotations

import platform

import torch

from ..runtime import session as S
from ..runtime.session import PeerError

READY, DONE = 0, 1
_POLL_S = (0.0, 0.02)  # the first and the longest sleep between two loads


class StepWordTimeout(PeerError):
    """A peer did not reach a training gather's step word within the timeout."""


def unavailable(device: torch.device) -> str:
    """Why a training group on ``device`` cannot take the step words ("" when it can)."""
    if device.type == "cuda":  # NOTE [FSDP2 step words on CUDA] in csrc/ce_flags.cu
        from ..config import config
        from ..runtime import native

        if not native.has_step_gather():
            return ("training on CUDA: the C++ library has no step_gather (rebuild csrc/); FSDP2 "
                    "keeps its all-gather")
        if not config.host_transport:
            return ("training on CUDA: the step words live in host windows and config.host_transport "
                    "is off; FSDP2 keeps its all-gather")
        with torch.cuda.device(device):
            if native.stream_flags_info()[0] != 1:
                return ("training on CUDA: this device has no stream memory operations "
                        "(CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1); FSDP2 keeps its all-gather")
        return ""
    if device.type != "cpu":
        return f"training on {device.type}: no step words there; FSDP2 keeps its all-gather"
    m = platform.machine().lower()
    if m not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return (f"the step words rely on x86 store order (TSO) and this host is "
                f"{platform.machine()}: FSDP2 keeps its all-gather")
    return ""


def wait_at_least(words: torch.Tensor, which: int, value: int, timeout_s: float, what: str,
                  ranks: tuple, rank: int) -> None:
    """Wait until ``words[which] >= value`` (a peer's word, read from its window), through
    the group's live session (NOTE [sessions: one abort per group generation]): bounded by
    ``timeout_s``, ended by any failure of its generation."""
    if int(words[which]) >= value:
        return

    def late() -> str:
        name = "ready" if which == READY else "done"
        return (f"torch_ce.fsdp2: {what}: its '{name}' word stayed at {int(words[which])}, "
                f"below {value}, for {timeout_s:g} s (the peer crashed, hangs, or runs other "
                "FSDP2 gathers than this rank; fsdp2_timeout_s, or fsdp2.enable(timeout_s=...), "
                "sets the bound)")

    S.current(ranks).wait(lambda: int(words[which]) >= value, timeout_s=timeout_s,
                          what=f"torch_ce.fsdp2: {what}", error=StepWordTimeout,
                          protocol="step_words", rank=rank, on_timeout=late, poll=_POLL_S)


def post(words: torch.Tensor, which: int, value: int) -> None:
    """This rank's word ``which`` = ``value`` (its only writer)."""
    words[which] = value
