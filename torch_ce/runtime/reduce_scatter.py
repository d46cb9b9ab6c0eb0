"""What magi::ce_reduce_scatter[_coalesced] do: push, signal, wait, one reduction.

# NOTE [copy-engine reduce-scatter]
A gradient reduce-scatter of a bucket over a group of W ranks, rank i (its index in the
group), without a collective and without a barrier (the workspaces and flags: NOTE
[reduce-scatter workspaces] in rs_workspace.py). Each input is cut in W equal chunks
along dim 0, as ``reduce_scatter_tensor`` does; a bucket's slice for rank j is its
inputs' chunks j, back to back. Call n of the pool uses half h = n % 2, in two phases:

  launch (the op)
    1. push     for each peer j, from i+1 on (so the ranks do not all start at rank 0):
                wait free[h, j] (j reduced what i pushed into its half h two calls ago),
                copy the slice for j into j's recv[h, i], write (seq, numel) into j's
                head[h, i], set j's data[h, i] to the call's tag
  complete (its wait: ``wait_tensor`` on CUDA, at once on the host)
    2. wait     for each peer j: wait data[h, j] == this call's tag (j pushed i's slice
                of this call; another value is another call's push: an error naming
                both, NOTE [reduce-scatter workspaces]), before anything is reduced
    3. reduce   output = sum over group index 0, 1, ..., W-1 of chunk i, this rank's own
                read in place from its input (never copied), the peers' from recv[h, j];
                in fp32 (bf16 inputs: rounded once at the end); ``avg`` divides by W after
    4. free     for each peer j: set j's free[h, i]

Nothing waits for anything but (a) the data the reduction needs and (b) a half a peer has
not finished with. The summation order is fixed (group index order) and the same on every
rank, so results are deterministic run to run; at W = 2 a sum of two is order-free, so
they are bit-identical to the collective's.

Where the waits sit (CUDA): a stream wait blocks every later piece of work on its hardware
queue, and with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream shares one queue. So a wait
is enqueued only behind what satisfies it, on any rank: a rank enqueues its push of a call
before its wait for that call (the data wait is enqueued at the output's ``wait_tensor``,
after the compute the graph put before it, not at the launch), and a launch whose half
is still owed a completion by this rank (two calls launched, neither waited) completes
that call first, in program order, the same on every rank. Every wait then depends only
on work its peers enqueued before their own matching wait: no cycle, whatever the queues.

CUDA streams: the push on a copy stream (after the current stream: the gradient is ready),
the completion on a reduce stream (the pushes' copy stream, then the data waits, the
reduction kernels, the free writes), an event after it that ``wait_tensor`` makes the
consumer's stream wait on. The inputs and outputs are held by the call until its wait, so
no allocator or Inductor reuse can overwrite them (the lowering also marks the inputs
never reused). Under CUDA-graph capture nothing else changes: the flags are reset by their
waiters, so a replay starts from the state the capture started from.

Every rank runs every step; a peer that never pushes is a ``ReduceScatterError`` naming
the bucket and the peer within ``rs_timeout_s`` (host: the flag poll; CUDA: the watchdog
thread releases the stream, NaN outputs, and the next call raises: NOTE [reduce-scatter
watchdog]), and its peers' waits end too (the generation's abort, the retracted pushes).
A failure drops the pool on the rank that sees it; the next call opens a new generation
(NOTE [reduce-scatter workspaces]). A bucket whose slice
does not fit a workspace under ``rs_workspace_cap_mib`` runs the group's collective
instead, on every rank (the sizes are the same on all), and says so once per bucket.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from typing import Sequence

import torch

from ..config import config
from . import native
from . import rs_workspace as RW
from .rs_workspace import DATA, FREE, RETRACT, ReduceScatterError

log = logging.getLogger("torch_ce")

REDUCE_OPS = ("sum", "avg", "premul_sum(<factor>)")
DTYPES = (torch.float32, torch.bfloat16)
_FUNCTIONAL = torch.ops._c10d_functional


@dataclasses.dataclass
class Served:
    """What one bucket's reduce-scatters did in this process (explain() reads it)."""

    name: str
    calls: int = 0
    ce_bytes: int = 0  # input bytes reduced without the collective
    collective_bytes: int = 0
    reason: str = ""  # why a call ran on the collective


served: dict[str, Served] = {}


_groups: dict = {}  # group name -> (its process group, its ranks, this rank's index)


