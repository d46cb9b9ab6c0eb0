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

Call identity: a receiver waits for the tag of the call it runs, not for "1". The tag is
made of the call's sequence number in the pool and its bucket's identity: its sizes,
dtype and reduce op, and the name its graph (the gradients it carries) or FSDP2 group
(the module) gives it, so two buckets of one shape are told apart. A peer whose graph
skipped a bucket, or runs another bucket here, pushes another tag: the host transport sees
it at its poll and raises ``ReduceScatterError`` naming both calls (its own bucket,
seq and size, the peer's seq and size from the header and its bucket from the store,
where each side of a mismatch says which call it runs); the CUDA wait is EQ on the tag, so
another call's push never satisfies it, and the watchdog names both from the words
(NOTE [reduce-scatter watchdog]). Every receiver checks every sender before it reduces,
so every rank that would sum mismatched data raises; none returns a wrong sum.

Generations: a pool's workspace is opened, and grown, by one store round
(``agreement.Round``, what "reduce_scatter") that every rank reaches at the same call:
the ranks compare what they need (the workspace, the call count, and the first call's
signature and bucket: a rank whose graph runs another bucket here gets an error naming
both), then open segments of the new size. The workspace belongs to the group's session
of that round (NOTE [sessions: one abort per group generation] in runtime/session.py):
its waits (host polls, the watchdog) watch that generation's abort, and ``gen``, the
round's number, names its segments and its calls. A rank whose call fails (timeout,
mismatch, a peer's abort, in any protocol of the group) gives up on the generation (its
abort), writes RETRACT into the data flags it set (or would set) in its peers' halves for
that call, and drops the pool; its next call opens a workspace in the next generation by
a new round, which its peers reach once they failed too. A peer that succeeded the failed
call (it consumed the push just before the retract: the one race left) learns at its
next call: its wait finds no push of this rank and, off the fast path, the generation's
abort (within a quarter second on the host, at the watchdog on CUDA), raises, and drops
the pool too. A pool whose generation ended on this rank in another way (this rank saw
another protocol's failure) is dropped at its next call, which opens the next
generation's workspace; a growth round that finds its generation aborted raises if a
peer raised in that very round, else opens in the next generation (``session.opening``).
``release_all()`` drops every pool.

Growth rounds up to a power of two of elements, so a backward's growing buckets open a
few workspaces, not one per bucket. ``rs_workspace_cap_mib`` bounds one workspace (both
halves, every sender's slice); a bucket that does not fit stays on the collective, with
the reason, identically on every rank (the sizes are the same on all).

A CUDA workspace is complete when it is made: its device's copy and reduce streams, the
C++ view of its addresses (where the library has the native path), and the pinned words
the watchdog reads its flags into with its side stream (device flags only: host-mapped
ones are read in place). A page-locked allocation may wait for the device, so none is
made once a wait of the workspace may be enqueued (NOTE [reduce-scatter watchdog]).

The host transport maps POSIX shared memory: pushes are memcpy into the peer's mapping,
flags int32 words in it. A name lives only while the round needs it: at world 2 a peer
unlinks its peer's name as soon as it has mapped it, and every owner unlinks its own
after the last exchange; a round that fails (a peer killed, a timeout) unlinks every
name of the round on the ranks that are left, so a rank killed mid-round leaves nothing
in /dev/shm. Store order: x86 keeps stores in order and loads in order (TSO), so a flag
seen set means the header and slice written before it are there; this is x86-only, and on
other hosts (aarch64: Grace) the host transport's reduce-scatters stay on the collective,
with that reason (``RsReason.HOST_NOT_X86``).
"""
from __future__ import annotations

import dataclasses
import os
import time
import uuid

import torch

from ...config import config
from .. import native
from ..agreement import Round
from . import host_flags as HF
from .flags import DATA, FREE, ReduceScatterError

_FLAG_BYTES_ALIGN = 64
_MIN_CAP = 1024  # elements per slice of a fresh workspace


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
    gen: int = 0  # the number of the round that opened it (same on every rank): names its segments
    session: object = None  # the group's session of that round: its generation (runtime/session.py)
    failed: str = ""  # why its last call failed (CUDA: set by the watchdog); the pool is then dead
    poison: torch.Tensor | None = None  # CUDA, host-mapped flags: int32 [2 (half)] (host_flags.py)
    # Made with it (CUDA: ``_open_run_time``):
    streams: tuple | None = None  # its device's (copy, reduce) streams
    native: object = None  # the C++ view of its addresses (NOTE [native reduce-scatter path])
    host_words: object = None  # the watchdog's side stream and pinned copies of flags, head
    # half -> its call launched and not yet completed by this rank (``launch.launch``
    # completes it before the half is used again)
    owed: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.recv.is_cuda:
            _open_run_time(self)

    @property
    def group_size(self) -> int:
        return len(self.key[0])

    @property
    def nbytes(self) -> int:
        return 2 * self.group_size * self.cap * self.dtype.itemsize

    def drop(self) -> None:
        """Forget this pool after a failed call: its next call opens a new generation. A
        CUDA workspace stays mapped (retired) until ``release_all``: a peer's late push
        lands there."""
        if _POOLS.get(self.key) is self:
            del _POOLS[self.key]
        if self.recv.is_cuda and self not in _RETIRED:
            _RETIRED.append(self)


# The pools of this process, one per (group, dtype, device): a call finds its group's
# workspace here by key, and release_all drops them all.
_POOLS: dict[tuple, Workspace] = {}
_RETIRED: list = []  # failed CUDA workspaces, kept mapped: a late peer may still write there


def get(pg, ranks: tuple, index: int, dtype: torch.dtype, device: torch.device, need: int,
        name: str, sig: str = "") -> Workspace | None:
    """The pool's workspace with slices of at least ``need`` elements, opened or grown by
    a round of the whole group (``pg``, of ``ranks``); None when such a workspace would
    pass the cap. ``sig``: the call's signature (``Spec.sig``), compared in the round."""
    key = (ranks, str(dtype).removeprefix("torch."), device.type)
    ws = _POOLS.get(key)
    if ws is not None and ws.failed:  # the watchdog failed its last call: say so, once
        ws.drop()
        raise ReduceScatterError(ws.failed)
    if ws is not None and ws.session.failed:  # the generation ended here: the next one opens
        ws.drop()
        ws = None
    if ws is not None and ws.cap >= need:
        return ws
    cap = _capacity(need, len(ranks), dtype)
    if cap is None:
        return None
    if ws is not None:
        cap = max(cap, ws.cap)
    try:
        if device.type == "cuda":
            _POOLS[key] = ws = _open_cuda(key, pg, ranks, index, cap, dtype, name, device, sig, old=ws)
        else:
            _POOLS[key] = ws = _open_host(key, ranks, index, cap, dtype, name, sig, old=ws)
    except ReduceScatterError as e:
        if name in str(e):
            raise
        raise ReduceScatterError(f"torch_ce: reduce-scatter {name}: its workspace round failed: {e}") from e
    return ws


def workspace_bytes(group_size: int, numel: int, dtype: torch.dtype) -> int:
    """What a workspace whose slices hold ``numel`` elements costs on each rank."""
    return 2 * group_size * numel * dtype.itemsize


def _capacity(need: int, group_size: int, dtype: torch.dtype) -> int | None:
    """Elements per slice for a bucket of ``need`` (per-rank share): a power of two when
    it fits the cap, else ``need`` itself when that fits, else None (the collective)."""
    cap_bytes = int(config.rs_workspace_cap_mib * 2**20)
    want = max(_MIN_CAP, 1 << max(need - 1, 0).bit_length())
    for n in (want, need):
        if workspace_bytes(group_size, n, dtype) <= cap_bytes:
            return n
    return None


# ---------------------------------------------------------------------------------------
# The rounds that open a generation
# ---------------------------------------------------------------------------------------

def _open_host(key, ranks, index, cap, dtype, name, sig, old: Workspace | None) -> Workspace:
    """One round: every rank states what it needs, creates its segment, maps its peers'.
    No name outlives the round (module NOTE): at world 2 a peer's name is unlinked as soon
    as it is mapped, the own one after the last exchange, and every name of the round when
    the round fails here."""
    from ..host import SHM_DIR, _map, segment_name

    rnd = _round(key)
    old = old if old is not None and old.session is rnd.session else None  # a growth in its generation
    everyone = _agree(rnd, key, ranks, cap, name, sig, old)
    job = everyone[min(everyone)]["token"]
    gen = rnd.number
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
                     calls=old.calls if old else 0, head=head, peer_head=peer_head, gen=gen,
                     session=rnd.session)


def _open_cuda(key, pg, ranks, index, cap, dtype, name, device, sig, old: Workspace | None) -> Workspace:
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
    rnd = _round(key)
    old = old if old is not None and old.session is rnd.session else None  # a growth in its generation
    everyone = _agree(rnd, key, ranks, cap, name, sig, old)
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
        from ..host import SHM_DIR, segment_name

        job, gen = everyone[min(everyone)]["token"], rnd.number
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
                     peer_head=[p[2] for p in peer], gen=rnd.number, poison=poison, session=rnd.session)


