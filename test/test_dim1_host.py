"""Shard(1) experts on the copy-engine path, on CPU (host transport, gloo ranks).

torchtitan's graph_trainer shards routed experts (3-D ``[num_experts, out, in]``) on dim 1
when ``efsdp * ep > num_experts`` (``data_parallel(..., shard_dim=1)``). The post-grad
graph gathers along dim 0 and re-splits (NOTE [Shard(1) reads] in passes/gate.py); torch_ce
reads each peer's column block into its place (``magi.ce_all_gather_dim``), so the split
and cat leave the graph. Every output must be bit-identical to the plain compiled run
(``transport="nccl"``: gloo here) on fresh random data.

- ``test_experts_shard1_inference``: a 3-D expert module (two weights, dim-1 sharded),
  2 ranks: exact, both weights bound in ``explain()``, the generated code calls
  ``ce_all_gather_dim`` and no ``aten.cat`` of gathered blocks is left.
- ``test_dim2_inference``: a weight sharded on its last dim (``Shard(2)``): exact too.
- ``test_refused_fallback_exact``: the same module with the weights refused at bind
  (``symm_min_shard_mib`` above them at run time is not possible: the gate would refuse
  first, so the bind is made to refuse by the test hook ``_force_unavailable``): the
  gathers stay on the collective and the re-split is still exact.
- ``test_qwen3_moe_dim1_inference``: torchtitan's Qwen3-MoE (zoo, small dims) under
  graph_trainer's ``apply_simple_fsdp`` on 2 ranks with ep=1 and 1 expert... no: with
  ``data_parallel(shard_dim=1)`` applied to its experts as ``apply_simple_fsdp`` does when
  ``efsdp * ep > num_experts``; exact, every expert weight bound.
"""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("torchtitan.experiments.graph_trainer.simple_fsdp")

from mp_harness import run_ranks, seed_base, setup_compile  # noqa: E402

DIM_CALL = re.compile(r"torch\.ops\.magi\.ce_all_gather_dim\.default\(")


class Experts(torch.nn.Module):
    """Grouped experts as torchtitan writes them: w1 [E, H, D], w2 [E, D, H]."""

    def __init__(self, E=2, D=16, H=24):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(E, H, D))
        self.w2 = torch.nn.Parameter(torch.randn(E, D, H))

    def forward(self, x):  # x [E, T, D]
        h = torch.bmm(x, self.w1.transpose(1, 2))
        return torch.bmm(torch.relu(h), self.w2.transpose(1, 2))


def _build(seed, world, shard_dim):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.experiments.graph_trainer import simple_fsdp

    simple_fsdp._wrap_class_cache.clear()
    torch.manual_seed(seed)  # the same weights on every rank
    model = Experts().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    mesh = init_device_mesh("cpu", (world,))
    return simple_fsdp.data_parallel(model, mesh, mode="fully_shard", shard_dim=shard_dim)


def _compiled(model, xs, **cfg):
    """Outputs of a fresh compile of ``model`` on ``xs`` and the generated code."""
    import torch_ce
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch_ce.enable(**cfg)
    try:
        c = torch.compile(model)
        with torch.no_grad():
            out0, codes = run_and_get_code(c, xs[0])
            outs = [out0] + [c(x) for x in xs[1:]]
        return outs, "\n".join(codes), torch_ce.explain()
    finally:
        torch_ce.disable()


def _rank_experts(rank, world, cache_dir, seed, shard_dim, force_refuse):
    setup_compile(cache_dir, rank)
    import torch_ce
    from torch.distributed.tensor import Shard
    from torch_ce.runtime import native

    model = _build(seed, world, shard_dim)
    assert all(tuple(p.placements) == (Shard(shard_dim),) for p in model.parameters())
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    xs = [torch.randn(2, 5, 16, generator=gen) for _ in range(3)]
    ref, _, _ = _compiled(model, xs, transport="nccl")
    if force_refuse:
        native._force_unavailable.add("cpu")
    try:
        outs, code, e = _compiled(model, xs, transport="copy_engine", symm_min_shard_mib=0)
    finally:
        native._force_unavailable.discard("cpu")
        torch_ce.release_all()
    rows = {w.param: w.status for w in e.weights}
    return dict(exact=[torch.equal(a, b) for a, b in zip(outs, ref)],
                max_diff=max(float((a - b).abs().max()) for a, b in zip(outs, ref)),
                dim_calls=len(DIM_CALL.findall(code)), cats="aten.cat" in code or "cpp_fused_cat" in code,
                rows=rows, table=e.table())


@pytest.mark.parametrize("shard_dim", [1, 2])
def test_experts_shard_dim_inference(tmp_path, shard_dim):
    res = run_ranks(_rank_experts, 2, str(tmp_path), seed_base(), shard_dim, False, timeout=300)
    for r in res:
        assert all(r["exact"]), (r["max_diff"], r["table"])
        assert r["dim_calls"] == 2, r
        assert set(r["rows"].values()) == {"bound"}, r["table"]


def test_refused_fallback_exact(tmp_path):
    res = run_ranks(_rank_experts, 2, str(tmp_path), seed_base(), 1, True, timeout=300)
    for r in res:
        assert all(r["exact"]), (r["max_diff"], r["table"])
        assert set(r["rows"].values()) == {"fallback"}, r["table"]
