"""The protocol's steps in Python (NOTE [copy-engine reduce-scatter] in
runtime/reduce_scatter/__init__.py), over one transport's flag primitives: the host
transport's path, and on CUDA (``config.rs_native=False``) the reference the native path
is tested against, bit for bit.

The primitives: ``flags.HostFlags`` (words of the shared mappings, plain stores, a bounded
poll) and ``CudaFlags`` (words of the symmetric workspaces, stream memory operations on
the current stream). On CUDA the pushes run on the device's copy stream, the completion
on its reduce stream (``Workspace.streams``), with an event after each.
"""
from __future__ import annotations

import contextlib

import torch

from .. import native
from .call import Call, Stage
from .flags import DATA, FREE, HostFlags
from .spec import premul_factor
from .watchdog import watch


class CudaFlags:
    """Flags are words of the symmetric workspaces; the current stream waits and writes
    them (NOTE [stream flags] in csrc/ce_flags.cu), never an SM kernel."""

    @staticmethod
    def wait(ws, kind: int, half: int, peer: int, call: Call) -> None:
        expect = call.tag if kind == DATA else 1
        addr = ws.flags[kind, half, peer].data_ptr()
        native.stream_wait_value32(addr, expect)  # EQ: another call's tag never satisfies it
        native.stream_write_value32(addr, 0)
        call.waits.append((kind, half, peer, expect))

    @staticmethod
    def signal_free(ws, peer: int, half: int, sender: int) -> None:
        native.stream_write_value32(ws.peer_flags[peer][FREE, half, sender].data_ptr(), 1)

    @staticmethod
    def signal_data(ws, peer: int, half: int, sender: int, call: Call) -> None:
        head = ws.peer_head[peer][half, sender]
        native.stream_write_value32(head[0].data_ptr(), call.seq)
        native.stream_write_value32(head[1].data_ptr(), call.numel)
        # Default flags: a memory barrier before the write, on the stream that pushed, so
        # the slice and the header are visible before the tag (NOTE [stream flags]).
        native.stream_write_value32(ws.peer_flags[peer][DATA, half, sender].data_ptr(), call.tag)


def push(call: Call) -> None:
    """Step 1: for each peer j from i+1 on, wait its free flag of the call's half, copy
    j's slice (each input's chunk j, back to back) into j's receive half, write the header
    and the tag. CUDA: on the copy stream, after the current stream (the gradient is
    ready); ``call.pushed`` after."""
    ws, h = call.ws, call.half
    w, i = ws.group_size, ws.index
    cuda = call.inputs[0].is_cuda
    T = CudaFlags if cuda else HostFlags
    if cuda:
        copy_stream, _ = ws.streams
        copy_stream.wait_stream(torch.cuda.current_stream())
        ctx = torch.cuda.stream(copy_stream)
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        for k in range(1, w):
            j = (i + k) % w
            T.wait(ws, FREE, h, j, call)
            dst, off = ws.peer_recv[j][h, i], 0
            for f, n in zip(call.flat, call.ns, strict=True):
                dst[off:off + n].copy_(f[j * n:(j + 1) * n], non_blocking=True)
                off += n
            T.signal_data(ws, j, h, i, call)
        if cuda:
            call.pushed = torch.cuda.Event()
            call.pushed.record()


def complete(call: Call) -> None:
    """Steps 2-4: wait for every peer's push of this call, reduce, free the peers' halves.
    CUDA: enqueued on the reduce stream after the pushes, ``call.done`` after; the call is
    watched from before its waits are enqueued (a host thread that then blocks, as the
    first launch of a kernel behind a blocked wait does while CUDA's lazy loading waits for
    the device, is released by the watchdog all the same)."""
    ws, h, w, i = call.ws, call.half, call.ws.group_size, call.ws.index
    cuda = call.outs[0].is_cuda
    T = CudaFlags if cuda else HostFlags
    if cuda:
        _, reduce_stream = ws.streams
        reduce_stream.wait_event(call.pushed)  # after the launch's current stream, and the pushes
        ctx = torch.cuda.stream(reduce_stream)
        call.done = torch.cuda.Event()
        watch(call)
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        for k in range(1, w):  # every sender checked before anything is reduced
            T.wait(ws, DATA, h, (i + k) % w, call)
        off = 0
        for f, n, out in zip(call.flat, call.ns, call.outs, strict=True):
            srcs = [f[i * n:(i + 1) * n] if j == i else ws.recv[h, j, off:off + n] for j in range(w)]
            _reduce(srcs, out.view(-1), call.reduce_op, w)
            off += n
        for k in range(1, w):
            T.signal_free(ws, (i + k) % w, h, i)
        if cuda:
            call.done.record()
    call.stage = Stage.RECORDED if cuda else Stage.DONE


def _reduce(srcs: list, out: torch.Tensor, reduce_op: str, w: int) -> None:
    """``out`` = the sum of ``srcs`` in their order (group index order), in fp32;
    ``premul_sum(f)``: of each source times f, rounded to fp32 before the sum (as the
    collective's premultiplied sum, so two sources are bit-identical to it)."""
    factor = premul_factor(reduce_op)
    if factor is not None:
        acc = srcs[0].to(torch.float32) * factor
        for s in srcs[1:]:
            acc.add_(s.to(torch.float32) * factor)
        out.copy_(acc)
        return
    if out.dtype == torch.float32:
        torch.add(srcs[0], srcs[1], out=out)
        for s in srcs[2:]:
            out.add_(s)
        if reduce_op == "avg":
            out.div_(w)
        return
    acc = srcs[0].to(torch.float32)
    for s in srcs[1:]:
        acc.add_(s)
    if reduce_op == "avg":
        acc.div_(w)
    out.copy_(acc)


def reduce_fallback(owns, outs, recv_half: torch.Tensor, index: int, offs, op: int, factor: float) -> None:
    """``torch_ce::rs_reduce_fallback``: the native completion's reduction in a library
    built without nvcc (the Triton kernel, runtime/reduce_scatter/reduce_triton.py; without
    Triton, ``_reduce``), on the current stream (the C++ completion's reduce stream)."""
    from . import reduce_triton

    if owns and owns[0].is_cuda and reduce_triton.unavailable() is None:
        reduce_triton.reduce(owns, outs, recv_half, index, offs, op, factor)
        return
    w = recv_half.shape[0]
    reduce_op = {0: "sum", 1: "avg"}.get(op) or f"premul_sum({factor!r})"
    for own, out, off in zip(owns, outs, offs, strict=True):
        n = out.numel()
        srcs = [own if j == index else recv_half[j, off:off + n] for j in range(w)]
        _reduce(srcs, out.view(-1), reduce_op, w)
