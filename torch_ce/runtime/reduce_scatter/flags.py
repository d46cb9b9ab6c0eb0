"""The reduce-scatter's words and the waits on them: the data and free flags and the values
they take (a call's tag, RETRACT), giving up on the group's generation, and the host
transport's bounded wait (NOTE [reduce-scatter workspaces] in
runtime/reduce_scatter/workspace.py says what each word means and who writes it).

Each of ``call_tag``, ``fail``, ``describe_push`` and ``wait_flag`` is the one function of
its kind: the CUDA paths name the same words (runtime/reduce_scatter/reference.py,
watchdog.py) and the C++ path mirrors them (NOTE [native reduce-scatter path] in
csrc/ce_reduce_scatter.cu). Waiting and giving up go through the group's session (NOTE
[sessions: one abort per group generation] in runtime/session.py), like every protocol's.
"""
from __future__ import annotations

import time
import zlib

from ...config import config
from ..session import PeerError

DATA, FREE = 0, 1  # a flag word's kind: its first index in ``Workspace.flags``
RETRACT = 0x7FFFFFFF  # a data flag's value after its sender gave up on the call: never a tag
_POLL_S = (0.0, 0.0005)  # first and longest sleep between flag polls


class ReduceScatterError(PeerError):
    """A copy-engine reduce-scatter failed or timed out; raised on every rank that waits."""


def call_tag(seq: int, sig: str, name: str) -> int:
    """A call's data-flag value: nonzero, 31 bits, never RETRACT; from its bucket's
    identity (its signature and the name its graph or FSDP2 group gives it: buckets of one
    shape are told apart by name) and its sequence number (consecutive calls of one bucket
    differ: an odd multiplier is a bijection mod 2**31)."""
    tag = (_crc(sig) ^ _crc(name) ^ ((seq * 0x9E3779B1) & 0x7FFFFFFF)) & 0x7FFFFFFF
    if tag == 0 or tag == RETRACT:
        tag = 0x2545F491
    return tag


_CRCS: dict = {}  # signature text or bucket name -> its crc32: a cache of a pure function


def _crc(text: str) -> int:
    c = _CRCS.get(text)
    if c is None:
        if len(_CRCS) > 4096:
            _CRCS.clear()
        c = _CRCS[text] = zlib.crc32(text.encode())
    return c


# ---------------------------------------------------------------------------------------
# Giving up: the group session's abort (NOTE [sessions: one abort per group generation])
# ---------------------------------------------------------------------------------------

def _me(ws) -> int:
    return ws.key[0][ws.index]


def fail(ws, half: int, message: str, retract: bool = True) -> ReduceScatterError:
    """A call of ``ws`` failed on this rank: give up on the group's generation (its abort,
    which every other wait of the generation sees), retract this rank's pushes of the call
    (host: RETRACT in each peer's data flag of this half, so a peer that has not consumed
    it yet fails this call too), drop the pool. Returns the error to raise."""
    _give_up(ws, half, message, retract)
    ws.session.fail(_me(ws), "reduce_scatter", message)
    return ReduceScatterError(message)


def _give_up(ws, half: int, message: str, retract: bool) -> None:
    """This rank's side of a failed call: the retracts, the pool dropped."""
    if retract and not ws.recv.is_cuda:
        for j in range(ws.group_size):
            if j != ws.index:
                ws.peer_flags[j][DATA, half, ws.index] = RETRACT
    ws.failed = ws.failed or message
    ws.drop()


def post_call(ws, seq: int, name: str, numel: int) -> None:
    """Say which call this rank runs at ``seq`` (only on a failure: a store write), so a
    peer that finds another call's push names this one's bucket."""
    try:
        ws.session.store.set(f"{ws.session.prefix}/rs_call/{ws.gen}/{seq}/{_me(ws)}",
                             f"{name} ({numel} elements per rank)".encode())
    except Exception:  # noqa: BLE001 (the store may be gone with the job)
        pass


def peer_call(ws, seq: int, peer: int, wait_s: float = 1.0) -> str | None:
    """What the peer (group index) said it runs at ``seq`` (``post_call``), waiting a
    little for it: both sides of a mismatch post and read at about the same time."""
    key = f"{ws.session.prefix}/rs_call/{ws.gen}/{seq}/{ws.key[0][peer]}"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if ws.session.store.check([key]):
                return ws.session.store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------
