"""The row gather of embedding lookups as a Triton kernel: what serves
``magi::ce_gather_rows`` on CUDA when the library was built without nvcc (NOTE [building
without nvcc] in runtime/toolchain.py), so without csrc/ce_rows.cu.

The same kernel as NOTE [row kernel] in csrc/ce_rows.cu: one program per output row reads
row ``ids[i]`` from its owner's copy, ``peers[owner] + local_row * row_bytes`` (symmetric
memory maps every peer's window into this process), and stores it to the output, on the
current stream. The owners' addresses are a small device table (one int64 per rank) built
when the slot is registered (``table``), outside any capture; a lookup reads it on the
device, so nothing syncs with the host and the launch is capturable in a CUDA graph. Rows
move in the widest word that the row size and every address allow (8 bytes; the kernel is
told 16-byte alignment when it holds, on the pointer itself: a hint on the integer address
does not survive ``int_to_ptr``, and only then do the loads vectorize to 16 bytes,
``ld.global.v2.b64`` in the sm_90 PTX). An id outside
the table prints and faults (a device-side error, as CUDA's embedding asserts;
``tl.device_assert`` is a no-op unless TRITON_DEBUG is set).

Triton is imported on first use only: the runtime imports without it (CPU torch), and
``unavailable()`` says why it cannot serve.
"""
from __future__ import annotations

import contextlib
import functools

import torch


def unavailable() -> str | None:
    """Why the Triton kernel cannot run here (None: it can)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure means: not here)
        return f"triton is not importable ({type(e).__name__}: {e})"
    return None


def table(peer_ptrs, device: torch.device) -> torch.Tensor:
    """The owners' addresses as the kernel reads them (int64, on ``device``). Built at
    register time: a host-to-device copy, which a CUDA-graph capture would reject."""
    return torch.tensor([int(p) for p in peer_ptrs], dtype=torch.int64, device=device)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rows_kernel(table_ptr, ids_ptr, out_ptr, rows_per_rank, total_rows, row_bytes,
                    row_words, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        row = tl.load(ids_ptr + i).to(tl.int64)
        if (row < 0) | (row >= total_rows):
            tl.device_print("torch_ce: ce_gather_rows: index out of range: ", row)
            tl.store((row * 0).to(out_ptr.dtype), tl.load(out_ptr))  # fault on purpose
        owner = row // rows_per_rank
        addr = tl.load(table_ptr + owner) + (row - owner * rows_per_rank) * row_bytes
        src = tl.multiple_of(addr.to(out_ptr.dtype), ALIGN)
        dst = out_ptr + i * row_words
        for start in range(0, row_words, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < row_words
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return rows_kernel


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def gather_rows(peers: torch.Tensor, peer_ptrs, shape, dtype: torch.dtype,
                ids: torch.Tensor) -> torch.Tensor:
    """``[*ids.shape, *shape[1:]]`` rows of the table whose rank r holds rows
    ``[r * shape[0], (r + 1) * shape[0])`` at ``peer_ptrs[r]`` (``peers``: their
    ``table``), on the current stream."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise RuntimeError(f"torch_ce: gather_rows: ids must be int64 or int32, got {ids.dtype}")
    if ids.device != peers.device:
        raise RuntimeError(f"torch_ce: gather_rows: ids on {ids.device}, shard on {peers.device}")
    rows = int(shape[0])
    out = torch.empty((*ids.shape, *shape[1:]), dtype=dtype, device=peers.device)
    n = ids.numel()
    if n == 0 or rows == 0:
        return out
    row_bytes = out.numel() // n * out.element_size()
    align = row_bytes | out.data_ptr()
    for p in peer_ptrs:
        align |= int(p)
    width, word = next((w, t) for w, t in _WORDS if align % w == 0)
    row_words = row_bytes // width
    block = min(1024, triton_next_pow2(row_words))
    with torch.cuda.device(peers.device) if peers.is_cuda else contextlib.nullcontext():
        _kernel()[(n,)](peers, ids.reshape(-1).contiguous(), out.view(-1).view(word), rows,
                        rows * len(peer_ptrs), row_bytes, row_words,
                        ALIGN=16 if align % 16 == 0 else width, BLOCK=block,
                        num_warps=4 if block >= 512 else 1)
    return out


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
