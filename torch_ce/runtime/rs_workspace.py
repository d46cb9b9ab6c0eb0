"""Receive workspaces of the copy-engine reduce-scatter: pooled per (group, dtype, device),
two halves, each with one slice per sender, and the flags that order them.

# NOTE [reduce-scatter workspaces]
Rank i's workspace of a pool holds ``recv[h, j]``: the slice sender j pushed for i's
share of a bucket, for half ``h`` (0, 1), of ``cap`` elements each; its flags; and a
header beside them:

    data[h, j]    set by sender j after its push into ``recv[h, j]`` to the call's tag
                  (``call_tag``: a nonzero 31-bit value of the call's sequence number in
                  the generation, its per-rank element count, input shapes, dtype and
                  reduce op); i resets it to 0 after waiting for it, before it reduces
    head[h, j]    (seq, numel) of the call j pushed there, written before the flag: what
                  a receiver names when the tag is not the one it expects
    free[h, j]    set to 1 by receiver j once it reduced what i pushed into j's half h;
                  i resets it to 0 after waiting for it, before it pushes there again

Every rank of a group runs the same sequence of reduce-scatters (SPMD), so call ``n`` of a
pool uses half ``n % 2`` on every rank; the flags, not the counter, say when a half may be
written or read, so a call whose half is still being reduced by a peer waits (normally it
is long done: the peer reduced it one call ago). Flags are reset by their waiter, never by
their setter, and a flag is set again only after a wait that follows the reset: a value
is never lost or seen twice. Under CUDA-graph capture the tags of the captured calls are
frozen into the graph like the halves; every rank replays the same graph, so they still
match.

Call identity (issue 46): a receiver waits for the tag of the call it runs, not for "1".
A peer whose graph skipped a bucket, or runs another size here, pushes another tag: the
host transport sees it at its poll and raises ``ReduceScatterError`` naming both calls
(its own seq/numel and the peer's, from the header); the CUDA wait is EQ on the tag, so
another call's push never satisfies it, and the watchdog names both from the words
(NOTE [reduce-scatter watchdog]). Every receiver checks every sender before it reduces,
so every rank that would sum mismatched data raises; none returns a wrong sum.

Generations: a pool's workspace is opened, and grown, by one store round
(``agreement.Round``, what "reduce_scatter") that every rank reaches at the same call:
the ranks compare what they need (the workspace, the call count, and the first call's
signature: a rank whose graph runs another bucket here gets an error naming both), then
open segments of the new size. The round's number is the pool's generation ``gen``: the
abort key is ``abort_key(ranks, gen)``, so a failure poisons that generation only. A rank
whose call fails (timeout, mismatch, a peer's abort) posts the generation's abort, writes
RETRACT into the data flags it set (or would set) in its peers' halves for that call, and
drops the pool; its next call opens a new generation by a new round, which its peers
reach once they failed too. A peer that succeeded the failed call (it consumed the push
just before the retract: the one race left) learns at its next call: its wait finds no
push of this rank and, off the fast path, the generation's abort (within a quarter second
on the host, at the watchdog on CUDA), raises, and drops the pool too. A rank that opens a
growth round first looks up its old generation's abort (rounds are rare: a store check
there is free) and starts fresh if it is set. ``release_all()`` drops every pool.

Growth rounds up to a power of two of elements, so a backward's growing buckets open a
few workspaces, not one per bucket. ``rs_workspace_cap_mib`` bounds one workspace (both
halves, every sender's slice); a bucket that does not fit stays on the collective, with
the reason, identically on every rank (the sizes are the same on all).

The host transport maps POSIX shared memory: pushes are memcpy into the peer's mapping,
flags int32 words in it. A name lives only while the round needs it: at world 2 a peer
unlinks its peer's name as soon as it has mapped it, and every owner unlinks its own
after the last exchange; a round that fails (a peer killed, a timeout) unlinks every
name of the round on the ranks that are left, so a rank killed mid-round leaves nothing
in /dev/shm. Store order: x86 keeps stores in order and loads in order (TSO), so a flag
seen set means the header and slice written before it are there; this is x86-only, and on
other hosts (aarch64: Grace) the host transport's reduce-scatters stay on the collective,
with that reason (``host_order_refusal``).
"""
from __future__ import annotations

import dataclasses
import os
import platform
import time
import uuid
import zlib

