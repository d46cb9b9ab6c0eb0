"""FSDP2's training gathers on CUDA: the step words in host memory that every rank maps,
one C++ call per gather that enqueues its waits, copies and writes, and the stream
watchdog's source that releases a gather whose peer is gone.

The protocol is the host transport's (NOTE [FSDP2 training: step words] in
fsdp2/signals.py); on CUDA its waits and writes are stream operations (NOTE [FSDP2 step
words on CUDA] in csrc/ce_flags.cu), so no host thread waits and no kernel runs. The words
are bound like the CPU ones, into a host window of the group (POSIX shared memory, runtime/
host.py), and every rank's mapping of that window is registered with CUDA here (``hold``),
so the streams wait on and write to host memory, which a host store can release under
either queue setting.

# NOTE [releasing a training gather]
The host does not wait for a CUDA training gather, so a dead or diverged peer shows as a
stream that never goes on. After each call the group is watched (``watch``) until nothing
its stream enqueued can wait any more (its own ``ready`` word and every peer's reached the
last call enqueued). The stream watchdog (NOTE [the stream watchdog] in
runtime/watchdog.py) releases a group whose words did not move for its timeout
(``fsdp2_timeout_s``), or whose generation ended (a peer aborted it, in any protocol):
  1. it names the peers whose words stay below what the stream waits for, poisons the
     group (its next gather on this rank raises the error) and fails the generation (every
     other wait of the group's ranks, in every protocol, ends);
  2. with two or more hardware queues, it fills the peers' staging buffers with NaN and
     then writes the last call's number into their words, both on the library's own
     stream, in that order, so the released copies read NaN, never stale weights;
  3. it stores the last call's number into every peer's words from the host until the
     stream has gone through every enqueued call (a host store releases a wait under
     ``CUDA_DEVICE_MAX_CONNECTIONS=1``, where step 2's own stream queues behind the
     blocked wait and is skipped: there the released copies hold what the peer's buffer
     held, and this rank raises at its next gather).
"""
from __future__ import annotations

import dataclasses
import logging
import mmap
import threading
import time

import torch

from ..runtime import native
from ..runtime import session as S
from ..runtime import watchdog as WD
from ..runtime.watchdog import NAN_WORDS, one_queue
from ..runtime.session import describe
from .signals import DONE, READY

log = logging.getLogger("torch_ce")

_PAGE = mmap.PAGESIZE

# ---------------------------------------------------------------------------------------
# Host windows registered with CUDA
# ---------------------------------------------------------------------------------------

_lock = threading.Lock()
_held: dict = {}  # a mapping's base address -> [holders, its tensor (keeps it mapped)]
_later: list = []  # base addresses with no holder left: unregistered at the next ``flush``


