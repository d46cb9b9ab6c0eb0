"""The reduce-scatter's source of the stream watchdog (NOTE [the stream watchdog] in
runtime/watchdog.py): it releases a CUDA stream whose reduce-scatter wait no peer will
satisfy.

# NOTE [reduce-scatter watchdog]
A GPU stream wait has no timeout of its own. Each completed call goes to the stream
watchdog's thread (one per process, shared with FSDP2's training gathers), which polls its
event (cudaEventQuery: no sync) while it is not done, and, every quarter second, the store
for its group's generation's abort (off the call's path: NOTE [sessions: one abort per
group generation] in runtime/session.py; the watchdog is this protocol's poll). A call past ``rs_timeout_s``, or whose generation ended (a peer
aborted it, in any protocol, or this rank gave it up), is released:
  1. it reads the call's flag and header words (a copy on a side stream, bounded) to name
     the peer that did not push, or the other call a peer pushed (the wait is EQ on the
     tag, so another call's push is stuck here too);
  2. it marks the pool failed, gives up on the generation (its abort: every other wait of
     the generation, in every protocol and on every rank, ends) and logs the error; then it
     fills the peers' slices of the call in this rank's half with NaN and writes each
     awaited flag's value itself (``host_write_words``: from the host, asynchronously, on
     a non-blocking stream of its own; a synchronous memset would queue behind the
     blocked work, and a synchronous copy would block its caller), so the stream goes on:
     the call's outputs are NaN, never a plausible wrong sum;
  3. unless a peer pushed another call (a mismatch: that peer sees it too), it writes
     RETRACT into the peers' data flags of the call (a peer that has not consumed this
     rank's push fails the call too). The next reduce-scatter on the pool raises the
     error naming the bucket and the peer and drops the pool (the one after opens a new
     generation; ``release_all()`` drops every pool).
A call is watched from before its waits are enqueued, and the pinned memory the watchdog
reads into is allocated with the workspace, before any of its waits: a page-locked
allocation, or the first launch of a kernel (CUDA's lazy module loading), behind a blocked
wait can block the host thread that makes it, and the watchdog still releases the call.
Under CUDA_DEVICE_MAX_CONNECTIONS=1 the own-stream writes queue behind the blocked wait, so
there the workspace's words are host-mapped (runtime/reduce_scatter/host_flags.py) and the
release is host stores: the call's tag into its half's poison word, then the awaited
flags; the reduction kernel behind the waits reads the poison and writes NaN (NOTE
[poison word] in csrc/ce_flags.cu). The thread runs in CUDA's relaxed stream-capture
mode (test_capture_while_the_watchdog_polls).
A host blocked in ``torch.cuda.synchronize()`` (or ``loss.item()``) therefore returns
within ``rs_timeout_s`` plus the poll; what it computed from the call is NaN.
Not under CUDA-graph capture: a captured event is not queried and a replay runs no host
code, so nothing covers a dead peer there but the job's own teardown (the launcher's
timeout, or an NCCL collective's watchdog); a replay whose peer is gone blocks its stream.

The watched calls are one list per process, not a workspace's: one thread watches the
calls of every pool.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from ...config import config
from .. import native
from .. import watchdog as WD
from ..session import describe
from .call import Call, Stage
from .flags import DATA, FREE, RETRACT, ReduceScatterError, peer_call, post_call

log = logging.getLogger("torch_ce")

_watch_lock = threading.Lock()
_watched: list = []  # [deadline, call] of completions not yet seen done
_watcher = WD._watcher  # the stream watchdog's thread, if it runs (tests look)
_stop_watchdog = WD._stop_watchdog
# How the watchdog writes a flag word: 2 cuMemsetD32Async, 3 cuStreamWriteValue32, both on
# the library's own non-blocking stream (either releases a blocked wait).
_FLAG_WRITE = 2


def watch(call: Call, started: bool = True) -> None:
    """Watch ``call`` from now; ``started=False`` (a native call, at its launch): from when
    the watchdog first sees its completion begun (``Stage.COMPLETING``, set in C++ before
    its first wait is enqueued), which is when the Python path starts watching a call."""
    if torch.cuda.is_current_stream_capturing():
        return
    with _watch_lock:
        _watched.append([time.monotonic() + float(config.rs_timeout_s) if started else None, call])
    WD.wake(_tick)


def _tick(now: float, look: bool) -> bool:
    """The stream watchdog's source (NOTE [the stream watchdog] in runtime/watchdog.py):
    one pass over the watched calls; whether any is still pending."""
    _watch_tick(now, look)  # the tick's references to calls die with its frame
    with _watch_lock:
        return bool(_watched)


def _watch_tick(now: float, look: bool) -> None:
    """One pass of the watchdog over the watched calls: the done ones leave, the overdue
    (or failed, or given up on by a peer: ``look``) are released, the rest stay."""
    with _watch_lock:
        items = list(_watched)
    pending = []
    stages = iter(_native_stages([item[1].native for item in items if item[1].native is not None]))
    for item in items:
        deadline, call = item
        if call.native is not None:  # its stage, all of a tick's in one query
            stage = next(stages)
            if stage == Stage.DONE:
                continue
            if deadline is None:  # watched from its completion on
                if stage == Stage.LAUNCHED:  # its completion not enqueued: not watched yet (a
                    pending.append(item)  # failed pool's too: a later wait still gets released)
                    continue
                item[0] = deadline = now + float(config.rs_timeout_s)
        else:
            try:
                if call.is_done():
                    continue
            except Exception:  # noqa: BLE001 (a failed context: reported as not done)
                pass
        ws = call.ws
        why = None
        if ws.failed:
            why = ws.failed  # another call of the pool was released: this one goes too
        elif ws.session.failed:  # the group's generation ended here (another protocol's failure)
            why = ws.session.failed
        elif now > deadline:
            why = "timeout"
        elif look:
            rec = ws.session.aborted()
            if rec is not None:
                why = describe(rec)
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


def _native_stages(handles: list) -> list:
    """Native calls' stages (``Stage``) in one op call (``native.rs_stages``); a failed
    query counts as begun and not done (``COMPLETING``), so the deadlines run."""
    if not handles:
        return []
    try:
        return native.rs_stages(handles)
    except Exception:  # noqa: BLE001
        return [Stage.COMPLETING] * len(handles)


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
                post_call(ws, call.seq, call.name, call.numel)
                theirs = peer_call(ws, pseq, j)
                theirs = f"{theirs}, " if theirs else ""
                names.append(f"rank {ranks[j]} pushed another call (its call {pseq}, {theirs}{pnumel} elements "
                             f"per rank, where this rank runs its call {call.seq}, {call.name}, {call.numel} "
                             "elements per rank: the ranks run different reduce-scatters here)")
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
        ws.session.fail(ranks[ws.index], "reduce_scatter", msg)
        log.error("%s", msg)
        if ws.poison is not None:
            _release_host_flags(ws, call, stuck, mismatch)
        else:
            _release_device_flags(ws, call, stuck, mismatch)
        t0 = time.monotonic()
        while not call.is_done() and time.monotonic() - t0 < 2.0:
            time.sleep(0.002)
        if not call.is_done():
            log.error("torch_ce: %s: the watchdog's writes did not release the stream within 2 s",
                      call.what)


def _read_words(ws) -> tuple | None:
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


def _waits(call: Call) -> list:
    """What the call's stream waits for, in stream order: (kind, half, peer, value). The
    Python path records them as it enqueues them; the C++ launch and completion wait for
    each peer's free flag, then each peer's data flag (its tag), peers in ring order."""
    if call.native is None:
        return call.waits
    w, i, h = call.ws.group_size, call.ws.index, call.half
    peers = [(i + k) % w for k in range(1, w)]
    return [(FREE, h, j, 1) for j in peers] + [(DATA, h, j, call.tag) for j in peers]


def _release_host_flags(ws, call: Call, stuck: list, mismatch: bool) -> None:
    """Host-mapped flags (NOTE [poison word] in csrc/ce_flags.cu): host stores, the call's tag
    into its half's poison word first (x86 store order), so the reduction kernel behind the
    waits writes NaN; then the awaited flags; then RETRACT into the peers' data flags."""
    h = call.half
    ws.poison[h] = call.tag
    for kind, j, value in stuck:
        ws.flags[kind, h, j] = value
    for j in range(ws.group_size):  # a mismatch is symmetric: the peer sees it too
        if j != ws.index and not mismatch:
            ws.peer_flags[j][DATA, h, ws.index] = RETRACT


def _release_device_flags(ws, call: Call, stuck: list, mismatch: bool) -> None:
    """Device flags: NaN into the call's receive slices, then the awaited flags, from the
    host on the library's own stream; both asynchronous (measured: a synchronous write
    queues behind the blocked stream or blocks its caller), so the watchdog never blocks."""
    h = call.half
    fill, width = WD.NAN_WORDS[ws.dtype]
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


def release() -> None:
    """Forget every watched call (torch_ce.release_all)."""
    with _watch_lock:
        _watched.clear()
