"""Own rows in place (NOTE [own rows in place] in torch_ce/passes/own_rows.py), for real.

CPU: gloo ranks and the host transport (2 and 3 ranks, so a middle rank has peers on both
sides). CUDA: 2 GPUs, NCCL, the C++ kernels (skipped without 2 GPUs). On fresh random data:

* ``ce_all_gather[_coalesced].peers`` equals the backend's full gather minus this rank's
  rows, exactly; so does the fallback of a shard refused by agreement;
* ``ce_linear`` equals ``x @ full.T`` (the same matmul by column blocks: to a float32
  rounding, exactly on CPU where the library's kernels match), and rejects shapes that do
  not make one weight;
* a compiled decoder with ``own_rows_in_place`` on runs ``ce_linear`` and the ``.peers``
  gathers and matches the same model compiled with full gathers.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from mp_harness import reference_all_gather, run_ranks


def _devices():
    yield pytest.param("cpu", id="cpu")
    yield pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 GPUs"))


def _setup(rank, device):
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank), dist.group.WORLD
    torch.set_num_threads(1)
    return torch.device("cpu"), dist.group.WORLD


def _wait(t):
    return torch.ops._c10d_functional.wait_tensor(t)


def _ops(rank, world, device, base):
    import torch_ce
    from torch_ce import windows as W

    dev, group = _setup(rank, device)
    gs, gn = world, group.group_name
    gen = torch.Generator().manual_seed(base + rank)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows, cols = 24, 40
    shards = [torch.randn(rows, cols, generator=gen).to(dtype).to(dev) for _ in range(3)]
    refused = torch.randn(rows, cols, generator=gen).to(dtype).to(dev)
    res = torch_ce.bind(shards, group)
    assert len(res.bound) == 3, res
    # A shard the agreement refused: bound on no rank, so register it as a fallback.
    W.register(refused, W.Fallback("test: refused by agreement", gn))
    fulls = [reference_all_gather(s, group) for s in shards + [refused]]
    peers_ref = [torch.cat([f[: rank * rows], f[(rank + 1) * rows:]]) for f in fulls]
    problems = []
    one = _wait(torch.ops.magi.ce_all_gather.peers(shards[0], gs, gn))
    if not torch.equal(one, peers_ref[0]):
        problems.append("ce_all_gather.peers differs from the reference")
    many = [_wait(o) for o in torch.ops.magi.ce_all_gather_coalesced.peers(shards[1:] + [refused], gs, gn)]
    for i, (o, r) in enumerate(zip(many, peers_ref[1:])):
        if o.shape != ((gs - 1) * rows, cols) or not torch.equal(o, r):
            problems.append(f"ce_all_gather_coalesced.peers member {i} differs")
    # ce_linear against x @ full.T, from the .peers output and the shard.
    x = torch.randn(7, cols, generator=gen).to(dtype).to(dev)
    y = torch.ops.magi.ce_linear(x, shards[0], one, gs, gn)
    ref = x @ fulls[0].t()
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    if y.shape != ref.shape or not torch.allclose(y, ref, **tol):
        problems.append(f"ce_linear differs from x @ full.T by {(y.float() - ref.float()).abs().max().item()}")
    # Against the same column blocks computed by torch here: the split itself is exact.
    blocks = [x @ fulls[0][r * rows:(r + 1) * rows].t() for r in range(gs)]
    if not torch.equal(y, torch.cat(blocks, 1)):
        problems.append("ce_linear differs from its column blocks")
    errors = []
    for bad in (one[:-1], one[:, :-1]):
        try:
            torch.ops.magi.ce_linear(x, shards[0], bad, gs, gn)
        except RuntimeError as e:
            errors.append("do not make one weight" in str(e))
    return dict(problems=problems, errors=errors)


@pytest.mark.parametrize("device", list(_devices()))
@pytest.mark.parametrize("world", [2, 3])
def test_peers_gather_and_ce_linear(device, world):
    if device == "cuda" and world > torch.cuda.device_count():
        pytest.skip(f"needs {world} GPUs")
    backend = "nccl" if device == "cuda" else "gloo"
    res = run_ranks(_ops, world, device, random.randrange(1 << 30), timeout=240, backend=backend)
    for r in res:
        assert r["problems"] == [], r
        assert r["errors"] == [True, True], r


def _compiled(rank, world, device, base, cache):
    from torch.distributed.device_mesh import init_device_mesh

    import torch_ce
    from torch_ce import report
    from torch_ce.simple_fsdp import build

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    dev, _ = _setup(rank, device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    mesh = init_device_mesh(device, (world,))
    dims = dict(layers=2, dim=16 * world, ffn=32 * world, heads=2)
    outs, code = {}, {}
    for own in (False, True):
        model = build(base, dev, dtype, mesh, **dims).eval()
        torch.manual_seed(base + 1)
        x = torch.randn(2, 5, dims["dim"], device=dev, dtype=dtype)
        torch_ce.enable(transport="copy_engine", own_rows_in_place=own)
        report.clear()
        try:
            from torch._inductor.utils import run_and_get_code

            torch._dynamo.reset()
            with torch.no_grad():
                y, src = run_and_get_code(torch.compile(model), x)
                y2 = torch.compile(model)(x)  # a second call (bound windows, no bind)
            outs[own] = (y.float().cpu(), y2.float().cpu())
            code[own] = "\n".join(src)
            rec = report.graphs[-1] if report.graphs else None
            own_rows = len(rec.own_rows) if rec else 0
        finally:
            torch_ce.disable()
            torch_ce.release_all()
    return dict(
        full=outs[False], split=outs[True], own_rows=own_rows,
        linear_calls=code[True].count("torch.ops.magi.ce_linear.default("),
        peers_calls=code[True].count(".peers("),
        full_code_linear=code[False].count("ce_linear"),
    )


@pytest.mark.parametrize("device", list(_devices()))
@pytest.mark.parametrize("world", [2, 3])
def test_compiled_decoder_own_rows(device, world, tmp_path):
    if device == "cuda" and world > torch.cuda.device_count():
        pytest.skip(f"needs {world} GPUs")
    backend = "nccl" if device == "cuda" else "gloo"
    res = run_ranks(_compiled, world, device, random.randrange(1 << 30), str(tmp_path / "cache"),
                    timeout=420, backend=backend)
    tol = dict(rtol=2e-2, atol=2e-2) if device == "cuda" else dict(rtol=1e-5, atol=1e-5)
    for r in res:
        assert r["own_rows"] == 10 and r["linear_calls"] == 10, r  # 2 layers x 5 linears
        assert r["peers_calls"] >= 1 and r["full_code_linear"] == 0, r
        for a, b in zip(r["full"], r["split"]):
            assert torch.isfinite(a).all() and a.abs().max() > 0
            torch.testing.assert_close(b, a, **tol)
