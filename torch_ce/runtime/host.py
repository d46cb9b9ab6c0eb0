"""The host transport: symmetric windows in POSIX shared memory, peer reads as memcpy.

On machines without GPUs this runs the same one-sided protocol as the copy-engine
transport (same pools, offsets, registry and bind step) on CPU tensors, so CI exercises
the whole pipeline with several gloo processes. It is a real transport, not a mock.

Each rank creates ``/dev/shm/<job>_<group>_<dtype>_<n>_r<rank>``, where ``job`` is the
lowest rank's ``config.shm_prefix`` (``torch_ce_`` by default) and a random token of the
bind (runtime/binding.py); after one exchange every rank maps its peers' segments, and
after a second the names are unlinked: the mappings live on, and nothing of ours is left
in /dev/shm even if the job dies later. A name lives no longer than that: at
world 2 a rank unlinks its peer's name as soon as it has mapped it (it is its only other
reader), and when the exchanges fail here (a peer killed mid-bind, a timeout) this rank
unlinks every name of the bind, its peers' too, so a killed rank leaves no segment.
"""
from __future__ import annotations

import mmap
import os

import torch
from .windows import Slot, Window

SHM_DIR = "/dev/shm"


def segment_name(job: str, group_ranks: tuple, dtype: str, n: int, rank: int) -> str:
    grp = "-".join(map(str, group_ranks)) if len(group_ranks) <= 8 else f"{hash(group_ranks) & 0xFFFFFFFF:x}"
    return f"{job}_{grp}_{dtype}_{n}_r{rank}"


def _map(path: str, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def open_windows(windows: list[Window], rnd, tag: str, job: str) -> None:
    """Create this rank's segments, map every peer's, unlink the names (collective: two
    exchanges of the bind's round, NOTE [bind rounds go through the store])."""
    if not windows:
        return
    mine = []
    ok = False
    try:
        for w in windows:
            name = segment_name(job, w.group_ranks, w.pool_key[1], w.index, w.rank)
            path = os.path.join(SHM_DIR, name)
            mm = _map(path, max(w.nbytes, 1), create=True)
            mine.append(path)
            w.local = torch.frombuffer(mm, dtype=torch.uint8, count=w.nbytes) if w.nbytes else torch.empty(0, dtype=torch.uint8)
            w.handle = [mm]
        rnd.exchange(f"host-created{tag}", True)
        for w in windows:
            w.peer_locals = []
            for r in range(w.group_size):
                if r == w.rank:
                    w.peer_locals.append(w.local)
                    continue
                name = segment_name(job, w.group_ranks, w.pool_key[1], w.index, r)
                mm = _map(os.path.join(SHM_DIR, name), max(w.nbytes, 1), create=False)
                if w.group_size == 2:
                    _unlink(os.path.join(SHM_DIR, name))  # this rank is its only other reader
                w.handle.append(mm)
                w.peer_locals.append(torch.frombuffer(mm, dtype=torch.uint8, count=w.nbytes))
        rnd.exchange(f"host-mapped{tag}", True)
        ok = True
    finally:
        for path in mine:
            _unlink(path)
        if not ok:  # a failed bind: a killed peer's names too (idempotent)
            for w in windows:
                for r in range(w.group_size):
                    _unlink(os.path.join(SHM_DIR, segment_name(job, w.group_ranks, w.pool_key[1], w.index, r)))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def slot_local_view(slot: Slot) -> torch.Tensor:
    """This rank's slot as a tensor whose storage starts at the slot (storage_offset 0)."""
    w = slot.window
    return _typed_view(w.handle[0], slot)


def _typed_view(mm: mmap.mmap, slot: Slot) -> torch.Tensor:
    numel = slot.nbytes // slot.dtype.itemsize
    t = torch.frombuffer(mm, dtype=slot.dtype, count=numel, offset=slot.offset) if numel else torch.empty(0, dtype=slot.dtype)
    return t.view(slot.shape)


def publish_slot(slot: Slot) -> None:
    """Fill the slot's peer views (typed views of every rank's copy of the shard): what the
    gather reads (``copy_peers`` in runtime/gather.py)."""
    w = slot.window
    slot.peer_views = [
        w.peer_locals[r][slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        for r in range(w.group_size)
    ]
