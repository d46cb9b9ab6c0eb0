"""The copy-engine transport's windows: symmetric-memory buffers, slots and peer addresses.

# NOTE [copy-engine gather]
A gather of a bucket is: the copy streams wait on the current stream (the fresh outputs
were allocated there), one ``cudaMemcpyBatchAsync`` on the peer-copy stream submits every
(member x peer) read while a second copy stream copies this rank's own rows (a same-device
copy inside the peer batch held the peer reads back), an event is recorded after both, and the outputs are registered as c10d work. ``wait_tensor`` on an
output makes the consumer's stream wait on that event. No SM kernel runs and no rank
waits for another: the sources are static weights published once at bind time.
When the batched API is missing (runtime < 12.8) or a CUDA graph is being captured (the
batched API is not capturable) the same reads go out as one cudaMemcpyAsync each.

That gather is the C++ kernel (NOTE [native gather path] in csrc/ce_gather.cu; loaded by
runtime/native.py). This module opens and publishes the windows it reads: each slot gets
its peers' addresses (``peer_ptrs``, for the C++ index) and typed views (``peer_views``,
for the pure-torch fallback in runtime/gather.py).
"""
from __future__ import annotations

import warnings

import torch

from .windows import Slot, Window


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