import torch

from ..config import config
from . import rs_host_flags as HF
from .agreement import Round

DATA, FREE = 0, 1
_FLAG_BYTES_ALIGN = 64
_MIN_CAP = 1024  # elements per slice of a fresh workspace
RETRACT = 0x7FFFFFFF  # a data flag's value after its sender gave up on the call: never a tag


class ReduceScatterError(RuntimeError):
    """A copy-engine reduce-scatter failed or timed out; raised on every rank that waits."""


@dataclasses.dataclass
class Workspace:
    key: tuple  # (group ranks, dtype name, device type)
    index: int  # this rank's index in the group
    cap: int  # elements per (half, sender) slice
    dtype: torch.dtype
    recv: torch.Tensor  # [2, W, cap], this rank's
    flags: torch.Tensor  # int32 [2 (data, free), 2 (half), W], this rank's
    peer_recv: list  # per group index: that rank's recv (this rank's own at its index)
    peer_flags: list
    handles: list  # the mappings, kept open
    job: str
    calls: int = 0  # reduce-scatters run on this generation (SPMD: the same count on every rank)
    head: torch.Tensor | None = None  # int32 [2 (half), W, 2 (seq, numel)], this rank's
    peer_head: list = dataclasses.field(default_factory=list)
    gen: int = 0  # the generation: the number of the round that opened it (same on every rank)
    failed: str = ""  # why its last call failed (CUDA: set by the watchdog); the pool is then dead
    host_words: object = None  # CUDA: the watchdog's side stream and pinned copies of flags, head
    native: object = None  # CUDA, rs_native: the C++ view of its addresses (reduce_scatter._native_workspace)
    poison: torch.Tensor | None = None  # CUDA, host-mapped flags: int32 [2 (half)] (rs_host_flags.py)

    @property
    def group_size(self) -> int:
        return len(self.key[0])

    @property
    def nbytes(self) -> int:
        return 2 * self.group_size * self.cap * self.dtype.itemsize


_pools: dict[tuple, Workspace] = {}


def workspace_bytes(group_size: int, numel: int, dtype: torch.dtype) -> int:
    """What a workspace whose slices hold ``numel`` elements costs on each rank."""
    return 2 * group_size * numel * dtype.itemsize


def pools() -> dict[tuple, Workspace]:
    return dict(_pools)


STREAMS: dict = {}  # device index -> the reduce-scatter's (copy, reduce) streams (reduce_scatter.py)
_retired: list = []  # failed CUDA workspaces, kept mapped: a late peer may still write there


def release() -> None:
    """Drop every workspace (torch_ce.release_all): their mappings close with them."""
    _pools.clear()
    _retired.clear()


def drop(ws: Workspace) -> None:
    """Forget a pool whose call failed: its next call opens a new generation. A CUDA
    workspace stays mapped (retired) until ``release_all``: a peer's late push lands there."""
    if _pools.get(ws.key) is ws:
        del _pools[ws.key]
    if ws.recv.is_cuda and ws not in _retired:
        _retired.append(ws)


def signature(inputs, reduce_op: str, group_size: int) -> tuple[int, str]:
    """(per-rank element count, text) of a call: what its tag and its round compare.
    Built once per bucket: ``reduce_scatter._spec`` caches it with the bucket's checks."""
    numel = sum(x.numel() for x in inputs) // group_size
    shapes = ",".join("x".join(map(str, x.shape)) for x in inputs)
    return numel, f"{numel}|{shapes}|{str(inputs[0].dtype).removeprefix('torch.')}|{reduce_op}"


def call_tag(seq: int, sig: str) -> int:
    """A call's data-flag value: nonzero, 31 bits, never RETRACT; different for
    consecutive calls of one signature (an odd multiplier is a bijection mod 2**31)."""
    tag = (_crc(sig) ^ ((seq * 0x9E3779B1) & 0x7FFFFFFF)) & 0x7FFFFFFF
    if tag == 0 or tag == RETRACT:
        tag = 0x2545F491
    return tag


_crcs: dict = {}


def _crc(text: str) -> int:
    c = _crcs.get(text)
    if c is None:
        if len(_crcs) > 4096:
            _crcs.clear()
        c = _crcs[text] = zlib.crc32(text.encode())
    return c