# The host transport: flags are words of the shared mappings, polled (bounded)
# ---------------------------------------------------------------------------------------

def describe_push(ws, half: int, peer: int, value: int, seq: int, numel: int, name: str = "") -> str:
    """What a data flag of another call says, beside what this rank expects (from the
    header words the sender wrote before its flag, and the bucket the sender says it runs)."""
    ranks = ws.key[0]
    if value == RETRACT:
        return f"rank {ranks[peer]} gave up on this call (it timed out or found a mismatch)"
    pseq, pnumel = (int(v) for v in ws.head[half, peer])
    post_call(ws, seq, name, numel)
    theirs = peer_call(ws, pseq, peer)
    theirs = f"{theirs}, " if theirs else ""
    mine = f"{name}, " if name else ""
    return (f"rank {ranks[peer]} pushed its call {pseq} of workspace {ws.gen} ({theirs}{pnumel} elements "
            f"per rank, tag {value:#x}) where this rank runs its call {seq} ({mine}{numel} elements per "
            "rank): the ranks run different reduce-scatters here (a graph that skips a bucket on "
            "one rank, or another size); every rank of a group must run the same graphs")


def wait_flag(ws, kind: int, half: int, peer: int, what: str, expect: int = 1,
              seq: int = 0, numel: int = 0, name: str = "") -> None:
    """Wait until this rank's flag ``(kind, half, peer)`` is ``expect`` (a data flag: the
    call's tag; a free flag: 1), then reset it to 0, through the group's session: bounded
    by ``rs_timeout_s``, ended by any failure of the pool's generation (seen within
    ``ABORT_EVERY_S``). Another nonzero value in a data flag is another call's push (or a
    RETRACT): an error naming both. Any error gives up on the generation (``fail``)."""
    flags = ws.flags
    if int(flags[kind, half, peer]) != expect:
        timeout = float(config.rs_timeout_s)

        def arrived() -> bool:
            v = int(flags[kind, half, peer])
            if v != expect and v != 0 and kind == DATA:
                # No retract: a peer whose call differs sees this rank's push as another
                # call's too (a mismatch is symmetric), and reads both names from it.
                raise fail(ws, half, f"torch_ce: {what}: " + describe_push(ws, half, peer, v, seq, numel, name),
                           retract=v == RETRACT)
            return v == expect

        def late() -> str:
            ranks = ws.key[0]
            return (f"torch_ce: {what}: rank {ranks[peer]} of group {list(ranks)} did not "
                    f"{'push its slice' if kind == DATA else 'free its receive half'} within "
                    f"{timeout:g} s (rs_timeout_s; a rank that crashed, hangs, or runs other "
                    "graphs than its peers?)")

        try:
            ws.session.wait(arrived, timeout_s=timeout, what=what, error=ReduceScatterError,
                            protocol="reduce_scatter", rank=_me(ws), on_timeout=late, poll=_POLL_S)
        except ReduceScatterError as e:  # a timeout (posted) or a peer's abort: this rank's side
            if not ws.failed:
                _give_up(ws, half, str(e), retract=True)
            raise
    flags[kind, half, peer] = 0


class HostFlags:
    """The host transport's flag primitives: words of the shared mappings, written with
    plain stores (x86 keeps them in order), waited for by ``wait_flag``."""

    @staticmethod
    def wait(ws, kind: int, half: int, peer: int, call) -> None:
        wait_flag(ws, kind, half, peer, call.what, call.tag if kind == DATA else 1, call.seq, call.numel, call.name)

    @staticmethod
    def signal_free(ws, peer: int, half: int, sender: int) -> None:
        ws.peer_flags[peer][FREE, half, sender] = 1

    @staticmethod
    def signal_data(ws, peer: int, half: int, sender: int, call) -> None:
        head = ws.peer_head[peer][half, sender]
        head[0] = call.seq
        head[1] = call.numel
        ws.peer_flags[peer][DATA, half, sender] = call.tag  # after the slice and the header (TSO)
