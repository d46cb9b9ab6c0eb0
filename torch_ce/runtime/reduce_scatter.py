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
                copy the slice for j into j's recv[h, i], set j's data[h, i]
  complete (its wait: ``wait_tensor`` on CUDA, at once on the host)
    2. wait     for each peer j: wait data[h, j] (j pushed i's slice)
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
thread, NOTE [reduce-scatter watchdog]), and its peers' waits end too. A bucket whose slice
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
    ce_bytes: int = 0  # input bytes reduced without the collective
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
    RW.note_group(ranks, pg)
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
        if x.dtype not in DTYPES or x.dtype != inputs[0].dtype or x.device != inputs[0].device:
            raise ReduceScatterError(
                f"torch_ce: magi::ce_reduce_scatter of {name}: inputs must share one device and one "
                f"dtype of {[str(d) for d in DTYPES]}, got {[(str(t.dtype), str(t.device)) for t in inputs]}")
        if x.dim() == 0 or x.shape[0] % group_size:
            raise ReduceScatterError(
                f"torch_ce: magi::ce_reduce_scatter of {name}: an input of shape {tuple(x.shape)} "
                f"does not split in {group_size} equal chunks along dim 0")


def _collective(inputs, reduce_op, group_size, group_name) -> list[torch.Tensor]:
    outs = []
    for x in inputs:
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
    def wait(ws, kind: int, half: int, peer: int, what: str) -> None:
        RW.wait_flag(ws, kind, half, peer, what)

    @staticmethod
    def signal(ws, peer: int, kind: int, half: int, sender: int) -> None:
        ws.peer_flags[peer][kind, half, sender] = 1


class _Cuda:
    """Flags are words of the symmetric workspaces; the current stream waits and writes
    them (NOTE [stream flags] in csrc/ce_ops.cu), never an SM kernel."""

    @staticmethod
    def wait(ws, kind: int, half: int, peer: int, what: str) -> None:
        from . import native

        addr = ws.flags[kind, half, peer].data_ptr()
        native.stream_wait_value32(addr, 1)
        native.stream_write_value32(addr, 0)

    @staticmethod
    def signal(ws, peer: int, kind: int, half: int, sender: int) -> None:
        from . import native

        native.stream_write_value32(ws.peer_flags[peer][kind, half, sender].data_ptr(), 1)


# ---------------------------------------------------------------------------------------
# One call: launch, then complete
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Call:
    """One reduce-scatter between its launch and its completion (its wait)."""

    ws: RW.Workspace
    half: int
    inputs: list  # held until the completion: nothing may reuse them before
    flat: list
    ns: list
    outs: list
    reduce_op: str
    what: str
    name: str
    nbytes: int
    pushed: object = None  # CUDA: the event after the pushes
    done: object = None  # CUDA: the event after the completion
    completed: bool = False


_pending: dict[tuple, dict[int, Call]] = {}  # pool key -> half -> its call owed a completion


def _streams(device: torch.device) -> tuple:
    s = _STREAMS.get(device.index)
    if s is None:
        s = _STREAMS[device.index] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
    return s


_STREAMS: dict = {}