def host_order_refusal() -> str | None:
    """Why the host transport cannot run here: it relies on x86's store order (module
    NOTE); None on x86."""
    m = platform.machine().lower()
    if m in ("x86_64", "amd64", "i386", "i686", "x86"):
        return None
    return (f"the host transport's reduce-scatter relies on x86 store order (TSO) and this host "
            f"is {platform.machine()}")


def one_queue_refusal() -> str | None:
    """Why a CUDA reduce-scatter stays on the collective under one hardware queue: there
    only a host store releases a dead peer's stream wait, so the flags must live in host
    memory, and only the native completion's reduction kernel reads the poison word that
    keeps the released call's outputs NaN (runtime/rs_host_flags.py). None where that
    serves, or with more than one queue."""
    if not HF.one_queue() or HF.wanted():
        return None
    why = ("config.rs_host_flags is False" if config.rs_host_flags is False
           else HF.unavailable() or "host-mapped flags are off")
    return ("CUDA_DEVICE_MAX_CONNECTIONS=1: a dead peer's stream wait could only be released "
            f"through host-mapped flags, and {why}, so the copy-engine reduce-scatter would not be "
            "hang-free")


def _capacity(need: int, group_size: int, dtype: torch.dtype) -> int | None:
    """Elements per slice for a bucket of ``need`` (per-rank share): a power of two when
    it fits the cap, else ``need`` itself when that fits, else None (the collective)."""
    cap_bytes = int(config.rs_workspace_cap_mib * 2**20)
    want = max(_MIN_CAP, 1 << max(need - 1, 0).bit_length())
    for n in (want, need):
        if workspace_bytes(group_size, n, dtype) <= cap_bytes:
            return n
    return None


def get(ranks: tuple, index: int, dtype: torch.dtype, device: torch.device, need: int,
        name: str, sig: str = "") -> Workspace | None:
    """The pool's workspace with slices of at least ``need`` elements, opened or grown by
    a round of the whole group; None when such a workspace would pass the cap. ``sig``:
    the call's signature (``signature``), compared in the round."""
    key = (ranks, str(dtype).removeprefix("torch."), device.type)
    ws = _pools.get(key)
    if ws is not None and ws.failed:  # the watchdog failed its last call: say so, once
        drop(ws)
        raise ReduceScatterError(ws.failed)
    if ws is not None and ws.cap >= need:
        return ws
    cap = _capacity(need, len(ranks), dtype)
    if cap is None:
        return None
    if ws is not None and _aborted(ranks, ws.gen) is not None:
        drop(ws)  # a peer failed this generation: start fresh, as that peer does
        ws = None
    if ws is not None:
        cap = max(cap, ws.cap)
    if device.type == "cuda":
        _pools[key] = ws = _open_cuda(key, ranks, index, cap, dtype, name, device, sig, old=ws)
    else:
        _pools[key] = ws = _open_host(key, ranks, index, cap, dtype, name, sig, old=ws)
    return ws


def _round(ranks: tuple) -> Round:
    import torch.distributed as dist

    t = float(config.rs_timeout_s)
    return Round(ranks, dist.get_rank(), t, max(t, float(config.bind_arrival_timeout_s)),
                 what="reduce_scatter", error=ReduceScatterError,
                 timeout_names=("rs_timeout_s (or bind_arrival_timeout_s)", "rs_timeout_s"))


