"""The core every protocol meets its peers through, without a collective: one session per
group and generation, one bounded wait, one abort.

# NOTE [sessions: one abort per group generation]
torch_ce's protocols meet peers one-sidedly: the bind, update and reduce-scatter
workspace rounds (store exchanges, runtime/agreement.py), the reduce-scatter's flags
(host polls; on CUDA the watchdog), and FSDP2's step words. Each waits for a peer's word,
and a peer that crashed, hangs or runs another program must end that wait on every rank,
whichever protocol it failed in. So they all wait and give up through one ``Session`` per
group (its global ranks) and generation:

- **One abort key per generation**, ``torch_ce/<ranks>/g<gen>/abort``. A rank whose wait
  fails (its timeout, a mismatch it saw, an exception inside a round) posts it with what
  failed (``fail``: the first message stays); every wait of that generation on every rank,
  in every protocol, looks it up while it waits (at once in a round, else after its
  first idle poll and then every ``ABORT_EVERY_S``) and raises its protocol's error naming
  the rank and what it gave up on. A wait that is satisfied at its first look never reads
  the store: the fast paths (a reduce-scatter whose peers pushed, a step word already
  set) cost nothing.
- **Generations**: the rank that fails, and every rank that sees the abort, moves on to
  the next generation (``current(ranks)`` returns it). A rank that was not waiting when
  a peer failed learns it at its next meeting: a round looks the abort up as it opens
  (rounds are rare, so a store check there is free) and raises it if that very round
  died on a peer (the peer raised in it and is not coming: ``bury``), else opens in the
  next generation, where the peers that saw the failure meet it; round numbers count per
  generation and kind, so the ranks meet again in the same rounds. Whatever a protocol opened in a failed
  generation (a reduce-scatter pool, an FSDP2 training gather) is dead on that rank: it
  raises once, or is opened again, as its protocol says. ``release_all()`` looks every
  group's abort up once more (so every rank leaves a failed generation) and drops the
  protocols' state; the next call meets in the live generation.
- **Timeouts are named per protocol** (``config``: ``bind_timeout_s`` and
  ``bind_arrival_timeout_s`` for binds, ``updating_weights(timeout_s=)`` for updates,
  ``rs_timeout_s`` for reduce-scatters, ``fsdp2_timeout_s`` for FSDP2's step words): the
  wait that times out says which knob bounds it. A failure elsewhere ends a wait sooner:
  within ``ABORT_EVERY_S`` of its post, never later than the wait's own timeout.

Only the CUDA reduce-scatter waits on the GPU (stream waits on flag words); its watchdog
thread is its wait's poll: it posts the abort of a call it releases, and releases a call
whose generation a peer aborted (NOTE [reduce-scatter watchdog]).
"""
from __future__ import annotations

import json
import threading
import time
from typing import Callable

ABORT_EVERY_S = 0.25  # how often a waiting rank looks up its generation's abort
_POLL_S = (0.0005, 0.05)  # the first and the longest sleep between two looks at a word
_ROUNDS_PER_GEN = 1_000_000  # round numbers of generation g: g * this + 1, + 2, ...

# The config knob (or argument) that bounds each protocol's waits.
TIMEOUTS = {
    "bind": "bind_timeout_s (its first step: bind_arrival_timeout_s)",
    "update": "updating_weights(timeout_s=...)",
    "reduce_scatter": "rs_timeout_s",
    "step_words": "fsdp2_timeout_s",
}


class PeerError(RuntimeError):
    """A one-sided meeting with peers failed; every protocol's error derives from it."""


def _store():
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


