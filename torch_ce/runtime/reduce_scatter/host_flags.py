"""Host-mapped flag words of a CUDA reduce-scatter workspace (NOTE [poison word] in
csrc/ce_flags.cu): why and when they replace the device-memory flags.

Under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream shares one hardware queue, so the
watchdog's flag writes, enqueued on a stream of its own, queue behind the very wait they
should release; a host store into host-mapped memory releases it (docs/DESIGN.md "No
hang"). So there each rank's flags, header and two poison words (one per half) live in a
/dev/shm segment that every rank of the group maps and registers with CUDA
(``cudaHostRegister``, mapped); the slices stay in symmetric device memory. The waits and
writes are the same stream memory operations on the segment's addresses; the watchdog
releases a call by host stores: the call's tag into its half's poison word, then the
awaited flags; the reduction kernel, already enqueued behind the waits, reads the poison
word and writes NaN (csrc/ce_reduce.cu), never the sum of slices that were not pushed.

Only the native completion with the CUDA reduction kernel reads the poison word, so host
flags need it (``unavailable``); elsewhere under one queue the op keeps the collective
(``RsReason.ONE_QUEUE``, runtime/reduce_scatter/op.py).

Names live as long as the host transport's (runtime/host.py): at world 2 a peer's name is
unlinked as soon as it is mapped, the own name after the last exchange, and every name of
the round on the ranks left when the round fails.
"""
from __future__ import annotations

import mmap
import os

import torch

from ...config import config
from .. import host, native
from ..watchdog import one_queue  # noqa: F401 (the op and the tests ask it here)

_PAGE = mmap.PAGESIZE


def words(group_size: int) -> int:
    """int32 words of one rank's segment: flags [2, 2, W], head [2, W, 2], poison [2]."""
    return 8 * group_size + 2


def segment_bytes(group_size: int) -> int:
    return -(-words(group_size) * 4 // _PAGE) * _PAGE  # whole pages: cudaHostRegister's unit


def unavailable() -> str | None:
    """Why host flags cannot serve here (None: they can): only the native completion's
    CUDA reduction kernel reads the poison word."""
    if not config.rs_native:
        return "config.rs_native is off (the Python completion does not read the poison word)"
    if not native.has_rs_native():
        return "the C++ library has no native reduce-scatter (rebuild csrc/)"
    if not native.rs_has_kernel():
        return "the library was built without nvcc: no CUDA reduction kernel reads the poison word"
    return None


def wanted() -> bool:
    """Whether a CUDA workspace opened now puts its flags in host memory
    (``config.rs_host_flags``; auto: under one hardware queue, where they can serve)."""
    if config.rs_host_flags is not None:
        return bool(config.rs_host_flags)
    return one_queue() and unavailable() is None


class Unmappable(RuntimeError):
    """This device cannot take the segment's host address as its own (``_open_cuda``
    turns it into a ReduceScatterError naming the round)."""


class FlagSegment:
    """One rank's words in a mapped segment, registered with CUDA when ``register`` (the
    device addresses are the host ones: UVA, checked), unregistered when this goes."""

    def __init__(self, mm: mmap.mmap, group_size: int, register: bool):
        self.mm = mm
        w = group_size
        all_words = torch.frombuffer(mm, dtype=torch.int32, count=len(mm) // 4)
        self.base = all_words.data_ptr()
        self.registered = False
        if register:
            dptr = native.host_register(self.base, len(mm))
            self.registered = True
            if dptr != self.base:
                self.close()
                raise Unmappable(
                    f"a host-mapped flag segment's device address {dptr:#x} is not its host "
                    f"address {self.base:#x} (this device cannot use host pointers for registered memory)")
        self.flags = all_words[:4 * w].view(2, 2, w)
        self.head = all_words[4 * w:8 * w].view(2, w, 2)
        self.poison = all_words[8 * w:8 * w + 2]

    def close(self) -> None:
        if self.registered:
            self.registered = False
            native.host_unregister(self.base)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter teardown: the library may be gone)
            pass


def open_group(rnd, paths: list[str], index: int, register: bool = True) -> list[FlagSegment]:
    """One segment per rank of the group (``paths[j]``: rank j's name), this rank's
    created with every free flag set, its peers' mapped after an exchange; two exchanges
    of ``rnd`` (``Round``; None: one process owns every path, the loopback tests')."""
    w = len(paths)
    mine = [index] if rnd is not None else list(range(w))
    segs: list = [None] * w
    ok = False
    try:
        for j in mine:
            segs[j] = FlagSegment(host._map(paths[j], segment_bytes(w), create=True), w, register)
            segs[j].flags[1].fill_(1)  # FREE: every peer's half is free before the first push
        if rnd is not None:
            rnd.exchange("flags-created", True)
        for j in range(w):
            if segs[j] is None:
                segs[j] = FlagSegment(host._map(paths[j], segment_bytes(w), create=False), w, register)
                if w == 2:
                    host._unlink(paths[j])  # this rank is its only other reader
        if rnd is not None:
            rnd.exchange("flags-mapped", True)
        ok = True
    finally:
        for j, path in enumerate(paths):
            if j in mine or not ok:  # a failed round: a killed peer's name too
                host._unlink(path)
    return segs