def launch(ws: RW.Workspace, inputs: Sequence[torch.Tensor], reduce_op: str, name: str) -> Call:
    """Step 1 (module NOTE), and the outputs allocated; a half still owed a completion
    by this rank is completed first."""
    w, i = ws.group_size, ws.index
    owed = _pending.get(ws.key, {}).pop(ws.calls % 2, None)
    if owed is not None:
        complete(owed)
    h = ws.calls % 2
    ws.calls += 1
    flat = [x.contiguous().view(-1) for x in inputs]
    ns = [f.numel() // w for f in flat]
    outs = [torch.empty((x.shape[0] // w, *x.shape[1:]), dtype=x.dtype, device=x.device) for x in inputs]
    call = Call(ws, h, list(inputs), flat, ns, outs, reduce_op,
                f"reduce-scatter {name} (call {ws.calls} of group {list(ws.key[0])})", name,
                sum(f.numel() for f in flat) * inputs[0].element_size())
    cuda = inputs[0].is_cuda
    T = _Cuda if cuda else _Host
    if cuda:
        copy_stream, _ = _streams(inputs[0].device)
        copy_stream.wait_stream(torch.cuda.current_stream())
        ctx = torch.cuda.stream(copy_stream)
    else:
        ctx = _nullcontext()
    with ctx:
        for k in range(1, w):
            j = (i + k) % w
            T.wait(ws, FREE, h, j, call.what)
            dst, off = ws.peer_recv[j][h, i], 0
            for f, n in zip(flat, ns, strict=True):
                dst[off:off + n].copy_(f[j * n:(j + 1) * n], non_blocking=True)
                off += n
            T.signal(ws, j, DATA, h, i)
        if cuda:
            call.pushed = torch.cuda.Event()
            call.pushed.record()
    _pending.setdefault(ws.key, {})[h] = call
    return call


def complete(call: Call) -> None:
    """Steps 2-4 (module NOTE); on CUDA enqueued on the reduce stream, its event in
    ``call.done``. Idempotent."""
    if call.completed:
        return
    call.completed = True
    ws, h, w, i = call.ws, call.half, call.ws.group_size, call.ws.index
    pend = _pending.get(ws.key, {})
    if pend.get(h) is call:
        del pend[h]
    cuda = call.outs[0].is_cuda
    T = _Cuda if cuda else _Host
    if cuda:
        _, reduce_stream = _streams(call.outs[0].device)
        reduce_stream.wait_event(call.pushed)  # after the launch's current stream, and the pushes
        ctx = torch.cuda.stream(reduce_stream)
    else:
        ctx = _nullcontext()
    with ctx:
        for k in range(1, w):
            T.wait(ws, DATA, h, (i + k) % w, call.what)
        off = 0
        for f, n, out in zip(call.flat, call.ns, call.outs, strict=True):
            srcs = [f[i * n:(i + 1) * n] if j == i else ws.recv[h, j, off:off + n] for j in range(w)]
            _reduce(srcs, out.view(-1), call.reduce_op, w)
            off += n
        for k in range(1, w):
            T.signal(ws, (i + k) % w, FREE, h, i)
        if cuda:
            call.done = torch.cuda.Event()
            call.done.record()
            _watch(call)


def _reduce(srcs: list, out: torch.Tensor, reduce_op: str, w: int) -> None:
    """``out`` = the sum of ``srcs`` in their order (group index order), in fp32."""
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
    if not _WORK:
        _WORK.append(_work_class())
    work = _WORK[0](call)
    for o in call.outs:
        torch._C._distributed_c10d._register_work(o, work)
    _live_works[id(work)] = work
    if len(_live_works) > 4096:  # never waited (direct use without wait_tensor): forget the oldest
        _live_works.pop(next(iter(_live_works)))


# NOTE [reduce-scatter watchdog]
# A GPU stream wait has no timeout of its own. Each completed call's event goes to one
# watchdog thread per process, which polls it (cudaEventQuery: no sync) while it is not
# done; one past ``rs_timeout_s`` is logged as an error naming the bucket and the peers
# it waits for, and the next reduce-scatter on this rank raises that error (the stream
# stays blocked: like NCCL's watchdog, the job must then be torn down). Not under CUDA-graph
# capture: a captured event is not queried, and a replay runs no host code.
_watch_lock = threading.Lock()
_watched: list = []  # (deadline, event, what) of completions not yet seen done
_failed: list[str] = []
_watcher: list = []  # the running thread, if any
_stopping = threading.Event()


def _watch(call: Call) -> None:
    if torch.cuda.is_current_stream_capturing():
        return
    from ..config import config

    with _watch_lock:
        _watched.append((time.monotonic() + float(config.rs_timeout_s), call.done, call.what))
        if not _watcher or not _watcher[0].is_alive():
            t = threading.Thread(target=_watchdog, name="torch_ce_rs_watchdog", daemon=True)
            _watcher[:] = [t]
            t.start()


def _watchdog() -> None:
    """Runs while some completion is pending; ends when none is (``_watch`` starts it
    again) or at interpreter exit (no CUDA call may run during teardown)."""
    while not _stopping.wait(0.05):
        with _watch_lock:
            items = list(_watched)
        pending = []
        for item in items:
            deadline, ev, what = item
            try:
                if ev.query():
                    continue
            except Exception:  # noqa: BLE001 (a failed context: reported as not done)
                pass
            if time.monotonic() > deadline:
                msg = (f"torch_ce: {what}: a peer did not push its slice (or free a half) within "
                       "rs_timeout_s; the GPU stream is still waiting (a rank that crashed, hangs, or "
                       "runs other graphs than its peers?)")
                log.error("%s", msg)
                _failed.append(msg)
                continue
            pending.append(item)
        with _watch_lock:
            seen = {id(x) for x in items}
            _watched[:] = [x for x in _watched if id(x) not in seen] + pending
            if not _watched:
                _watcher.clear()
                return


def _stop_watchdog() -> None:
    _stopping.set()
    t = _watcher[0] if _watcher else None
    if t is not None:
        t.join(timeout=1.0)


atexit.register(_stop_watchdog)


# ---------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------

def reduce_scatter(inputs: Sequence[torch.Tensor], reduce_op: str, group_size: int,
                   group_name: str, name: str = "") -> list[torch.Tensor]:
    """A bucket's reduce-scatter (NOTE [copy-engine reduce-scatter]): one output per input,
    ``[rows / group_size, ...]``, this rank's chunk summed over the group."""
    name = name or f"a bucket of {len(inputs)} input(s)"
    _check(inputs, reduce_op, group_size, name)
    if _failed:
        raise ReduceScatterError(_failed[0])
    if group_size == 1:
        return [x.clone() for x in inputs]
    ranks, i = _group(group_name, group_size, name)
    dev = inputs[0].device
    need = sum(x.numel() for x in inputs) // group_size
    nbytes = sum(x.numel() for x in inputs) * inputs[0].element_size()
    if dev.type == "cuda" and not _has_flags():  # the same build on every rank: the same verdict
        _note(name, nbytes, False, "the C++ library (csrc/ce_ops.cu) with the stream flag ops is not "
                                   "built or not loaded")
        return _collective(inputs, reduce_op, group_size, group_name)
    ws = RW.get(ranks, i, inputs[0].dtype, dev, need, name)
    if ws is None:
        cap = RW.workspace_bytes(group_size, need, inputs[0].dtype)
        _note(name, nbytes, False, f"its workspace ({cap:,d} B) passes rs_workspace_cap_mib")
        return _collective(inputs, reduce_op, group_size, group_name)
    call = launch(ws, inputs, reduce_op, name)
    if dev.type == "cpu":
        complete(call)
    else:
        _register(call)
    _note(name, nbytes, True)
    return call.outs


def _has_flags() -> bool:
    from . import native

    return native.has_stream_flags()


def release() -> None:
    RW.release()
    served.clear()
    _pending.clear()
    _live_works.clear()
