"""Without a gather kernel, transport="copy_engine" keeps every gather on the collective,
says so once, loudly, and stays exact.

A CUDA job whose C++ kernels were not built takes this path (``native.kernel_refusal``);
here 2 gloo ranks take it for CPU weights through the test hook
``native.kernels_unavailable("cpu")``: a compiled SimpleFSDP model binds nothing, every
weight is refused with NO_GATHER_KERNEL, no gather reads a window, one warning (and one
log record) names why and how to fix it, and the output equals eager exactly.
"""
from __future__ import annotations

import logging

import torch

from mp_harness import count_gathers, run_ranks, setup_compile


def _model(world: int, seed: int):
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    from torch_ce.simple_fsdp import shard_linears

    torch.manual_seed(seed)  # the same weights on every rank
    dims = [16 * world, 32 * world, 8 * world]
    eager = nn.Sequential(nn.Linear(dims[0], dims[1], bias=False), nn.ReLU(),
                          nn.Linear(dims[1], dims[2], bias=False)).requires_grad_(False)
    model = nn.Sequential(*[nn.Linear(m.in_features, m.out_features, bias=False)
                            if isinstance(m, nn.Linear) else nn.ReLU() for m in eager])
    model.load_state_dict(eager.state_dict())
    return shard_linears(model, init_device_mesh("cpu", (world,))), eager, dims[0]


def _rank(rank, world, cache_root, seed):
    from torch_ce.runtime import native

    setup_compile(cache_root, rank)
    with native.kernels_unavailable("cpu"):
        return _rank_without_kernels(seed, world)


def _rank_without_kernels(seed, world):
    import warnings

    import torch_ce
    from torch_ce import report
    from torch_ce.runtime import gather, native
    from torch_ce.runtime import windows as W
    from torch_ce.runtime.eligibility import Reason

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("torch_ce").addHandler(handler)
    counts = count_gathers()
    model, eager, d_in = _model(world, seed)
    gen = torch.Generator().manual_seed(seed + 1)  # the same inputs on every rank
    xs = [torch.randn(5, d_in, generator=gen) for _ in range(3)]
    torch_ce.enable(transport="copy_engine")
    try:
        compiled = torch.compile(model, fullgraph=True)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            exact = [torch.equal(compiled(x), eager(x)) for x in xs]
    finally:
        torch_ce.disable()
    ours = [str(w.message) for w in caught if str(w.message).startswith("torch_ce: transport='copy_engine'")]
    logged = [r.getMessage() for r in records
              if r.levelno == logging.WARNING and "gather kernels" in r.getMessage()]
    refusal = native.kernel_refusal("cpu")
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    return dict(
        exact=exact,
        warnings=ours,
        logged=logged,
        code=refusal.code == Reason.NO_GATHER_KERNEL,
        refusal=str(refusal),
        skipped=[dict(b.skipped) for b in report.binds],
        bound=[len(b.bound) for b in report.binds],
        entries=[type(W.lookup(m.parametrizations.weight.original._local_tensor)).__name__ for m in linears],
        window_gathers=dict(counts),
        path=gather.kernel_path("cpu"),
    )


def test_no_kernel_keeps_gathers_on_the_collective(tmp_path):
    seed = int(torch.randint(0, 2**31, ()).item())
    for r in run_ranks(_rank, 2, str(tmp_path), seed, timeout=240):
        assert all(r["exact"]) and len(r["exact"]) == 3, r
        # One loud warning per process, however many weights were refused, and one log line.
        assert len(r["warnings"]) == 1 and len(r["logged"]) == 1, r
        msg = r["warnings"][0]
        assert "kernels_unavailable" in msg and "pip install" in msg and "TORCH_CE_CUDA_TORCH_FALLBACK=1" in msg, msg
        # Every weight refused with NO_GATHER_KERNEL, in the bind's report and the registry.
        assert r["code"] and "no cpu gather kernel" in r["refusal"], r
        assert r["bound"] == [0] and len(r["skipped"]) == 1, r
        assert list(r["skipped"][0].values()) == [r["refusal"]] * 2, r
        assert r["entries"] == ["Fallback", "Fallback"], r
        # No gather read a window: all of them ran on gloo.
        assert r["window_gathers"] == {"native": 0, "torch": 0}, r
        assert r["path"].startswith("none: gathers stay on the collective"), r