def _round(key: tuple) -> Round:
    """The pool's next round, in its group's session. Its first step waits at least
    ``bind_arrival_timeout_s`` (peers may still be compiling the backward, or be late
    after a failure); a peer's failure ends it sooner."""
    import torch.distributed as dist

    t = float(config.rs_timeout_s)
    return Round(key[0], dist.get_rank(), t, max(t, float(config.bind_arrival_timeout_s)),
                 what="reduce_scatter", error=ReduceScatterError,
                 timeout_names=("rs_timeout_s (or bind_arrival_timeout_s)", "rs_timeout_s"))


def _agree(rnd: Round, key, ranks, cap, name, sig, old: Workspace | None) -> dict:
    """The round's first exchange: every rank needs the same workspace at the same call,
    for a call of the same signature (the first call's sizes are checked here; the later
    calls' by their tags)."""
    me = {"key": list(map(str, key)), "cap": cap, "name": name, "calls": old.calls if old else 0,
          "sig": sig, "token": config.shm_prefix + "rs" + uuid.uuid4().hex[:8]}
    everyone = rnd.exchange("need", me)
    mine = {k: me[k] for k in ("key", "cap", "calls", "sig", "name")}
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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _bounded_sync(device: torch.device, what: str) -> None:
    """Wait for this device's work on the current stream and the reduce-scatter's own
    streams, up to ``rs_timeout_s`` (never an unbounded ``torch.cuda.synchronize``: a
    stream blocked on a dead peer's flag would hold this host forever)."""
    events = []
    for s in [torch.cuda.current_stream(device), *(_STREAMS.get(device.index) or ())[:2]]:
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


