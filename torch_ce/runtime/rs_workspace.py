"""Receive workspaces of the copy-engine reduce-scatter: pooled per (group, dtype, device),
two halves, each with one slice per sender, and the flags that order them.

# NOTE [reduce-scatter workspaces]
Rank i's workspace of a pool holds ``recv[h, j]``: the slice sender j pushed for i's
share of a bucket, for half ``h`` (0, 1), of ``cap`` elements each; and its flags:

    data[h, j]  set to 1 by sender j after its push into ``recv[h, j]``; i resets it to 0
                after waiting for it, before it reduces
    free[h, j]  set to 1 by receiver j once it reduced what i pushed into j's half h;
                i resets it to 0 after waiting for it, before it pushes there again

Every rank of a group runs the same sequence of reduce-scatters (SPMD), so call ``n`` of a
pool uses half ``n % 2`` on every rank; the flags, not the counter, say when a half may be
written or read, so a call whose half is still being reduced by a peer waits (normally it
is long done: the peer reduced it one call ago). Flags are reset by their waiter, never by
their setter, and a flag is set again only after a wait that follows the reset: a value
is never lost or seen twice, and nothing depends on a host counter that a CUDA graph
would freeze.

A pool's workspace is opened, and grown, by one store round (``agreement.Round``, what
"reduce_scatter") that every rank reaches at the same call: the ranks compare what they
need (a rank whose graph runs another bucket here gets an error naming both), then open
segments of the new size. Growth rounds up to a power of two of elements, so a backward's
growing buckets open a few workspaces, not one per bucket. ``rs_workspace_cap_mib`` bounds
one workspace (both halves, every sender's slice); a bucket that does not fit stays on the
collective, with the reason, identically on every rank (the sizes are the same on all).

The host transport maps POSIX shared memory (the same naming and unlink-after-map as
``host.py``): pushes are memcpy into the peer's mapping, flags int32 words in it. x86 keeps
stores in order (TSO), so a flag seen set means the slice before it is there.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import time
import uuid

import torch

from ..config import config
from .agreement import Round

DATA, FREE = 0, 1
_FLAG_BYTES_ALIGN = 64
_MIN_CAP = 1024  # elements per slice of a fresh workspace


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
    calls: int = 0  # reduce-scatters run on this pool (SPMD: the same count on every rank)

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


def release() -> None:
    """Drop every workspace (torch_ce.release_all): their mappings close with them."""
    _pools.clear()


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
        name: str) -> Workspace | None:
    """The pool's workspace with slices of at least ``need`` elements, opened or grown by
    a round of the whole group; None when such a workspace would pass the cap."""
    key = (ranks, str(dtype).removeprefix("torch."), device.type)
    ws = _pools.get(key)
    if ws is not None and ws.cap >= need:
        return ws
    cap = _capacity(need, len(ranks), dtype)
    if cap is None:
        return None
    if ws is not None:
        cap = max(cap, ws.cap)
    if device.type == "cuda":
        _pools[key] = ws = _open_cuda(key, ranks, index, cap, dtype, name, device, old=ws)
    else:
        _pools[key] = ws = _open_host(key, ranks, index, cap, dtype, name, old=ws)
    return ws


def _round(ranks: tuple) -> Round:
    import torch.distributed as dist

    t = float(config.rs_timeout_s)
    return Round(ranks, dist.get_rank(), t, max(t, float(config.bind_arrival_timeout_s)),
                 what="reduce_scatter", error=ReduceScatterError,
                 timeout_names=("rs_timeout_s (or bind_arrival_timeout_s)", "rs_timeout_s"))


def _layout(group_size: int, cap: int, dtype: torch.dtype) -> tuple[int, int]:
    flag_bytes = -(-(2 * 2 * group_size * 4) // _FLAG_BYTES_ALIGN) * _FLAG_BYTES_ALIGN
    return flag_bytes, flag_bytes + workspace_bytes(group_size, cap, dtype)


def _views(mm: mmap.mmap, group_size: int, cap: int, dtype: torch.dtype):
    flag_bytes, _ = _layout(group_size, cap, dtype)
    flags = torch.frombuffer(mm, dtype=torch.int32, count=4 * group_size).view(2, 2, group_size)
    recv = torch.frombuffer(mm, dtype=dtype, count=2 * group_size * cap, offset=flag_bytes)
    return recv.view(2, group_size, cap), flags


def _agree(rnd: Round, key, ranks, cap, name, old: Workspace | None) -> dict:
    """The round's first exchange: every rank needs the same workspace at the same call."""
    me = {"key": list(map(str, key)), "cap": cap, "name": name, "calls": old.calls if old else 0,
          "token": config.shm_prefix + "rs" + uuid.uuid4().hex[:8]}
    everyone = rnd.exchange("need", me)
    mine = {k: me[k] for k in ("key", "cap", "calls")}
    for r, theirs in sorted(everyone.items()):
        if {k: theirs[k] for k in mine} != mine:
            msg = (f"torch_ce: reduce-scatter ranks disagree at a workspace round of group "
                   f"{list(ranks)}: rank {r} runs {theirs['name']} (slices of {theirs['cap']} "
                   f"{theirs['key'][1]}, call {theirs['calls']}), this rank {name} (slices of {cap}, "
                   f"call {me['calls']}). Every rank of a group must run the same graphs.")
            rnd.abort(msg)
            raise ReduceScatterError(msg)
    return everyone