def _group(group_name: str, group_size: int, name: str) -> tuple[tuple, int]:
    """(the group's ranks, this rank's index), cached per name while the name resolves to
    the same process group (a group made again under an old name is looked up again)."""
    try:
        pg = torch._C._distributed_c10d._resolve_process_group(group_name)
    except RuntimeError as e:
        raise ReduceScatterError(
            f"torch_ce: magi::ce_reduce_scatter of {name} got group {group_name!r}, which is not a "
            "live process group on this rank") from e
    known = _groups.get(group_name)
    if known is None or known[0] is not pg:
        import torch.distributed as dist

        ranks = tuple(dist.get_process_group_ranks(pg))
        known = _groups[group_name] = (pg, ranks, ranks.index(dist.get_rank()))
    ranks = known[1]
    RW.note_group(ranks, pg)
    if len(ranks) != group_size:
        raise ReduceScatterError(f"torch_ce: magi::ce_reduce_scatter of {name}: group_size "
                                 f"{group_size} but group {group_name!r} has ranks {list(ranks)}")
    return ranks, known[2]


def premul_factor(reduce_op: str) -> float | None:
    """The factor of ``"premul_sum(<factor>)"`` (FSDP2's ``ReduceOp.PREMUL_SUM``: every
    rank's input times the factor, then summed), None for another op."""
    if reduce_op.startswith("premul_sum(") and reduce_op.endswith(")"):
        try:
            return float(reduce_op[len("premul_sum("):-1])
        except ValueError:
            return None
    return None


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


_specs: dict = {}  # a checked call's inputs (shape, dtype, device each), op, group size -> _spec


