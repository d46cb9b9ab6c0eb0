"""The copy-engine reduce-scatter's reduction as a Triton kernel: what serves the native
completion (NOTE [native reduce-scatter path] in csrc/ce_reduce_scatter.cu) when the
library was built without nvcc (NOTE [building without nvcc] in runtime/toolchain.py), so
without csrc/ce_reduce.cu. The C++ completion calls it through the op
``torch_ce::rs_reduce_fallback`` on the reduce stream (``reference.reduce_fallback``).

The same arithmetic as NOTE [reduction kernel] in csrc/ce_reduce.cu and as
``reference._reduce`` on CUDA, bit for bit: per member of the bucket, one launch whose
programs grid-stride over its elements; each loads the W sources of its block in group
index order (this rank's own chunk from the input in place, the peers' from the receive
half), widens them to fp32 and adds left to right (``premul_sum``: each source times the
fp32 factor first); ``avg`` multiplies the sum by fp32(1 / W) (torch's CUDA ``div_`` by a
scalar); one rounding to the output's dtype (round to nearest even). The launch passes
``enable_fp_fusion=False``: a multiply followed by an add must stay two roundings, never a
fused multiply-add; the fp32 to bf16 cast is round to nearest even (Triton's default on
the GPU). Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors
(test/test_reduce_kernel_host.py checks its fp32 arithmetic there; the interpreter's bf16
cast truncates, so bf16 is checked on the GPU only).

Triton is imported on first use only; ``unavailable()`` says why it cannot serve.
"""
from __future__ import annotations

import functools
import os

import torch

OPS = {"sum": 0, "avg": 1}
PREMUL = 2
BLOCK = 1024
MAX_PROGRAMS = 1024


def unavailable() -> str | None:
    """Why the Triton kernel cannot run here (None: it can)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure means: not here)
        return f"triton is not importable ({type(e).__name__}: {e})"
    return None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def reduce_kernel(own_ptr, recv_ptr, out_ptr, n, slice_elems, off, scale,
                      W: tl.constexpr, SELF: tl.constexpr, OP: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        for start in range(pid * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for j in tl.static_range(W):
                if j == SELF:
                    x = tl.load(own_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                else:
                    x = tl.load(recv_ptr + j * slice_elems + off + offs, mask=mask, other=0.0).to(tl.float32)
                if OP == 2:
                    x = x * scale
                if j == 0:
                    acc = x
                else:
                    acc = acc + x
            if OP == 1:
                acc = acc * scale
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return reduce_kernel


def op_and_scale(op: int, factor: float, world: int) -> float:
    """The scale the kernels take, rounded to fp32 by the launch: 1 / W for avg (torch's
    CUDA ``div_`` by a scalar multiplies by it), the factor for premul_sum."""
    return 1.0 / world if op == OPS["avg"] else float(factor)


def reduce(owns, outs, recv_half: torch.Tensor, index: int, offs, op: int, factor: float) -> None:
    """``outs[m]`` = the reduction of member m: this rank's ``owns[m]`` (its chunk of the
    input) at group index ``index``, sender j's elements ``recv_half[j, offs[m]:offs[m] + n]``
    for every other j; on the current stream."""
    world = recv_half.shape[0]
    scale = op_and_scale(op, factor, world)
    kernel = _kernel()
    flat = recv_half.reshape(-1)
    cap = recv_half.shape[1]
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    for own, out, off in zip(owns, outs, offs, strict=True):
        n = out.numel()
        if n == 0:
            continue
        grid = (max(1, min(MAX_PROGRAMS, -(-n // BLOCK))),)
        extra = {} if interpret else {"enable_fp_fusion": False}
        kernel[grid](own, flat, out.view(-1), n, cap, int(off), scale, W=world, SELF=int(index), OP=int(op),
                     BLOCK=BLOCK, **extra)
