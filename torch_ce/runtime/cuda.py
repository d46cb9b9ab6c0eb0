"""The copy-engine transport: symmetric-memory windows and batched one-sided peer reads.

# NOTE [copy-engine gather]
A gather of a bucket is: the copy stream waits on the current stream (the fresh outputs
were allocated there), one ``cudaMemcpyBatchAsync`` submits every (member x peer) read,
an event is recorded, and the outputs are registered as c10d work. ``wait_tensor`` on an
output makes the consumer's stream wait on that event. No SM kernel runs and no rank
waits for another: the sources are static weights published once at bind time.
When the batched API is missing (runtime < 12.8) or a CUDA graph is being captured (the
batched API is not capturable) the same reads go out as one cudaMemcpyAsync each.

With the C++ kernels loaded (torch_ce/native.py) the gathers of bound shards run in C++
(NOTE [native gather path] in csrc/ce_torch.cpp, which also copies this rank's own rows on
a second stream); this module then serves the windows, the calibration and the ops'
fallbacks, and is the whole CUDA path where the C++ kernels were not built.
"""
from __future__ import annotations

import threading
import warnings

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work, _register_work

from . import _cuda_lib
from . import windows as W
from .windows import Slot, Window

_streams: dict[int, torch.cuda.Stream] = {}
_stream_lock = threading.Lock()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One dedicated copy stream per device (high priority: gathers gate compute)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _streams.get(idx)
    if s is None:
        with _stream_lock:
            s = _streams.get(idx)
            if s is None:
                s = torch.cuda.Stream(device=idx, priority=-1)
                _streams[idx] = s
    return s


class CopyEngineWork(Work):
    """c10d work for one bucket: ``wait()`` orders the current stream after the copies."""

    def __init__(self, event: torch.cuda.Event):
        super().__init__()
        self.event = event

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 (copies cannot hang)
        torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return self.event.query()


def open_windows(windows: list[Window], rnd, tag: str, job: str) -> None:  # noqa: ARG001
    """Allocate every window, agree that all ranks could, then rendezvous each (collective
    over the group). An allocation failure (out of memory) is thus seen by every rank at
    the exchange instead of leaving its peers inside a rendezvous."""
    import torch.distributed._symmetric_memory as symm_mem

    bufs = []
    for w in windows:
        try:  # needed on older torch; deprecated (a warning) or absent on newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(w.group.group_name)
        except Exception:
            pass
        bufs.append(symm_mem.empty(max(w.nbytes, 1), dtype=torch.uint8, device=w.device))
    rnd.exchange(f"cuda-allocated{tag}", True)
    for w, buf in zip(windows, bufs):
        hdl = symm_mem.rendezvous(buf, w.group.group_name)
        w.local = buf
        w.handle = hdl
        # The buffer may sit at an offset inside a pooled symmetric allocation; the offset
        # is the same on every rank.
        w.base_offset = buf.data_ptr() - int(hdl.buffer_ptrs[hdl.rank])
        w.peer_base_ptrs = [int(p) + w.base_offset for p in hdl.buffer_ptrs]
    # Symmetric memory cannot reuse the caching allocator's blocks: hand them back.
    torch.cuda.empty_cache()


def slot_local_view(slot: Slot) -> torch.Tensor:
    """This rank's slot as a tensor whose storage starts at the slot (storage_offset 0)."""
    w = slot.window
    return w.handle.get_buffer(w.rank, slot.shape, slot.dtype, _elem_offset(slot))


def _elem_offset(slot: Slot) -> int:
    byte_off = slot.window.base_offset + slot.offset
    assert byte_off % slot.dtype.itemsize == 0
    return byte_off // slot.dtype.itemsize


def publish_slot(slot: Slot) -> None:
    w = slot.window
    slot.peer_ptrs = [base + slot.offset for base in w.peer_base_ptrs]
    off = _elem_offset(slot)
    slot.peer_views = [w.handle.get_buffer(r, slot.shape, slot.dtype, off) for r in range(w.group_size)]


def gather_into(outs: list[torch.Tensor], slots: list[Slot]) -> None:
    """Issue all reads of one bucket on the copy stream and register the outputs' work.

    This is the hot path (once per gather): the bucket's sources and sizes are cached as
    ready ctypes arrays, the stream handles are passed straight to the library, and no
    stream context is entered unless the library is missing.
    """
    device = outs[0].device
    cur = torch.cuda.current_stream(device)
    side = copy_stream(device)
    capturing = torch.cuda.is_current_stream_capturing()
    ready = torch.cuda.Event()
    ready.record(cur)
    side.wait_event(ready)  # the outputs were allocated on the current stream
    layout = _bucket_layout(slots)
    dsts = layout.dsts
    i = 0
    for out, member_offsets in zip(outs, layout.offsets):
        base = out.data_ptr()
        for off in member_offsets:
            dsts[i] = base + off
            i += 1
    if not capturing and _cuda_lib.batch_supported():
        _cuda_lib.memcpy_batch(dsts, layout.srcs, layout.sizes, side.cuda_stream)
    elif _cuda_lib.is_built():
        _cuda_lib.memcpy_peer_fallback(dsts, layout.srcs, layout.sizes, side.cuda_stream)
    else:  # no compiled library: the same per-peer reads through torch
        with torch.cuda.stream(side):
            for out, slot in zip(outs, slots):
                chunks = out.view(slot.group_size, *slot.shape)
                for r, src in enumerate(slot.peer_views):
                    chunks[r].copy_(src, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(side)
    work = CopyEngineWork(ev)
    for out in outs:
        # Outside capture the caching allocator must not hand the output to another
        # stream's work while the copies may still write it. Under capture a pending
        # stream use would keep the block allocated in the graph's pool after capture
        # (CUDA-graph trees reject that); the consumer's wait_tensor joins the copy
        # stream back before any use or free of the output.
        if not capturing:
            out.record_stream(side)
        _register_work(out, work)


class _Layout:
    """A bucket's static copy plan: ctypes arrays of sources and sizes, a destination array
    refilled per call (the runtime reads it during the call), per-member offsets."""

    def __init__(self, slots: list[Slot]):
        import ctypes

        srcs, sizes, self.offsets = [], [], []
        for slot in slots:
            srcs += slot.peer_ptrs
            sizes += [slot.nbytes] * len(slot.peer_ptrs)
            self.offsets.append([r * slot.nbytes for r in range(len(slot.peer_ptrs))])
        n = len(srcs)
        self.srcs = (ctypes.c_void_p * n)(*srcs)
        self.sizes = (ctypes.c_size_t * n)(*sizes)
        self.dsts = (ctypes.c_void_p * n)()
        self.first = slots[0]


_layouts: dict[tuple, tuple] = {}
W.on_release(_layouts.clear)


def _bucket_layout(slots: list[Slot]) -> _Layout:
    key = tuple(id(s) for s in slots)
    hit = _layouts.get(key)
    if hit is None or hit.first is not slots[0]:
        hit = _layouts[key] = _Layout(slots)
    return hit


def available() -> bool:
    return torch.cuda.is_available()


def barrier(group) -> None:
    torch.cuda.synchronize()
    dist.barrier(group=group)