def _spec(inputs: Sequence[torch.Tensor], reduce_op: str, group_size: int, name: str) -> tuple:
    """(per-rank elements, input bytes, signature: ``RW.signature``) of a call whose inputs
    pass ``_check``; cached by what ``_check`` reads, so a bucket is checked and its
    signature built once, not at every call."""
    key = (tuple([(x.shape, x.dtype, x.device) for x in inputs]), reduce_op, group_size)
    spec = _specs.get(key)
    if spec is None:
        _check(inputs, reduce_op, group_size, name)
        if len(_specs) > 4096:
            _specs.clear()
        numel = sum(x.numel() for x in inputs)
        sig = RW.signature(inputs, reduce_op, group_size) if group_size > 1 else None
        _specs[key] = spec = (numel // group_size, numel * inputs[0].element_size(), sig)
    return spec


def _collective(inputs, reduce_op, group_size, group_name) -> list[torch.Tensor]:
    outs = []
    factor = premul_factor(reduce_op)
    for x in inputs:
        if factor is not None:  # the functional collective has no premul: scale, then sum
            x, reduce_op = x * factor, "sum"
        out = _FUNCTIONAL.reduce_scatter_tensor(x.contiguous(), reduce_op, group_size, group_name)
        if x.device.type == "cpu":
            out = _FUNCTIONAL.wait_tensor(out)  # NOTE [gloo: one functional collective in flight]
        outs.append(out)
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


# ---------------------------------------------------------------------------------------
# The flag and copy primitives of each transport
# ---------------------------------------------------------------------------------------

class _Host:
    """Flags are words of the shared mappings; the host polls them (bounded)."""

    @staticmethod
    def wait(ws, kind: int, half: int, peer: int, call: "Call") -> None:
        RW.wait_flag(ws, kind, half, peer, call.what, call.tag if kind == DATA else 1, call.seq, call.numel)

    @staticmethod
    def signal_free(ws, peer: int, half: int, sender: int) -> None:
        ws.peer_flags[peer][FREE, half, sender] = 1

    @staticmethod
    def signal_data(ws, peer: int, half: int, sender: int, call: "Call") -> None:
        head = ws.peer_head[peer][half, sender]
        head[0] = call.seq
        head[1] = call.numel
        ws.peer_flags[peer][DATA, half, sender] = call.tag  # after the slice and the header (TSO)


class _Cuda:
    """Flags are words of the symmetric workspaces; the current stream waits and writes
    them (NOTE [stream flags] in csrc/ce_ops.cu), never an SM kernel."""

    @staticmethod
    def wait(ws, kind: int, half: int, peer: int, call: "Call") -> None:
        expect = call.tag if kind == DATA else 1
        addr = ws.flags[kind, half, peer].data_ptr()
        native.stream_wait_value32(addr, expect)  # EQ: another call's tag never satisfies it
        native.stream_write_value32(addr, 0)
        call.waits.append((kind, half, peer, expect))

    @staticmethod
    def signal_free(ws, peer: int, half: int, sender: int) -> None:
        native.stream_write_value32(ws.peer_flags[peer][FREE, half, sender].data_ptr(), 1)

    @staticmethod
    def signal_data(ws, peer: int, half: int, sender: int, call: "Call") -> None:
        head = ws.peer_head[peer][half, sender]
        native.stream_write_value32(head[0].data_ptr(), call.seq)
        native.stream_write_value32(head[1].data_ptr(), call.numel)
        # Default flags: a memory barrier before the write, on the stream that pushed, so
        # the slice and the header are visible before the tag (NOTE [stream flags]).
        native.stream_write_value32(ws.peer_flags[peer][DATA, half, sender].data_ptr(), call.tag)


# ---------------------------------------------------------------------------------------
# One call: launch, then complete
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class Call:
    """One reduce-scatter between its launch and its completion (its wait)."""

    ws: RW.Workspace
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
    tag: int = 0  # its data flags' value (rs_workspace.call_tag)
    pushed: object = None  # CUDA: the event after the pushes
    done: object = None  # CUDA: the event after the completion
    completed: bool = False
    recorded: bool = False  # CUDA: ``done`` recorded (the watchdog watches the call from before)
    waits: list = dataclasses.field(default_factory=list)  # CUDA: (kind, half, peer, value) enqueued
    native: object = None  # rs_native: the C++ call (NOTE [native reduce-scatter path]); ``done`` then a _NativeDone
    registered: bool = False  # rs_native: its c10d work is on its outputs

    @property
    def what(self) -> str:
        """The call as its errors name it (built only for an error: not per call)."""
        return (f"reduce-scatter {self.name} (call {self.seq} of generation {self.ws.gen} of group "
                f"{list(self.ws.key[0])})")


_pending: dict[tuple, dict[int, Call]] = {}  # (pool key, generation) -> half -> its call owed a completion


def _streams(device: torch.device) -> tuple:
    s = _STREAMS.get(device.index)
    if s is None:
        s = _STREAMS[device.index] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
    return s


_STREAMS = RW.STREAMS


def launch(ws: RW.Workspace, inputs: Sequence[torch.Tensor], reduce_op: str, name: str,
           sig: tuple | None = None, outs: Sequence[torch.Tensor] | None = None,
           register: bool = False) -> Call:
    """Step 1 (module NOTE), and the outputs allocated (or ``outs``, contiguous, one per
    input: FSDP2's own); a half still owed a completion by this rank is completed first. A pool whose last call failed raises (its error) and
    is dropped: the next call opens a new generation. On CUDA under ``config.rs_native``
    (and a library that has it) the C++ launch runs it (NOTE [native reduce-scatter path]
    in csrc/ce_ops.cu); ``register``: it also puts the call's work on the outputs."""
    if ws.failed:
        RW.drop(ws)
        raise ReduceScatterError(ws.failed)
    w, i = ws.group_size, ws.index
    pkey = (ws.key, ws.gen)
    owed = _pending.get(pkey, {}).pop(ws.calls % 2, None)
    if owed is not None:
        complete(owed)
    h = ws.calls % 2
    ws.calls += 1
    numel, sig_text = sig or _spec(inputs, reduce_op, w, name)[2]
    if inputs[0].is_cuda and _native():
        return _launch_native(ws, inputs, reduce_op, name, numel, sig_text, outs, register, pkey, h)
    if ws.poison is not None:  # only the native completion's kernel reads the poison word
        raise ReduceScatterError(f"torch_ce: reduce-scatter {name}: a workspace with host-mapped flags "
                                 "needs the native path (config.rs_native and the C++ reduction kernel)")
    flat = [x.contiguous().view(-1) for x in inputs]
    ns = [f.numel() // w for f in flat]
    if outs is None:
        outs = [torch.empty((x.shape[0] // w, *x.shape[1:]), dtype=x.dtype, device=x.device) for x in inputs]
    call = Call(ws, h, list(inputs), flat, ns, list(outs), reduce_op,
                name, sum(f.numel() for f in flat) * inputs[0].element_size(),
                seq=ws.calls, numel=numel, tag=RW.call_tag(ws.calls, sig_text))
    cuda = inputs[0].is_cuda
    T = _Cuda if cuda else _Host
    if cuda:
        _prepare_watch(ws)  # before this call's waits: it allocates pinned memory
        copy_stream, _ = _streams(inputs[0].device)
        copy_stream.wait_stream(torch.cuda.current_stream())
        ctx = torch.cuda.stream(copy_stream)
    else:
        ctx = _nullcontext()
    with ctx:
        for k in range(1, w):
            j = (i + k) % w
            T.wait(ws, FREE, h, j, call)
            dst, off = ws.peer_recv[j][h, i], 0
            for f, n in zip(flat, ns, strict=True):
                dst[off:off + n].copy_(f[j * n:(j + 1) * n], non_blocking=True)
                off += n
            T.signal_data(ws, j, h, i, call)
        if cuda:
            call.pushed = torch.cuda.Event()
            call.pushed.record()
    _pending.setdefault(pkey, {})[h] = call
    return call


def complete(call: Call, wait_current: bool = False) -> None:
    """Steps 2-4 (module NOTE); on CUDA enqueued on the reduce stream, its event in
    ``call.done``. Idempotent. ``wait_current`` (native calls only): the current stream
    then waits for it, in the same C++ call."""
    if call.completed:
        return
    call.completed = True
    ws, h, w, i = call.ws, call.half, call.ws.group_size, call.ws.index
    pend = _pending.get((ws.key, ws.gen), {})
    if pend.get(h) is call:
        del pend[h]
    if call.native is not None:  # the C++ completion (idempotent: its work's wait may have run it)
        native.rs_complete(call.native, wait_current)
        return
    cuda = call.outs[0].is_cuda
    T = _Cuda if cuda else _Host
    if cuda:
        _, reduce_stream = _streams(call.outs[0].device)
        reduce_stream.wait_event(call.pushed)  # after the launch's current stream, and the pushes
        ctx = torch.cuda.stream(reduce_stream)
        call.done = torch.cuda.Event()
        # Watched before its waits are enqueued: a host thread that then blocks (the first
        # launch of a kernel behind a blocked wait loads its module, and CUDA's lazy loading
        # waits for the device) is released by the watchdog all the same.
        _watch(call)
    else:
        ctx = _nullcontext()
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
            call.recorded = True


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


# ---------------------------------------------------------------------------------------
# rs_native: the launch and completion in C++ (NOTE [native reduce-scatter path] in
# csrc/ce_ops.cu); Python keeps the half, the sequence number, the tag, the owed
# completion and the watchdog
# ---------------------------------------------------------------------------------------

def _native() -> bool:
    """The C++ launch and completion serve CUDA calls now (same build and config on every
    rank: every rank takes the same path; both paths speak the same protocol anyway)."""
    return bool(config.rs_native) and native.has_rs_native()


_OP_CODES: dict = {}


def _op_code(reduce_op: str) -> tuple[int, float]:
    code = _OP_CODES.get(reduce_op)
    if code is None:
        factor = premul_factor(reduce_op)
        code = (native.RS_PREMUL, factor) if factor is not None else (native.RS_OPS[reduce_op], 1.0)
        _OP_CODES[reduce_op] = code
    return code


def _native_workspace(ws: RW.Workspace):
    """Once per workspace: every address the C++ launch and completion touch, as plain
    integers (the same words ``_Cuda`` reads and writes), and the copy and reduce streams."""
    w, i = ws.group_size, ws.index
    if ws.recv.stride() != (w * ws.cap, ws.cap, 1):  # the kernel finds sender j's slice by stride
        raise ReduceScatterError(f"torch_ce: rs_native: a receive workspace of strides {ws.recv.stride()}, "
                                 f"expected {(w * ws.cap, ws.cap, 1)}")
    halves = (0, 1)

    def table(f):
        return [0 if f(h, j) is None else int(f(h, j).data_ptr()) for h in halves for j in range(w)]

    peer = lambda t: (lambda h, j: None if j == i else t(h, j))  # noqa: E731
    addrs = (table(lambda h, j: ws.flags[DATA, h, j]) + table(lambda h, j: ws.flags[FREE, h, j])
             + table(peer(lambda h, j: ws.peer_flags[j][DATA, h, i]))
             + table(peer(lambda h, j: ws.peer_flags[j][FREE, h, i]))
             + table(peer(lambda h, j: ws.peer_head[j][h, i, 0]))
             + table(peer(lambda h, j: ws.peer_head[j][h, i, 1]))
             + table(peer(lambda h, j: ws.peer_recv[j][h, i]))
             + table(lambda h, j: ws.recv[h, j]))
    if ws.poison is not None:  # host-mapped flags: the kernel reads each half's poison word
        addrs += [int(ws.poison[0].data_ptr()), int(ws.poison[1].data_ptr())]
    copy_stream, reduce_stream = _streams(ws.recv.device)
    ws.native = native.rs_workspace(addrs, w, i, ws.cap, ws.dtype, ws.recv.device.index,
                                    copy_stream.cuda_stream, reduce_stream.cuda_stream)
    return ws.native


class _NativeDone:
    """A native call's done event, as much of a ``torch.cuda.Event`` as its users need:
    ``query()`` (the watchdog), ``wait(stream)`` (``Stream.wait_event``)."""

    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle

    def query(self) -> bool:
        return native.rs_query(self.handle) == 3

    def wait(self, stream=None) -> None:
        stream = stream if stream is not None else torch.cuda.current_stream()
        native.rs_stream_wait(self.handle, stream.cuda_stream)


def _launch_native(ws, inputs, reduce_op, name, numel, sig_text, outs, register, pkey, h) -> Call:
    _prepare_watch(ws)  # before this call's waits: it allocates pinned memory
    handle = ws.native if ws.native is not None else _native_workspace(ws)
    seq = ws.calls
    tag = RW.call_tag(seq, sig_text)
    op, factor = _op_code(reduce_op)
    cxx, outs = native.rs_launch(handle, inputs, [] if outs is None else outs, h, seq, numel, tag, op,
                                 factor, register)
    w = ws.group_size
    call = Call(ws, h, list(inputs), [], [], list(outs), reduce_op,
                name, numel * w * inputs[0].element_size(), seq=seq, numel=numel, tag=tag,
                recorded=True, native=cxx, registered=register)
    call.done = _NativeDone(cxx)
    _watch(call, started=False)
    _pending.setdefault(pkey, {})[h] = call
    return call


def reduce_fallback(owns, outs, recv_half: torch.Tensor, index: int, offs, op: int, factor: float) -> None:
    """``torch_ce::rs_reduce_fallback``: the native completion's reduction in a library
    built without nvcc (the Triton kernel, runtime/reduce_triton.py; without Triton,
    ``_reduce``), on the current stream (the C++ completion's reduce stream)."""
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


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------
# CUDA: the outputs' c10d work, and the watchdog
# ---------------------------------------------------------------------------------------

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


_WORK = []
_live_works: dict[int, object] = {}  # keeps each Python Work alive until its wait


def _register(call: Call) -> None:
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


# NOTE [reduce-scatter watchdog]
# A GPU stream wait has no timeout of its own. Each completed call goes to one watchdog
# thread per process, which polls its event (cudaEventQuery: no sync) while it is not done,
# and, every quarter second, the store for its generation's abort (off the call's path). A
# call past ``rs_timeout_s``, or whose generation a peer aborted, is released:
#   1. it reads the call's flag and header words (a copy on a side stream, bounded) to name
#      the peer that did not push, or the other call a peer pushed (the wait is EQ on the
#      tag, so another call's push is stuck here too);
#   2. it marks the pool failed, posts the generation's abort and logs the error; then it
#      fills the peers' slices of the call in this rank's half with NaN and writes each
#      awaited flag's value itself (``host_write_words``: from the host, asynchronously, on
#      a non-blocking stream of its own: what released a blocked wait in
#      bench/results/run59_rs_integrity_h200.log, where a synchronous memset queued behind
#      the blocked work and a synchronous copy blocked its caller), so the stream goes on:
#      the call's outputs are NaN, never a plausible wrong sum;
#   3. unless a peer pushed another call (a mismatch: that peer sees it too), it writes
#      RETRACT into the peers' data flags of the call (a peer that has not consumed this
#      rank's push fails the call too). The next reduce-scatter on the pool raises the
#      error naming the bucket and the peer and drops the pool (the one after opens a new
#      generation; ``release_all()`` drops every pool).
# A call is watched from before its waits are enqueued, and the pinned memory the watchdog
# reads into is allocated before any of the workspace's waits: a page-locked allocation, or
# the first launch of a kernel (CUDA's lazy module loading), behind a blocked wait can block
# the host thread that makes it (the probe's first run hung there), and the watchdog still
# releases the call. The release ran end to end on an H200 under the default queues (run
# 60); under CUDA_DEVICE_MAX_CONNECTIONS=1 the own-stream writes queue behind the blocked
# wait, so there the workspace's words are host-mapped (runtime/rs_host_flags.py) and the
# release is host stores: the call's tag into its half's poison word, then the awaited
# flags; the reduction kernel behind the waits reads the poison and writes NaN (NOTE
# [poison word] in csrc/ce_ops.cu; run 66: released at rs_timeout_s). The watchdog's thread
# runs in CUDA's relaxed stream-capture mode: its event queries would otherwise invalidate
# a CUDA graph another thread captures in the default (global) mode (run 61: bench/
# rs_cost.py's capture failed so; test_capture_while_the_watchdog_polls).
# A host blocked in ``torch.cuda.synchronize()`` (or ``loss.item()``) therefore returns
# within ``rs_timeout_s`` plus the poll; what it computed from the call is NaN.
# Not under CUDA-graph capture: a captured event is not queried and a replay runs no host
# code, so nothing covers a dead peer there but the job's own teardown (the launcher's
# timeout, or an NCCL collective's watchdog); a replay whose peer is gone blocks its stream.
_watch_lock = threading.Lock()
_watched: list = []  # [deadline, call] of completions not yet seen done
_watcher: list = []  # the running thread, if any
_stopping = threading.Event()
_NAN = {torch.float32: (0x7FC00000, 4), torch.bfloat16: (0x7FC0, 2)}
# How the watchdog writes a flag word: 2 cuMemsetD32Async, 3 cuStreamWriteValue32, both on
# the library's own non-blocking stream (both released a blocked wait in run 59).
_FLAG_WRITE = 2


def _watch(call: Call, started: bool = True) -> None:
    """Watch ``call`` from now; ``started=False`` (a native call, at its launch): from when
    the watchdog first sees its completion begun (the C++ stage 1, set before its first
    wait is enqueued), which is when the Python path starts watching a call."""
    if torch.cuda.is_current_stream_capturing():
        return
    with _watch_lock:
        _watched.append([time.monotonic() + float(config.rs_timeout_s) if started else None, call])
        if not _watcher or not _watcher[0].is_alive():
            t = threading.Thread(target=_watchdog, name="torch_ce_rs_watchdog", daemon=True)
            _watcher[:] = [t]
            t.start()


def _prepare_watch(ws: RW.Workspace) -> None:
    """Once per workspace, before any of its waits is enqueued: the watchdog's side
    stream and pinned copies of the flags (a page-locked allocation may wait for the
    device, so the watchdog never makes one, and none is made behind a blocked wait)."""
    if ws.host_words is not None or ws.poison is not None or torch.cuda.is_current_stream_capturing():
        return  # (host-mapped flags are read in place)
    dev = ws.recv.device
    side = _SIDE.get(dev.index)
    if side is None:
        side = _SIDE[dev.index] = torch.cuda.Stream(device=dev)
    ws.host_words = (side, torch.empty(ws.flags.shape, dtype=torch.int32, pin_memory=True),
                     torch.empty(ws.head.shape, dtype=torch.int32, pin_memory=True))


def _watchdog() -> None:
    """Runs while some completion is pending; ends when none is (``_watch`` starts it
    again) or at interpreter exit (no CUDA call may run during teardown).

    It leaves ``_watcher`` only after its last reference to a call is gone: a call's last
    reference dropped here runs its handle's ``rs_forget``, an op that runs without the GIL
    and takes it back to free the call's tensors; at interpreter exit the atexit join
    (``_stop_watchdog``) must still see this thread then, or the finalizing interpreter
    ends it inside that op (std::terminate: run 69's probe aborted so at exit)."""
    # Its event queries run while the user may capture a CUDA graph in another thread: in
    # CUDA's default (global) mode they would invalidate that capture.
    try:
        native.relax_thread_capture_mode()
    except Exception as e:  # noqa: BLE001 (logged: the watchdog must run)
        log.warning("torch_ce: the reduce-scatter watchdog keeps CUDA's global capture mode: %s", e)
    next_abort = time.monotonic() + RW._ABORT_EVERY_S
    while not _stopping.wait(0.02):
        now = time.monotonic()
        look = now >= next_abort
        if look:
            next_abort = now + RW._ABORT_EVERY_S
        _watch_tick(now, look)  # the tick's references to calls die with its frame
        with _watch_lock:
            if not _watched:
                _watcher.clear()
                return


def _watch_tick(now: float, look: bool) -> None:
    """One pass of the watchdog over the watched calls: the done ones leave, the overdue
    (or failed, or given up on by a peer: ``look``) are released, the rest stay."""
    with _watch_lock:
        items = list(_watched)
    pending = []
    stages = iter(_native_stages([item[1].native for item in items if item[1].native is not None]))
    for item in items:
        deadline, call = item
        if call.native is not None:  # its stage (3: done), all of a tick's in one query
            stage = next(stages)
            if stage == 3:
                continue
            if deadline is None:  # watched from its completion on
                if stage == 0:  # its completion not enqueued: not watched yet (a failed
                    pending.append(item)  # pool's too: a later wait still gets released)
                    continue
                item[0] = deadline = now + float(config.rs_timeout_s)
        else:
            try:
                if call.recorded and call.done.query():
                    continue
            except Exception:  # noqa: BLE001 (a failed context: reported as not done)
                pass
        ws = call.ws
        why = None
        if ws.failed:
            why = ws.failed  # another call of the pool was released: this one goes too
        elif now > deadline:
            why = "timeout"
        elif look:
            msg = RW._aborted(ws.key[0], ws.gen)
            if msg is not None:
                why = f"a peer gave up: {msg}"
        if why is not None:
            try:
                _release(call, why)
            except Exception as e:  # noqa: BLE001 (logged: the watchdog must go on)
                log.error("torch_ce: %s: releasing its stream failed: %s", call.what, e)
            continue
        pending.append(item)
    with _watch_lock:
        seen = {id(x) for x in items}
        _watched[:] = [x for x in _watched if id(x) not in seen] + pending


_SIDE: dict = {}  # device index -> the watchdog's side stream (its reads)


def _waits(call: Call) -> list:
    """What the call's stream waits for, in stream order: (kind, half, peer, value). The
    Python path records them as it enqueues them; the C++ launch and completion wait for
    each peer's free flag, then each peer's data flag (its tag), peers in ring order."""
    if call.native is None:
        return call.waits
    w, i, h = call.ws.group_size, call.ws.index, call.half
    peers = [(i + k) % w for k in range(1, w)]
    return [(FREE, h, j, 1) for j in peers] + [(DATA, h, j, call.tag) for j in peers]


def _native_stages(handles: list) -> list:
    """Native calls' stages (``native.rs_stages``: 0 launched, 1 completion being enqueued,
    2 its done event recorded, 3 done) in one op call; a failed query counts as begun and
    not done (1), so the deadlines run."""
    if not handles:
        return []
    try:
        return native.rs_stages(handles)
    except Exception:  # noqa: BLE001
        return [1] * len(handles)


def _read_words(ws: RW.Workspace) -> tuple | None:
    """This rank's flags and header as host lists, by a copy on a side stream, or None
    when that copy does not finish within a second (diagnostics only); host-mapped flags
    in place (under one queue a side-stream copy would wait behind the blocked wait)."""
    if ws.poison is not None:
        return ws.flags.tolist(), ws.head.tolist()
    if ws.host_words is None:
        return None
    try:
        side, flags, head = ws.host_words
        with torch.cuda.stream(side):
            flags.copy_(ws.flags, non_blocking=True)
            head.copy_(ws.head, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        t0 = time.monotonic()
        while not ev.query():
            if time.monotonic() - t0 > 1.0:
                return None
            time.sleep(0.001)
        return flags.tolist(), head.tolist()
    except Exception:  # noqa: BLE001
        return None


def _release(call: Call, why: str) -> None:
    """NOTE [reduce-scatter watchdog], steps 1-3: name, poison and release, fail."""
    ws = call.ws
    ranks, h = ws.key[0], call.half
    with torch.cuda.device(ws.recv.device):
        words = _read_words(ws)
        stuck = [(k, j, v) for k, hh, j, v in _waits(call) if hh == h]
        names = []
        for kind, j, value in stuck:  # a data flag of 0: not pushed (a consumed one is also 0:
            if kind != DATA:          # the peers named are those the call may still wait for)
                continue
            seen = words[0][kind][h][j] if words else None
            if seen == RETRACT:
                names.append(f"rank {ranks[j]} gave up on this call")
            elif seen not in (None, 0, value):
                pseq, pnumel = words[1][h][j]
                names.append(f"rank {ranks[j]} pushed another call (its call {pseq}, {pnumel} elements "
                             f"per rank, where this rank runs its call {call.seq}, {call.numel} elements "
                             "per rank: the ranks run different reduce-scatters here)")
            elif seen != value:
                names.append(f"rank {ranks[j]} did not push its slice")
        mismatch = any("pushed another call" in n for n in names)
        if not names:
            names = [f"rank {ranks[j]} did not free its receive half (or push its slice)"
                     for k, j, _ in stuck if k == FREE]
        if why == "timeout":
            why = f"not done within {float(config.rs_timeout_s):g} s (rs_timeout_s)"
        msg = (f"torch_ce: {call.what}: {why}; " + ("; ".join(names) or f"waiting for ranks "
               f"{[ranks[j] for _, j, _ in stuck]}") + ". The stream was released and the call's "
               "outputs are NaN (a rank that crashed, hangs, or runs other graphs than its peers?)")
        if not ws.failed:  # before the stream goes on: a host that returns from a sync sees it
            ws.failed = msg
        RW.post_abort(ranks, ws.gen, f"rank {ranks[ws.index]}: {msg}")
        log.error("%s", msg)
        if ws.poison is not None:
            _release_host_flags(ws, call, stuck, mismatch)
        else:
            _release_device_flags(ws, call, stuck, mismatch)
        t0 = time.monotonic()
        while not (call.recorded and call.done.query()) and time.monotonic() - t0 < 2.0:
            time.sleep(0.002)
        if not (call.recorded and call.done.query()):
            log.error("torch_ce: %s: the watchdog's writes did not release the stream within 2 s",
                      call.what)


def _release_host_flags(ws: RW.Workspace, call: Call, stuck: list, mismatch: bool) -> None:
    """Host-mapped flags (NOTE [poison word] in csrc/ce_ops.cu): host stores, the call's tag
    into its half's poison word first (x86 store order), so the reduction kernel behind the
    waits writes NaN; then the awaited flags; then RETRACT into the peers' data flags."""
    h = call.half
    ws.poison[h] = call.tag
    for kind, j, value in stuck:
        ws.flags[kind, h, j] = value
    for j in range(ws.group_size):  # a mismatch is symmetric: the peer sees it too
        if j != ws.index and not mismatch:
            ws.peer_flags[j][DATA, h, ws.index] = RETRACT


def _release_device_flags(ws: RW.Workspace, call: Call, stuck: list, mismatch: bool) -> None:
    """Device flags: NaN into the call's receive slices, then the awaited flags, from the
    host on the library's own stream; both asynchronous (measured: a synchronous write
    queues behind the blocked stream or blocks its caller), so the watchdog never blocks."""
    h = call.half
    fill, width = _NAN[ws.dtype]
    for kind, j, value in stuck:  # stream order: the launch's free waits, then the data waits
        rc = 0
        if kind == DATA:
            rc = native.host_write_words(ws.recv[h, j].data_ptr(), fill, call.numel, width, 2)
        rc = rc or native.host_write_words(ws.flags[kind, h, j].data_ptr(), value, 1, 4, _FLAG_WRITE)
        if rc:
            raise ReduceScatterError(f"torch_ce: {call.what}: the watchdog's write failed (CUresult {rc})")
    for j in range(ws.group_size):  # a mismatch is symmetric: the peer sees it too
        if j != ws.index and not mismatch:
            try:
                native.host_write_words(ws.peer_flags[j][DATA, h, ws.index].data_ptr(), RETRACT, 1, 4, 2)
            except Exception:  # noqa: BLE001 (a peer's memory may be gone with it)
                pass


def _stop_watchdog() -> None:
    """At exit, before the interpreter finalizes: the watchdog ends its tick (a release
    waits at most ~3 s: ``_read_words`` and ``_release``'s own bounds) and is joined."""
    _stopping.set()
    t = _watcher[0] if _watcher else None
    if t is not None:
        t.join(timeout=5.0)


atexit.register(_stop_watchdog)


# ---------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------

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
    need, nbytes, sig = _spec(inputs, reduce_op, group_size, name)
    if outs is not None and (len(outs) != len(inputs) or any(
            not o.is_contiguous() or o.dtype != x.dtype or o.numel() * group_size != x.numel()
            for o, x in zip(outs, inputs))):
        raise ReduceScatterError(f"torch_ce: reduce-scatter of {name}: outs must be contiguous, one "
                                 f"per input, of its dtype and 1/{group_size} of its elements")
    if group_size == 1:
        factor = premul_factor(reduce_op)
        res = [x * factor if factor is not None else x.clone() for x in inputs]
        return _into(outs, res)
    ranks, i = _group(group_name, group_size, name)
    dev = inputs[0].device
    why = ""
    if dev.type == "cuda" and not _has_flags():  # the same build on every rank: the same verdict
        why = "the C++ library (csrc/ce_ops.cu) with the stream flag ops is not built or not loaded"
    elif dev.type == "cuda":
        why = RW.one_queue_refusal()
    elif dev.type == "cpu":
        why = RW.host_order_refusal()  # the same host kind on every rank of a host job
    ws = None
    if not why:
        ws = RW.get(ranks, i, inputs[0].dtype, dev, need, name, sig[1])
        if ws is None:
            cap = RW.workspace_bytes(group_size, need, inputs[0].dtype)
            why = f"its workspace ({cap:,d} B) passes rs_workspace_cap_mib"
    if why:
        _note(name, nbytes, False, why)
        res = _collective(inputs, reduce_op, group_size, group_name)
        if outs is not None:
            res = [_FUNCTIONAL.wait_tensor(r) for r in res]
        return _into(outs, res)
    call = launch(ws, inputs, reduce_op, name, sig, outs, register=outs is None)
    if dev.type == "cpu":
        complete(call)
    elif outs is not None and call.native is not None:
        complete(call, wait_current=True)  # the C++ completion, and the current stream waits for it
    elif outs is not None:
        complete(call)
        torch.cuda.current_stream().wait_event(call.done)
    else:
        _register(call)
    _note(name, nbytes, True)
    return call.outs


def _into(outs, res: list) -> list:
    if outs is None:
        return res
    for o, r in zip(outs, res):
        o.copy_(r.view(o.shape))
    return list(outs)


def _has_flags() -> bool:
    return native.has_stream_flags()


def release() -> None:
    RW.release()
    served.clear()
    _groups.clear()
    _pending.clear()
    _live_works.clear()
    with _watch_lock:
        _watched.clear()