def _layout(group_size: int, cap: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes before the slices: the flags and the header, the segment's bytes)."""
    words = 2 * 2 * group_size + 2 * group_size * 2
    flag_bytes = -(-(words * 4) // _FLAG_BYTES_ALIGN) * _FLAG_BYTES_ALIGN
    return flag_bytes, flag_bytes + workspace_bytes(group_size, cap, dtype)


def _views(mm, group_size: int, cap: int, dtype: torch.dtype):
    flag_bytes, _ = _layout(group_size, cap, dtype)
    flags = torch.frombuffer(mm, dtype=torch.int32, count=4 * group_size).view(2, 2, group_size)
    head = torch.frombuffer(mm, dtype=torch.int32, count=4 * group_size,
                            offset=16 * group_size).view(2, group_size, 2)
    recv = torch.frombuffer(mm, dtype=dtype, count=2 * group_size * cap, offset=flag_bytes)
    return recv.view(2, group_size, cap), flags, head


def _agree(rnd: Round, key, ranks, cap, name, sig, old: Workspace | None) -> dict:
    """The round's first exchange: every rank needs the same workspace at the same call,
    for a call of the same signature (the first call's sizes are checked here; the later
    calls' by their tags)."""
    me = {"key": list(map(str, key)), "cap": cap, "name": name, "calls": old.calls if old else 0,
          "sig": sig, "token": config.shm_prefix + "rs" + uuid.uuid4().hex[:8]}
    everyone = rnd.exchange("need", me)
    mine = {k: me[k] for k in ("key", "cap", "calls", "sig")}
    for r, theirs in sorted(everyone.items()):
        if {k: theirs.get(k) for k in mine} != mine:
            msg = (f"torch_ce: reduce-scatter ranks disagree at a workspace round of group "
                   f"{list(ranks)}: rank {r} runs {theirs['name']} (slices of {theirs['cap']} "
                   f"{theirs['key'][1]}, call {theirs['calls'] + 1}, {_sig_text(theirs.get('sig'))}), "
                   f"this rank {name} (slices of {cap}, call {me['calls'] + 1}, {_sig_text(sig)}). "
                   "Every rank of a group must run the same graphs.")
            rnd.abort(msg)
            raise ReduceScatterError(msg)
    return everyone


def _sig_text(sig) -> str:
    if not sig:
        return "no signature"
    numel, shapes, dtype, op = (str(sig).split("|") + ["?"] * 4)[:4]
    return f"{numel} elements per rank, inputs {shapes or '?'} {dtype} {op}"


def _gen(rnd: Round) -> int:
    return int(rnd.prefix.rsplit("/", 1)[1])


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _open_host(key, ranks, index, cap, dtype, name, sig, old: Workspace | None) -> Workspace:
    """One round: every rank states what it needs, creates its segment, maps its peers'.
    No name outlives the round (module NOTE): at world 2 a peer's name is unlinked as soon
    as it is mapped, the own one after the last exchange, and every name of the round when
    the round fails here."""
    from .host import SHM_DIR, _map, segment_name

    rnd = _round(ranks)
    everyone = _agree(rnd, key, ranks, cap, name, sig, old)
    job = everyone[min(everyone)]["token"]
    gen = _gen(rnd)
    _, nbytes = _layout(len(ranks), cap, dtype)
    paths = [os.path.join(SHM_DIR, segment_name(job, ranks, key[1], 0, j) + f"_g{gen}")
             for j in range(len(ranks))]
    ok = False
    try:
        mm = _map(paths[index], nbytes, create=True)
        recv, flags, head = _views(mm, len(ranks), cap, dtype)
        flags.zero_()
        head.zero_()
        flags[FREE].fill_(1)  # every peer's half is free before the first push
        rnd.exchange("created", True)
        handles, peer_recv, peer_flags, peer_head = [mm], [], [], []
        for j in range(len(ranks)):
            if j == index:
                peer_recv.append(recv)
                peer_flags.append(flags)
                peer_head.append(head)
                continue
            pm = _map(paths[j], nbytes, create=False)
            if len(ranks) == 2:
                _unlink(paths[j])  # this rank is its only other reader
            handles.append(pm)
            r, f, hd = _views(pm, len(ranks), cap, dtype)
            peer_recv.append(r)
            peer_flags.append(f)
            peer_head.append(hd)
        rnd.exchange("mapped", True)
        ok = True
    finally:
        for j, path in enumerate(paths):
            if j == index or not ok:  # a failed round: a killed peer's name too
                _unlink(path)
    return Workspace(key, index, cap, dtype, recv, flags, peer_recv, peer_flags, handles, job,
                     calls=old.calls if old else 0, head=head, peer_head=peer_head, gen=gen)


def _bounded_sync(device: torch.device, what: str) -> None:
    """Wait for this device's work on the current stream and the reduce-scatter's own
    streams, up to ``rs_timeout_s`` (never an unbounded ``torch.cuda.synchronize``: a
    stream blocked on a dead peer's flag would hold this host forever)."""
    events = []
    for s in [torch.cuda.current_stream(device), *(STREAMS.get(device.index) or ())]:
        ev = torch.cuda.Event()
        ev.record(s)
        events.append(ev)
    timeout = float(config.rs_timeout_s)
    deadline = time.monotonic() + timeout
    while not all(ev.query() for ev in events):
        if time.monotonic() > deadline:
            raise ReduceScatterError(
                f"torch_ce: {what}: this device's earlier work did not finish within {timeout:g} s "
                "(rs_timeout_s; a stream waiting for a peer that crashed or hangs?)")
        time.sleep(0.0005)


def _open_cuda(key, ranks, index, cap, dtype, name, device, sig, old: Workspace | None) -> Workspace:
    """One round, after this device finished all its work (a peer's pushes and flag writes
    into an old workspace are then done everywhere once every rank passed the first
    exchange): allocate, rendezvous (symmetric memory, over the group), set the flags,
    and a last exchange so no peer writes a flag before its owner set it. Every wait on
    the device is bounded (``_bounded_sync``)."""
    import torch.distributed._symmetric_memory as symm_mem

    what = f"the reduce-scatter workspace round of {name}"
    host = HF.wanted()
    if host and HF.unavailable() is not None:
        raise ReduceScatterError(f"torch_ce: {what}: host-mapped flags (rs_host_flags) need the native "
                                 f"completion's reduction kernel: {HF.unavailable()}")
    _bounded_sync(device, what)
    rnd = _round(ranks)
    everyone = _agree(rnd, key, ranks, cap, name, sig, old)
    pg = _process_group(ranks)
    flag_bytes, nbytes = _layout(len(ranks), cap, dtype)
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    rnd.exchange("allocated", True)
    hdl = symm_mem.rendezvous(buf, pg.group_name)
    base = buf.data_ptr() - int(hdl.buffer_ptrs[hdl.rank])
    assert base % _FLAG_BYTES_ALIGN == 0 and flag_bytes % dtype.itemsize == 0
    w = len(ranks)

    def views(r):
        flags = hdl.get_buffer(r, (2, 2, w), torch.int32, base // 4)
        head = hdl.get_buffer(r, (2, w, 2), torch.int32, base // 4 + 4 * w)
        recv = hdl.get_buffer(r, (2, w, cap), dtype, (base + flag_bytes) // dtype.itemsize)
        return recv, flags, head

    peer = [views(r) for r in range(w)]
    recv, flags, head = peer[index]
    flags.zero_()
    head.zero_()
    flags[FREE].fill_(1)
    handles, poison = [buf, hdl], None
    if host:  # the words in host memory every rank maps; the slices stay where they are
        from .host import SHM_DIR, segment_name

        job, gen = everyone[min(everyone)]["token"], _gen(rnd)
        try:
            segs = HF.open_group(rnd, [os.path.join(SHM_DIR, segment_name(job, ranks, key[1], 0, j) + f"_g{gen}_flags")
                                       for j in range(w)], index)
        except HF.Unmappable as e:
            rnd.abort(f"torch_ce: {what}: {e}")
            raise ReduceScatterError(f"torch_ce: {what}: {e}") from e
        handles += segs
        peer = [(p[0], s.flags, s.head) for p, s in zip(peer, segs, strict=True)]
        flags, head, poison = segs[index].flags, segs[index].head, segs[index].poison
    _bounded_sync(device, what)
    rnd.exchange("ready", True)
    return Workspace(key, index, cap, dtype, recv, flags, [p[0] for p in peer], [p[1] for p in peer],
                     handles, "", calls=old.calls if old else 0, head=head,
                     peer_head=[p[2] for p in peer], gen=_gen(rnd), poison=poison)


def _process_group(ranks: tuple):
    """The live process group of exactly ``ranks`` (the op's group; resolved by name by
    the caller, registered here by its ranks)."""
    pg = _groups.get(ranks)
    if pg is None:
        raise ReduceScatterError(f"torch_ce: no process group of ranks {list(ranks)} was registered")
    return pg


_groups: dict = {}


def note_group(ranks: tuple, pg) -> None:
    _groups[ranks] = pg


_POLL_S = (0.0, 0.0005)  # first and longest sleep between flag polls
_ABORT_EVERY_S = 0.25


def abort_key(ranks: tuple, gen: int) -> str:
    """The store key a failed call of generation ``gen`` posts: per generation, so a new
    generation (after a failure, or ``release_all``) starts clean."""
    return f"torch_ce/reduce_scatter_abort/{'-'.join(map(str, ranks))}/g{gen}"


def post_abort(ranks: tuple, gen: int, message: str) -> None:
    """Tell the generation's other waiters that this rank gave up (best effort)."""
    from .agreement import _store

    try:
        _store().set(abort_key(ranks, gen), message.encode())
    except Exception:  # noqa: BLE001 (the store may be gone with the job)
        pass


def _aborted(ranks: tuple, gen: int) -> str | None:
    """The generation's abort message, if a rank posted one (a store look-up: only off the
    fast path)."""
    from .agreement import _store

    try:
        store, k = _store(), abort_key(ranks, gen)
        if store.check([k]):
            return store.get(k).decode(errors="replace")
    except Exception:  # noqa: BLE001 (no store: nothing posted)
        return None
    return None


def fail(ws: Workspace, half: int, message: str, retract: bool = True) -> ReduceScatterError:
    """A call of ``ws`` failed on this rank: post the generation's abort, retract this
    rank's pushes of the call (host: RETRACT in each peer's data flag of this half, so a
    peer that has not consumed it yet fails this call too), drop the pool. Returns the
    error to raise."""
    ranks = ws.key[0]
    post_abort(ranks, ws.gen, f"rank {ranks[ws.index]}: {message}")
    if retract and not ws.recv.is_cuda:
        for j in range(ws.group_size):
            if j != ws.index:
                ws.peer_flags[j][DATA, half, ws.index] = RETRACT
    ws.failed = message
    drop(ws)
    return ReduceScatterError(message)


def describe_push(ws: Workspace, half: int, peer: int, value: int, seq: int, numel: int) -> str:
    """What a data flag of another call says, beside what this rank expects (from the
    header words the sender wrote before its flag)."""
    ranks = ws.key[0]
    if value == RETRACT:
        return f"rank {ranks[peer]} gave up on this call (it timed out or found a mismatch)"
    pseq, pnumel = (int(v) for v in ws.head[half, peer])
    return (f"rank {ranks[peer]} pushed its call {pseq} of generation {ws.gen} ({pnumel} elements "
            f"per rank, tag {value:#x}) where this rank runs its call {seq} ({numel} elements per "
            "rank): the ranks run different reduce-scatters here (a graph that skips a bucket on "
            "one rank, or another size); every rank of a group must run the same graphs")


def wait_flag(ws: Workspace, kind: int, half: int, peer: int, what: str, expect: int = 1,
              seq: int = 0, numel: int = 0) -> None:
    """Wait until this rank's flag ``(kind, half, peer)`` is ``expect`` (a data flag: the
    call's tag; a free flag: 1), then reset it to 0. Another nonzero value in a data flag is
    another call's push (or a RETRACT): an error naming both. Bounded by ``rs_timeout_s``;
    a peer's abort of this generation is seen within a quarter second. Any error posts the
    abort, retracts this rank's pushes and drops the pool (``fail``)."""
    flags = ws.flags
    v = int(flags[kind, half, peer])
    if v != expect:
        timeout = float(config.rs_timeout_s)
        start = time.monotonic()
        next_abort = start + _ABORT_EVERY_S
        sleep = _POLL_S[0]
        while v != expect:
            if v != 0 and kind == DATA:
                # No retract: a peer whose call differs sees this rank's push as another
                # call's too (a mismatch is symmetric), and reads both names from it.
                raise fail(ws, half, f"torch_ce: {what}: " + describe_push(ws, half, peer, v, seq, numel),
                           retract=v == RETRACT)
            now = time.monotonic()
            if now >= next_abort:
                next_abort = now + _ABORT_EVERY_S
                msg = _aborted(ws.key[0], ws.gen)
                if msg is not None:
                    raise fail(ws, half, f"torch_ce: {what}: a peer gave up: {msg}")
            if now - start > timeout:
                ranks = ws.key[0]
                msg = (f"torch_ce: {what}: rank {ranks[peer]} of group {list(ranks)} did not "
                       f"{'push its slice' if kind == DATA else 'free its receive half'} within "
                       f"{timeout:g} s (rs_timeout_s; a rank that crashed, hangs, or runs other "
                       "graphs than its peers?)")
                raise fail(ws, half, msg)
            time.sleep(sleep)
            sleep = min(max(sleep * 2, 2e-5), _POLL_S[1])
            v = int(flags[kind, half, peer])
    flags[kind, half, peer] = 0