class Session:
    """One group (global ranks) at one generation: the abort every protocol of the group
    posts and watches, and the numbering of its rounds."""

    __slots__ = ("ranks", "gen", "failed", "store", "rounds", "__weakref__")

    def __init__(self, ranks: tuple, gen: int, store):
        self.ranks = tuple(ranks)
        self.gen = gen
        self.failed = ""  # why this generation ended, as this rank learnt it ("" while live)
        self.store = store
        self.rounds: dict[str, int] = {}  # kind of round -> rounds opened in this generation

    @property
    def prefix(self) -> str:
        return f"torch_ce/{'-'.join(map(str, self.ranks))}/g{self.gen}"

    @property
    def abort_key(self) -> str:
        return f"{self.prefix}/abort"

    def next_round(self, what: str) -> str:
        """The key prefix of this generation's next round of kind ``what``; it ends in the
        round's number, unique for the group and kind across generations."""
        self.rounds[what] = n = self.rounds.get(what, 0) + 1
        return f"{self.prefix}/{what}/{self.gen * _ROUNDS_PER_GEN + n}"

    # -- giving up -------------------------------------------------------------------

    def fail(self, rank: int, protocol: str, message: str) -> None:
        """This rank gives up on the generation: post its abort (the first post stays),
        and move this process on to the next generation. Never raises (the store may be
        gone with the job)."""
        record = json.dumps({"rank": rank, "protocol": protocol, "message": message})
        try:
            self.store.compare_set(self.abort_key, "", record)
        except Exception:  # noqa: BLE001 (a store without compare_set: plain set)
            try:
                self.store.set(self.abort_key, record)
            except Exception:  # noqa: BLE001
                pass
        self._end(f"rank {rank} gave up in its {_protocol_name(protocol)}: {message}")

    def aborted(self) -> dict | None:
        """The generation's abort, if a rank posted one (a store look-up: off every fast
        path); seeing it ends the generation on this rank too."""
        try:
            if not self.store.check([self.abort_key]):
                return None
            raw = self.store.get(self.abort_key).decode(errors="replace")
        except Exception:  # noqa: BLE001 (no store: nothing posted)
            return None
        try:
            rec = json.loads(raw)
            rec = {"rank": int(rec["rank"]), "protocol": str(rec["protocol"]), "message": str(rec["message"])}
        except (ValueError, KeyError, TypeError):
            rec = {"rank": -1, "protocol": "?", "message": raw}
        self._end(describe(rec))
        return rec

    def _end(self, why: str) -> None:
        with _lock:
            if not self.failed:
                self.failed = why
            live = _sessions.get((id(self.store), self.ranks))
            if live is self:
                _sessions[(id(self.store), self.ranks)] = Session(self.ranks, self.gen + 1, self.store)

    def bury(self, prefix: str) -> None:
        """Mark the round ``prefix`` dead on this rank (it raised): a peer that opens it
        later raises too instead of waiting for this rank (``opening``)."""
        try:
            self.store.set(f"{prefix}/dead", b"1")
        except Exception:  # noqa: BLE001
            pass

    # -- waiting ---------------------------------------------------------------------

    def wait(self, ready: Callable[[], bool], *, timeout_s: float, what: str, error: type,
             protocol: str, rank: int, on_timeout: Callable[[], str], poll=_POLL_S,
             abort_first: bool = False, on_abort: Callable[[dict], str] | None = None) -> None:
        """Until ``ready()`` is true: bounded by ``timeout_s`` (then ``on_timeout()``'s
        text is posted as this rank's abort and raised as ``error``), ended by the
        generation's abort (raised as ``error``: ``on_abort(record)``'s text, or
        ``<what>: <who gave up>``). The store is read only once a look found the word
        unset, then every ``ABORT_EVERY_S`` (``abort_first``: at the first idle look)."""
        if ready():
            return
        start = time.monotonic()
        deadline = start + timeout_s
        next_abort = start if abort_first else start + ABORT_EVERY_S
        sleep = poll[0]
        while True:
            now = time.monotonic()
            if now >= next_abort:
                next_abort = now + ABORT_EVERY_S
                rec = self.aborted()
                if rec is not None:
                    text = on_abort(rec) if on_abort is not None else f"torch_ce: {what}: {describe(rec)}"
                    raise error(text)
            if now > deadline:
                text = on_timeout()
                self.fail(rank, protocol, f"timed out: {text}")
                raise error(text)
            time.sleep(sleep)
            sleep = min(max(sleep * 2, 2e-5), poll[1])
            if ready():
                return


def _protocol_name(protocol: str) -> str:
    return {"bind": "bind", "update": "updating_weights", "reduce_scatter": "reduce-scatter",
            "step_words": "FSDP2 training gather"}.get(protocol, protocol)


def describe(rec: dict) -> str:
    """Who gave up and why, from an abort record."""
    who = f"rank {rec['rank']}" if rec.get("rank", -1) >= 0 else "a peer"
    return f"a peer gave up: {who} failed in its {_protocol_name(rec.get('protocol', '?'))}: {rec['message']}"


_lock = threading.Lock()
_sessions: dict[tuple, Session] = {}  # (id(store), ranks) -> the live generation's session


def current(ranks: tuple) -> Session:
    """The group's live session (generation 0 at first)."""
    store = _store()
    key = (id(store), tuple(ranks))
    s = _sessions.get(key)
    if s is None:
        with _lock:
            s = _sessions.get(key)
            if s is None:
                s = _sessions[key] = Session(tuple(ranks), 0, store)
    return s


def opening(ranks: tuple, what: str) -> tuple[Session, dict | None]:
    """The session a new round of kind ``what`` meets in, and the abort to raise instead.

    A rank that has not seen a peer's failure yet looks its generation's abort up here: if
    the round it is about to open died on a peer (``Session.bury``: the peer raised in it),
    it raises that failure (its peer is not coming); any other round opens in the next
    generation, where the peers that saw the failure meet it."""
    s = current(ranks)
    rec = s.aborted()
    if rec is None:
        return s, None
    n = s.rounds.get(what, 0) + 1
    try:
        dead = s.store.check([f"{s.prefix}/{what}/{s.gen * _ROUNDS_PER_GEN + n}/dead"])
    except Exception:  # noqa: BLE001
        dead = False
    return current(ranks), rec if dead else None


def leave_failed() -> None:
    """``release_all()``: every group whose generation a peer aborted moves on, here too."""
    for s in list(_sessions.values()):
        s.aborted()


def sessions() -> list[Session]:
    return list(_sessions.values())