# ---------------------------------------------------------------------------------------
# A CUDA workspace's run-time pieces, made with it
# ---------------------------------------------------------------------------------------

# Device index -> its reduce-scatter streams (copy, reduce, the watchdog's side stream):
# one set per device, shared by every pool on it, so a device's reduce-scatters keep one
# program order on its copy and reduce streams whichever pool serves them, and a round's
# ``_bounded_sync`` waits for them all.
_STREAMS: dict = {}


def _open_run_time(ws: Workspace) -> None:
    """A CUDA workspace's streams, its C++ view (where the library has the native path:
    ``config.rs_native`` picks the path per call) and, with device flags, the watchdog's
    pinned words (module NOTE)."""
    dev = ws.recv.device
    streams = _STREAMS.get(dev.index)
    if streams is None:
        streams = _STREAMS[dev.index] = tuple(torch.cuda.Stream(device=dev) for _ in range(3))
    ws.streams = streams[:2]
    if native.has_rs_native():
        ws.native = _native_view(ws)
    if ws.poison is None and not torch.cuda.is_current_stream_capturing():
        ws.host_words = (streams[2], torch.empty(ws.flags.shape, dtype=torch.int32, pin_memory=True),
                         torch.empty(ws.head.shape, dtype=torch.int32, pin_memory=True))


def _native_view(ws: Workspace):
    """Every address the C++ launch and completion touch, as plain integers (the same
    words the Python path reads and writes), and the copy and reduce streams."""
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
    copy_stream, reduce_stream = ws.streams
    return native.rs_workspace(addrs, w, i, ws.cap, ws.dtype, ws.recv.device.index,
                               copy_stream.cuda_stream, reduce_stream.cuda_stream)


def pools() -> dict[tuple, Workspace]:
    return dict(_POOLS)


def release() -> None:
    """Drop every workspace (torch_ce.release_all): their mappings close with them."""
    _POOLS.clear()
    _RETIRED.clear()