def hold(words_slot) -> None:
    """Every rank's mapping of ``words_slot``'s host window registered with CUDA (mapped:
    the device address is the host one, checked), once per mapping, counted."""
    for t in words_slot.window.peer_locals:
        base = t.data_ptr()
        with _lock:
            e = _held.get(base)
            if e is not None:
                e[0] += 1
                if base in _later:
                    _later.remove(base)
                continue
        nbytes = -(-max(t.numel(), 1) // _PAGE) * _PAGE
        dptr = native.host_register(base, nbytes)
        if dptr != base:
            native.host_unregister(base)
            raise RuntimeError(
                f"torch_ce.fsdp2: the step words' host window at {base:#x} has the device address "
                f"{dptr:#x} (this device cannot use host pointers for registered memory): CUDA "
                "training gathers need it; enable(weights='static') or FSDP2's all-gather")
        with _lock:
            _held[base] = [1, t]


def let_go(bases: list) -> None:
    """A holder of these mappings is gone; the last one's unregistration waits for
    ``flush`` (a stream may still wait on them)."""
    with _lock:
        for base in bases:
            e = _held.get(base)
            if e is not None:
                e[0] -= 1
                if e[0] <= 0 and base not in _later:
                    _later.append(base)


def bases(words_slot) -> list:
    return [t.data_ptr() for t in words_slot.window.peer_locals]


def flush() -> int:
    """Unregister the mappings no holder is left of: call it only after this rank's device
    synchronized (no stream waits on them). Returns how many went."""
    with _lock:
        gone = [b for b in _later if _held.get(b, [1])[0] <= 0]
        _later[:] = [b for b in _later if b not in gone]
        entries = [_held.pop(b) for b in gone]
    for b in gone:
        native.host_unregister(b)
    del entries
    return len(gone)


def registered() -> int:
    """Mappings registered now (the lifetime tests')."""
    with _lock:
        return len(_held)


# ---------------------------------------------------------------------------------------
# One gather
# ---------------------------------------------------------------------------------------


class Registered:
    """A group's peer buffers and word addresses registered with the C++ side once (its
    ``id``; forgotten when this goes): what ``step_gather`` takes besides the call."""

    __slots__ = ("id", "__weakref__")

    def __init__(self, comm):
        words = comm.bound.words.peer_views
        views = comm.bound.slot.peer_views
        peers = list(comm.peers)
        item = words[0].element_size()

        def addr(r: int, which: int) -> int:
            return words[r].data_ptr() + which * item

        self.id = native.step_group([views[p] for p in peers], peers, [addr(p, READY) for p in peers],
                                    [addr(p, DONE) for p in peers], addr(comm.rank, READY), addr(comm.rank, DONE))

    def __del__(self):
        try:
            native.step_forget(self.id)
        except Exception:  # noqa: BLE001 (interpreter teardown: the library may be gone)
            pass


def gather(comm, out: torch.Tensor, input_tensor: torch.Tensor) -> None:
    """Call ``comm.calls + 1`` of a training group on CUDA: enqueued, then watched. Its
    first call registers the group and sets ``comm._fast``, which serves the next ones."""
    if comm._step_reg is None:
        comm._step_reg = Registered(comm)
    fast = fast_call(comm)
    fast(out, input_tensor)
    comm._fast = fast


def fast_call(comm):
    """A training group's call after its first (the comm's checks passed once; sizes and
    dtypes are checked in C++), with what it needs bound: a few microseconds of Python
    less than going through the comm each time."""
    op = native.step_gather_op()
    buffer, rid = comm.bound.buffer, comm._step_reg.id

    def call(out: torch.Tensor, input_tensor: torch.Tensor) -> None:
        if comm.poison:
            raise RuntimeError(comm.poison)
        k = comm.calls + 1
        op(out, input_tensor, buffer, rid, k)
        comm.calls = k
        if comm._watch is None:  # NOTE [a watch that ends as a call comes] in ``_tick``
            watch(comm)

    return call


# ---------------------------------------------------------------------------------------
# The watchdog's source (NOTE [releasing a training gather])
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Watch:
    comm: object
    since: float  # when the group's words last moved (or the watch began)
    seen: tuple  # the words then
    session: object


_watch_lock = threading.Lock()
_watched: list = []


def _words(c) -> tuple:
    """Every rank's (ready, done), host reads of the mapped words."""
    return tuple(tuple(int(x) for x in w.tolist()) for w in c.bound.words.peer_views)


def _caught_up(c, words: tuple) -> bool:
    """Whether nothing this rank's stream has enqueued can wait any more: its own ready word
    reached the last call (every step-1 wait behind it), and so did every peer's (the last
    call's step-3 waits). Its own done lags by one call (NOTE [FSDP2 step words on CUDA])."""
    return all(w[READY] >= c.calls for w in words)


def watch(comm) -> None:
    """Watch ``comm``'s group until nothing its stream has enqueued can wait any more."""
    with _watch_lock:
        if comm._watch is not None:
            return
        comm._watch = w = _Watch(comm, time.monotonic(), (), S.current(comm.ranks))
        _watched.append(w)
    WD.wake(_tick)


def _tick(now: float, look: bool) -> bool:
    with _watch_lock:
        items = list(_watched)
    gone = []
    for w in items:
        c = w.comm
        words = _words(c)
        if _caught_up(c, words):
            gone.append(w)  # checked again under the lock
            continue
        if words != w.seen:
            w.seen, w.since = words, now
        why = None
        if w.session.failed:
            why = w.session.failed
        elif now - w.since > c.timeout_s:
            why = "timeout"
        elif look:
            rec = w.session.aborted()
            if rec is not None:
                why = describe(rec)
        if why is None:
            continue
        try:
            release(w, why)
        except Exception as e:  # noqa: BLE001 (logged: the watchdog must go on)
            log.error("torch_ce.fsdp2: %s: releasing its stream failed: %s", c.group.name, e)
        gone.append(w)
    # NOTE [a watch that ends as a call comes]
    # A call reads ``_watch`` without the lock, after it stored its ``calls``. So a watch
    # ends only if ``calls`` did not move across the test and the clearing: a call that
    # stored it in between may have read the watch still set (and not watched again), and
    # the watch stays.
    with _watch_lock:
        for w in gone:
            c = w.comm
            calls = c.calls
            if c.poison or _caught_up(c, _words(c)):
                c._watch = None
                if c.calls == calls or c.poison:
                    _watched.remove(w)
                else:
                    c._watch = w
        return bool(_watched)


def _lagging(c, words: tuple) -> tuple[int, list[str]]:
    """The call this rank's stream waits in, and the peers it waits for, by name."""
    k = words[c.rank][READY]  # this rank's stream staged calls up to k
    late = [p for p in c.peers if words[p][READY] < k]
    if k and late:  # in call k, step 3: a peer's chunk of call k
        return k, [f"rank {c.ranks[p]} did not stage its chunk of gather {k} (its ready word is "
                   f"{words[p][READY]})" for p in late]
    k += 1  # in call k (now k + 1), step 1: a peer still in call k - 1
    return k, [f"rank {c.ranks[p]} did not begin gather {k} (its done word is {words[p][DONE]}: it "
               f"has not released the chunk of gather {k - 1})" for p in c.peers if words[p][DONE] < k - 1]


def release(w: _Watch, why: str) -> None:
    """NOTE [releasing a training gather], steps 1-3."""
    c = w.comm
    views = c.bound.words.peer_views
    mine = views[c.rank]
    last = c.calls
    k, names = _lagging(c, _words(c))
    if why == "timeout":
        why = f"no progress for {c.timeout_s:g} s (fsdp2_timeout_s, or fsdp2.enable(timeout_s=...))"
    one = one_queue()
    msg = (f"torch_ce.fsdp2: {c.group.name}: CUDA training gather {k} of {last} enqueued: {why}; "
           + ("; ".join(names) or "no peer word is behind") + ". Its stream was released: "
           + ("the gathers from this one on read stale peer bytes (one hardware queue: "
              "CUDA_DEVICE_MAX_CONNECTIONS=1), "
              if one else "the peers' parts of the gathers from this one on are NaN, ")
           + "and this group's next gather raises (a rank that crashed, hangs, or runs other "
           "FSDP2 gathers than its peers?)")
    c.poison = (f"{msg}; fsdp2.disable(model) and enable it again on every rank")
    w.session.fail(c.ranks[c.rank], "step_words", msg)
    log.error("%s", msg)
    with torch.cuda.device(c.bound.buffer.device):
        if not one:
            fill = NAN_WORDS.get(c.bound.buffer.dtype)
            for p in c.peers:
                buf = c.bound.slot.peer_views[p]
                if fill is not None:
                    native.host_write_words(buf.data_ptr(), fill[0], buf.numel(), fill[1], 2)
                for which in (READY, DONE):
                    if int(views[p][which]) < last:
                        native.host_write_words(views[p].data_ptr() + which * 4, last, 1, 4, 3)
            t0 = time.monotonic()
            while int(mine[READY]) < last and time.monotonic() - t0 < 0.5:
                time.sleep(0.002)
        t0 = time.monotonic()
        while int(mine[READY]) < last and time.monotonic() - t0 < 3.0:
            for p in c.peers:
                for which in (READY, DONE):
                    if int(views[p][which]) < last:
                        views[p][which] = last
            time.sleep(0.002)
    if int(mine[READY]) < last:
        log.error("torch_ce.fsdp2: %s: the watchdog's writes did not release the stream within 3 s",
                  c.group.name)


def release_all() -> None:
    """Forget every watched group (torch_ce.release_all)."""
    with _watch_lock:
        for w in _watched:
            w.comm._watch = None
        _watched.clear()
