"""Row gathers on GPUs (NOTE [row kernel] in csrc/ce_rows.cu): ``magi::ce_gather_rows`` on
symmetric-memory windows with NCCL ranks, through the C++ row kernel and through the
opted-in pure-torch fallback, compared exactly with NCCL's full gather + ``embedding``
(the same cases as the CPU test, test/test_rows_host.py); and a compiled SimpleFSDP-style
embedding on the GPUs, exact against eager.

Runs on TORCH_CE_GPU_WORLD ranks (default 2), skipped with fewer GPUs.
"""
from __future__ import annotations

import pytest
import torch

from cuda_helpers import GPU_WORLD, needs_gpu_world
from mp_harness import run_ranks, seed_base

pytestmark = needs_gpu_world


def _rank_op_cuda(rank, ws, base, kind):
    """test_rows_host's op checks on CUDA, counting which row path served them ("native":
    the row kernel ``gather.row_path()`` chose, CUDA or Triton; "torch": ``take_rows``)."""
    import torch_ce
    from test_rows_host import _rank_op
    from torch_ce.runtime import gather, native, rows_triton

    if kind == "native":
        assert native.loaded(), "the C++ kernels are not loaded"
    else:
        assert not native.loaded() and torch_ce.config.cuda_torch_fallback
    counts = {"native": 0, "torch": 0}

    def counted(mod, name, path):
        real = getattr(mod, name)

        def call(*a):
            counts[path] += 1
            return real(*a)

        setattr(mod, name, call)

    counted(native, "gather_rows", "native")
    counted(rows_triton, "gather_rows", "native")
    counted(gather, "take_rows", "torch")
    checked = _rank_op(rank, ws, base, "cuda")
    torch.cuda.synchronize()  # a device-side fault would surface here
    return checked, counts


@pytest.mark.parametrize("kind", ["native", "torch_fallback"])
def test_cuda_rows_exact(kind):
    from torch_ce.runtime import native

    if kind == "native" and native.library_path() is None:
        pytest.skip("the C++ kernels are not built")
    env = None if kind == "native" else {"TORCH_CE_NATIVE": "0", "TORCH_CE_CUDA_TORCH_FALLBACK": "1"}
    res = run_ranks(_rank_op_cuda, GPU_WORLD, seed_base(), kind, backend="nccl", timeout=300, env=env)
    from test_rows_host import TABLES

    for checked, counts in res:
        assert checked == len(TABLES) * 6
        path = "native" if kind == "native" else "torch"
        assert counts[path] == checked and sum(counts.values()) == checked, counts


def _rank_compiled_cuda(rank, ws, base, cache_root):
    import os

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, f"inductor_rank{rank}")
    import torch_ce
    from mp_harness import fsdp_every_param as _fsdp
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh

    torch._inductor.config.fx_graph_cache = False
    mesh = init_device_mesh("cuda", (ws,))
    vocab, dim = 1024 * ws, 4096  # 8 KiB bf16 rows: the kernel's 16-byte path
    torch.manual_seed(base)
    model = _fsdp(torch.nn.Embedding(vocab, dim, dtype=torch.bfloat16, device="cuda").eval(), mesh)
    gen = torch.Generator().manual_seed(base + 1 + rank)
    ids = torch.randint(0, vocab, (4, 512), generator=gen).cuda()
    torch_ce.enable(transport="copy_engine")
    try:
        with torch.no_grad():
            eager = model(ids)
            got, codes = run_and_get_code(torch.compile(model, fullgraph=True), ids)
            again = torch.compile(model, fullgraph=True)(ids.flip(1))
            eager_again = model(ids.flip(1))
        torch.cuda.synchronize()
        return dict(exact=[torch.equal(got, eager), torch.equal(again, eager_again)],
                    rows_calls="\n".join(codes).count("torch.ops.magi.ce_gather_rows.default("))
    finally:
        torch_ce.disable()


def test_cuda_compiled_embedding_rows(tmp_path):
    res = run_ranks(_rank_compiled_cuda, GPU_WORLD, seed_base(), str(tmp_path.resolve()),
                    backend="nccl", timeout=300)
    for rank, r in enumerate(res):
        assert r["exact"] == [True, True] and r["rows_calls"] == 1, (rank, r)