def _open_host(key, ranks, index, cap, dtype, name, old: Workspace | None) -> Workspace:
    """One round: every rank states what it needs, creates its segment, maps its peers'."""
    from .host import SHM_DIR, _map, segment_name

    rnd = _round(ranks)
    everyone = _agree(rnd, key, ranks, cap, name, old)
    job = everyone[min(everyone)]["token"]
    gen = f"{cap}x{(old.calls if old else 0)}"
    _, nbytes = _layout(len(ranks), cap, dtype)
    path = os.path.join(SHM_DIR, segment_name(job, ranks, key[1], 0, index) + f"_{gen}")
    mm = _map(path, nbytes, create=True)
    try:
        recv, flags = _views(mm, len(ranks), cap, dtype)
        flags.zero_()
        flags[FREE].fill_(1)  # every peer's half is free before the first push
        rnd.exchange("created", True)
        handles, peer_recv, peer_flags = [mm], [], []
        for j in range(len(ranks)):
            if j == index:
                peer_recv.append(recv)
                peer_flags.append(flags)
                continue
            pm = _map(os.path.join(SHM_DIR, segment_name(job, ranks, key[1], 0, j) + f"_{gen}"),
                      nbytes, create=False)
            handles.append(pm)
            r, f = _views(pm, len(ranks), cap, dtype)
            peer_recv.append(r)
            peer_flags.append(f)
        rnd.exchange("mapped", True)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return Workspace(key, index, cap, dtype, recv, flags, peer_recv, peer_flags, handles, job,
                     calls=old.calls if old else 0)


def _open_cuda(key, ranks, index, cap, dtype, name, device, old: Workspace | None) -> Workspace:
    """One round, after this device finished all its work (a peer's pushes and flag writes
    into an old workspace are then done everywhere once every rank passed the first
    exchange): allocate, rendezvous (symmetric memory, over the group), set the flags,
    and a last exchange so no peer writes a flag before its owner set it."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.synchronize(device)
    rnd = _round(ranks)
    _agree(rnd, key, ranks, cap, name, old)
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
        recv = hdl.get_buffer(r, (2, w, cap), dtype, (base + flag_bytes) // dtype.itemsize)
        return recv, flags

    peer = [views(r) for r in range(w)]
    recv, flags = peer[index]
    flags.zero_()
    flags[FREE].fill_(1)
    torch.cuda.synchronize(device)
    rnd.exchange("ready", True)
    del dist
    return Workspace(key, index, cap, dtype, recv, flags, [p[0] for p in peer], [p[1] for p in peer],
                     [buf, hdl], "", calls=old.calls if old else 0)


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


def abort_key(ranks: tuple) -> str:
    return f"torch_ce/reduce_scatter_abort/{'-'.join(map(str, ranks))}"


def post_abort(ranks: tuple, message: str) -> None:
    """Tell the group's other waiters that this rank gave up (best effort)."""
    from .agreement import _store

    try:
        _store().set(abort_key(ranks), message.encode())
    except Exception:  # noqa: BLE001 (the store may be gone with the job)
        pass


def wait_flag(ws: Workspace, kind: int, half: int, peer: int, what: str) -> None:
    """Wait until this rank's flag ``(kind, half, peer)`` is 1, then reset it to 0.
    Bounded by ``rs_timeout_s``; a peer's abort is seen within a quarter second."""
    from .agreement import _store

    flags = ws.flags
    if int(flags[kind, half, peer]) != 1:
        timeout = float(config.rs_timeout_s)
        start = time.monotonic()
        next_abort = start + _ABORT_EVERY_S
        sleep = _POLL_S[0]
        while int(flags[kind, half, peer]) != 1:
            now = time.monotonic()
            if now >= next_abort:
                next_abort = now + _ABORT_EVERY_S
                store, k = _store(), abort_key(ws.key[0])
                if store.check([k]):
                    raise ReduceScatterError(
                        f"torch_ce: {what}: a peer gave up: {store.get(k).decode(errors='replace')}")
            if now - start > timeout:
                ranks = ws.key[0]
                msg = (f"torch_ce: {what}: rank {ranks[peer]} of group {list(ranks)} did not "
                       f"{'push its slice' if kind == DATA else 'free its receive half'} within "
                       f"{timeout:g} s (rs_timeout_s; a rank that crashed, hangs, or runs other "
                       "graphs than its peers?)")
                post_abort(ranks, f"rank {ranks[ws.index]} timed out: {msg}")
                raise ReduceScatterError(msg)
            time.sleep(sleep)
            sleep = min(max(sleep * 2, 2e-5), _POLL_S[1])
    flags[kind, half, peer] = 0
