"""Launch a call on a workspace, complete it, and give its outputs a c10d work.

``launch`` first completes the call still owed on its half (``Workspace.owed``: NOTE
[copy-engine reduce-scatter], "where the waits sit"), then runs step 1 on one of two paths,
the same protocol on the same words:

- native: on CUDA under ``config.rs_native`` (and a library that has it) the C++ launch and
  completion (NOTE [native reduce-scatter path] in csrc/ce_reduce_scatter.cu); Python keeps
  the half, the sequence number, the tag, the owed completion and the watch;
- Python (reference.py): the host transport, and CUDA with ``rs_native`` off.

``complete`` runs steps 2-4 once; on CUDA a graph's ``wait_tensor`` runs it through the
outputs' c10d work (``register``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...config import config
from .. import native
from . import reference
from .call import Call, NativeDone, Stage
from .flags import ReduceScatterError, call_tag
from .spec import Spec, op_code, spec_of
from .watchdog import watch
from .workspace import Workspace


def launch(ws: Workspace, inputs: Sequence[torch.Tensor], reduce_op: str, name: str,
           spec: Spec | None = None, outs: Sequence[torch.Tensor] | None = None,
           register: bool = False) -> Call:
    """Step 1, and the outputs allocated (or ``outs``, contiguous, one per input: FSDP2's
    own); a half still owed a completion by this rank is completed first. A pool whose last
    call failed raises (its error) and is dropped: the next call opens a new generation.
    ``spec``: the bucket's (``spec_of``, made here when not given); ``register`` (native
    path): the C++ launch also puts the call's work on the outputs."""
    if ws.failed:
        ws.drop()
        raise ReduceScatterError(ws.failed)
    h = ws.calls % 2
    owed = ws.owed.pop(h, None)
    if owed is not None:
        complete(owed)
    ws.calls += 1
    spec = spec or spec_of(inputs, reduce_op, ws.group_size, name)
    tag = call_tag(ws.calls, spec.sig, name)
    if inputs[0].is_cuda and native_path():
        call = _launch_native(ws, h, tag, inputs, reduce_op, name, spec, outs, register)
    else:
        call = _launch_python(ws, h, tag, inputs, reduce_op, name, spec, outs)
    ws.owed[h] = call
    return call


def native_path() -> bool:
    """The C++ launch and completion serve CUDA calls now (same build and config on every
    rank: every rank takes the same path; both paths speak the same protocol anyway)."""
    return bool(config.rs_native) and native.has_rs_native()


def _launch_native(ws: Workspace, h: int, tag: int, inputs, reduce_op: str, name: str, spec: Spec, outs,
                   register: bool) -> Call:
    op, factor = op_code(reduce_op)
    cxx, outs = native.rs_launch(ws.native, inputs, [] if outs is None else outs, h, ws.calls, spec.need, tag,
                                 op, factor, register)
    call = Call(ws, h, list(inputs), [], [], list(outs), reduce_op,
                name, spec.need * ws.group_size * inputs[0].element_size(), seq=ws.calls, numel=spec.need,
                tag=tag, native=cxx, registered=register)
    call.done = NativeDone(cxx)
    watch(call, started=False)
    return call


def _launch_python(ws: Workspace, h: int, tag: int, inputs, reduce_op: str, name: str, spec: Spec, outs) -> Call:
    if ws.poison is not None:  # only the native completion's kernel reads the poison word
        raise ReduceScatterError(f"torch_ce: reduce-scatter {name}: a workspace with host-mapped flags "
                                 "needs the native path (config.rs_native and the C++ reduction kernel)")
    w = ws.group_size
    flat = [x.contiguous().view(-1) for x in inputs]
    ns = [f.numel() // w for f in flat]
    if outs is None:
        outs = [torch.empty((x.shape[0] // w, *x.shape[1:]), dtype=x.dtype, device=x.device) for x in inputs]
    call = Call(ws, h, list(inputs), flat, ns, list(outs), reduce_op,
                name, sum(f.numel() for f in flat) * inputs[0].element_size(),
                seq=ws.calls, numel=spec.need, tag=tag)
    reference.push(call)
    return call


def complete(call: Call, wait_current: bool = False) -> None:
    """Steps 2-4; on CUDA enqueued on the reduce stream, its event in ``call.done``.
    Idempotent. ``wait_current`` (CUDA): the current stream then waits for it (the native
    path: in the same C++ call)."""
    if call.stage >= Stage.COMPLETING:
        return
    call.stage = Stage.COMPLETING
    owed = call.ws.owed
    if owed.get(call.half) is call:
        del owed[call.half]
    if call.native is not None:  # the C++ completion (idempotent: its work's wait may have run it)
        native.rs_complete(call.native, wait_current)
        return
    reference.complete(call)
    if wait_current and call.done is not None:
        torch.cuda.current_stream().wait_event(call.done)


# ---------------------------------------------------------------------------------------
# CUDA: the outputs' c10d work
# ---------------------------------------------------------------------------------------

def register(call: Call) -> None:
    """The call's work on its outputs: their ``wait_tensor`` completes the call."""
    if call.native is not None:  # the C++ work (rs_launch registers it when asked to)
        if not call.registered:
            native.rs_register(call.native)
            call.registered = True
        return
    if not _WORK:
        _WORK.append(_work_class())
    work = _WORK[0](call)
    for o in call.outs:
        torch._C._distributed_c10d._register_work(o, work)
    _live_works[id(work)] = work
    if len(_live_works) > 4096:  # never waited (direct use without wait_tensor): forget the oldest
        _live_works.pop(next(iter(_live_works)))


def _work_class():
    from torch._C._distributed_c10d import Work

    class CompletionWork(Work):
        """``wait_tensor`` on an output: complete the call (step 2-4 enqueued now, after
        whatever the graph put before this wait), then the consumer's stream waits."""

        def __init__(self, call: Call):
            super().__init__()
            self.call = call
            self.done = None
            self.left = len(call.outs)  # waits to come (one per output)

        def wait(self, timeout=None) -> bool:  # noqa: ARG002
            call = self.call
            if call is not None:  # the first wait of any of the call's outputs
                complete(call)
                self.done = call.done
                self.call = None  # the tensors go when the consumer is done with them
            torch.cuda.current_stream().wait_event(self.done)  # every wait, on its own stream
            self.left -= 1
            if self.left <= 0:  # the registry holds it no more: Python need not either
                _live_works.pop(id(self), None)
            return True

    return CompletionWork


_WORK = []  # the Work class, made once (c10d's Work is imported on first use)
# id -> each Python-path Work not yet waited: c10d's registry (process-wide) holds the Work,
# not its Python object, so this keeps that alive until its last wait.
_live_works: dict[int, object] = {}


def release() -> None:
    """Forget the works not waited (torch_ce.release_all)."""
    _live_works.clear()
