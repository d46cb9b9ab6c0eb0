"""The stream watchdog: one thread per process that releases CUDA streams whose waits no
peer will satisfy, for every protocol that makes a stream wait on a peer.

# NOTE [the stream watchdog]
A GPU stream wait has no timeout of its own, and the host that enqueued it does not wait:
a dead peer shows only later, as a ``torch.cuda.synchronize()`` (or ``loss.item()``) that
never returns. So each protocol whose streams wait on peers' words registers a *source*
here: a ``tick(now, look)`` that looks at its pending waits (never blocking), releases the
overdue ones, or those whose group generation ended (``look``: every
``session.ABORT_EVERY_S``, also read the generation's abort in the store), and returns
whether anything is still pending. The sources are the copy-engine reduce-scatter's calls
(runtime/reduce_scatter/watchdog.py) and FSDP2's training gathers (fsdp2/step_words.py);
each releases in its own way (what it writes, what it poisons), through the group's
session (NOTE [sessions: one abort per group generation] in runtime/session.py).

The thread runs while some source has something pending, polls every 20 ms, and ends when
none has (``wake`` starts it again); at interpreter exit it ends its tick and is joined
(``_stop_watchdog``: no CUDA call may run during teardown). It runs in CUDA's relaxed
stream-capture mode: its event queries would otherwise invalidate a CUDA graph another
thread captures in the default (global) mode.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Callable

import torch

from . import native
from .session import ABORT_EVERY_S

log = logging.getLogger("torch_ce")

Tick = Callable[[float, bool], bool]

# What a source writes to poison a released call's outputs, per dtype: (a NaN's bits, its
# width in bytes), for ``native.host_write_words``.
NAN_WORDS = {torch.float32: (0x7FC00000, 4), torch.bfloat16: (0x7FC0, 2), torch.float16: (0x7E00, 2)}


def one_queue() -> bool:
    """Whether the driver puts every stream on one hardware queue (read from the
    environment it read: the same on every rank a launcher starts alike). There a write a
    source enqueues on a stream of its own queues behind the wait it should release."""
    return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1"


_lock = threading.Lock()
_sources: list = []  # the registered ticks
_wakes = [0]  # wake() calls: the thread leaves only if none came during its last tick
_watcher: list = []  # the running thread, if any
_stopping = threading.Event()


def wake(tick: Tick) -> None:
    """``tick`` has something pending: make sure it is registered and the thread runs."""
    with _lock:
        _wakes[0] += 1
        if tick not in _sources:
            _sources.append(tick)
        if not _watcher or not _watcher[0].is_alive():
            t = threading.Thread(target=_run, name="torch_ce_watchdog", daemon=True)
            _watcher[:] = [t]
            t.start()


def _run() -> None:
    """Every source's tick, every 20 ms, while one has something pending.

    It leaves ``_watcher`` only after its last reference to a source's item is gone (each
    tick's references die with its frame): a reduce-scatter call's last reference dropped
    here runs an op that takes the GIL back to free the call's tensors, and at interpreter
    exit the atexit join must still see this thread then."""
    try:
        native.relax_thread_capture_mode()
    except Exception as e:  # noqa: BLE001 (logged: the watchdog must run)
        log.warning("torch_ce: the stream watchdog keeps CUDA's global capture mode: %s", e)
    next_abort = time.monotonic() + ABORT_EVERY_S
    while not _stopping.wait(0.02):
        now = time.monotonic()
        look = now >= next_abort
        if look:
            next_abort = now + ABORT_EVERY_S
        with _lock:
            seen = _wakes[0]
            ticks = list(_sources)
        busy = False
        for tick in ticks:
            try:
                busy = bool(tick(now, look)) or busy
            except Exception as e:  # noqa: BLE001 (logged: the other sources must go on)
                log.error("torch_ce: the stream watchdog's %s failed: %s", getattr(tick, "__qualname__", tick), e)
        if not busy:
            with _lock:
                if _wakes[0] == seen:
                    _watcher.clear()
                    return


def _stop_watchdog() -> None:
    """At exit, before the interpreter finalizes: the thread ends its tick (a release waits
    a few seconds at most) and is joined."""
    _stopping.set()
    t = _watcher[0] if _watcher else None
    if t is not None:
        t.join(timeout=5.0)


atexit.register(_stop_watchdog)
