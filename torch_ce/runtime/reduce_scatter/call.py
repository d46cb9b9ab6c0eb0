"""One reduce-scatter call between its launch and its completion: its record and its stage.

``launch.py`` makes a ``Call`` and completes it, ``reference.py`` runs the Python path's
steps on it, and the watchdog (``watchdog.py``) reads its stage, its waits and its done
event. A call of the native path (NOTE [native reduce-scatter path] in
csrc/ce_reduce_scatter.cu) is a C++ object held by ``Call.native``; the C++ side reports
its stage (``native.rs_query``, ``native.rs_stages``) in the values of ``Stage``.
"""
from __future__ import annotations

import dataclasses
import enum

import torch

from .. import native
from .workspace import Workspace


class Stage(enum.IntEnum):
    """How far a call is (the values the C++ ``rs_query`` and ``rs_stages`` return)."""

    LAUNCHED = 0  # its pushes are done (host) or enqueued (CUDA); its completion has not begun
    COMPLETING = 1  # its completion is being run (host) or enqueued (CUDA): the waits come
    RECORDED = 2  # CUDA: the event after its completion is recorded (``Call.done``)
    DONE = 3  # its completion ran: the outputs hold its result


@dataclasses.dataclass(slots=True)
class Call:
    """One reduce-scatter between its launch and its completion (its wait)."""

    ws: Workspace
    half: int
    inputs: list  # held until the completion: nothing may reuse them before
    flat: list
    ns: list
    outs: list
    reduce_op: str
    name: str
    nbytes: int
    seq: int = 0  # the call's number in its pool's generation (1, 2, ...)
    numel: int = 0  # elements per rank
    tag: int = 0  # its data flags' value (flags.call_tag)
    pushed: object = None  # CUDA: the event after the pushes
    done: object = None  # CUDA: the event after the completion (native: a NativeDone)
    # The Python path's stage, as it runs its steps (the watchdog watches a CUDA call from
    # before its waits are enqueued); a native call's own is the C++ side's, and this one
    # says whether Python asked for its completion yet.
    stage: Stage = Stage.LAUNCHED
    waits: list = dataclasses.field(default_factory=list)  # CUDA: (kind, half, peer, value) enqueued
    native: object = None  # rs_native: the C++ call (NOTE [native reduce-scatter path])
    registered: bool = False  # rs_native: its c10d work is on its outputs

    @property
    def what(self) -> str:
        """The call as its errors name it (built only for an error: not per call)."""
        return (f"reduce-scatter {self.name} (call {self.seq} of workspace {self.ws.gen} of group "
                f"{list(self.ws.key[0])})")

    def is_done(self) -> bool:
        """Whether its completion ran on the device (CUDA; a query, never a wait)."""
        if self.native is None and self.stage < Stage.RECORDED:
            return False
        return self.done.query()


class NativeDone:
    """A native call's done event, as much of a ``torch.cuda.Event`` as its users need:
    ``query()`` (the watchdog), ``wait(stream)`` (``Stream.wait_event``)."""

    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle

    def query(self) -> bool:
        return native.rs_query(self.handle) == Stage.DONE

    def wait(self, stream=None) -> None:
        stream = stream if stream is not None else torch.cuda.current_stream()
        native.rs_stream_wait(self.handle, stream.cuda_stream)
