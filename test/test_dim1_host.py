"""Shard(1) experts on the copy-engine path, on CPU (host transport, gloo ranks).

torchtitan's graph_trainer shards routed experts (3-D ``[num_experts, out, in]``) on dim 1
when ``efsdp * ep > num_experts`` (``data_parallel(..., shard_dim=1)``). The post-grad
graph gathers along dim 0 and re-splits (NOTE [Shard(1) reads] in passes/gate.py); torch_ce
reads each peer's column block into its place (``magi.ce_all_gather_dim``), so the split
and cat leave the graph. Every output must be bit-identical to the plain compiled run
(``transport="nccl"``: gloo here) on fresh random data.

- ``test_experts_shard_dim_inference``: a 3-D expert module (two weights) sharded on dim 1,
  and (slow) on dim 2, 2 ranks: exact, both weights bound in ``explain()``, the generated code
  calls ``ce_all_gather_dim`` for each (the plain run does not).
- ``test_refused_fallback_exact``: the same weights refused at bind: the op gathers by the
  collective and re-splits, exact.
- ``test_eager_dim_gathers_exact_and_opcheck``: bound shards gathered eagerly in every dim
  against gloo's gather re-split; ``torch.library.opcheck``.
- ``test_experts_shard1_training``: the expert module trained with AdamW (fp32, and bf16
  ``param_dtype`` (slow)): losses bit-identical, gathers from staging slots in forward and
  backward (reshard after forward recomputes the gather and its re-split).
- ``test_world4_ep2_layout_inference`` (slow): 4 ranks laid out as graph_trainer's ep=2
  (experts Shard(1) over the efsdp groups {0,1} and {2,3}, a dense head Shard(0) over all
  four): exact, all three weights bound.
- ``test_torchtitan_moe_dim1_inference`` (slow): torchtitan's own MoE layer (router, local
  dispatcher, GroupedExperts: what Qwen3-MoE stacks), wrapped as graph_trainer's
  ``apply_simple_fsdp`` wraps it when ``efsdp * ep > num_experts`` (experts
  ``data_parallel(..., shard_dim=1)``, then the layer), bf16, 2 ranks: exact, w1/w2/w3
  bound and gathered by ``ce_all_gather_dim``.
"""
from __future__ import annotations

import contextlib
import os
import re

import pytest
import testenv
import torch

pytest.importorskip("torchtitan")  # its modules then import, or the file fails loudly

from mp_harness import run_ranks, seed_base, setup_compile  # noqa: E402

SLOW = testenv.SLOW  # conftest took the switch out of the environment (test/testenv.py)
DIM_CALL = re.compile(r"torch\.ops\.magi\.ce_all_gather_dim\.default\(")


class Experts(torch.nn.Module):
    """Grouped experts as torchtitan writes them: w1 [E, H, D], w2 [E, D, H]."""

    def __init__(self, E=2, D=16, H=24):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(E, H, D))
        self.w2 = torch.nn.Parameter(torch.randn(E, D, H))

    def forward(self, x):  # x [E, T, D]; computes in the weights' (param_dtype) dtype
        w1, w2 = self.w1, self.w2
        h = torch.bmm(x.to(w1.dtype), w1.transpose(1, 2))
        return torch.bmm(torch.relu(h), w2.transpose(1, 2)).float()


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
        c = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            out0, codes = run_and_get_code(c, xs[0])
            outs = [out0] + [c(x) for x in xs[1:]]
        return outs, "\n".join(codes), torch_ce.explain()
    finally:
        torch_ce.disable()


def _rank_experts(rank, world, cache_dir, seed):
    """Every expert case in one process (a compile each): Shard(1), Shard(2), and Shard(1)
    refused at bind (the test hook ``_force_unavailable``: no CPU kernel, so the bind
    falls back and the op gathers by the collective and re-splits, on every rank)."""
    setup_compile(cache_dir, rank)
    import torch_ce
    from torch.distributed.tensor import Shard
    from torch_ce.runtime import native

    out, refs = {}, {}
    cases = [("dim1", 1, False), ("dim1_refused", 1, True)] + ([("dim2", 2, False)] if SLOW else [])
    for case, shard_dim, refuse in cases:
        model = _build(seed, world, shard_dim)
        assert all(tuple(p.placements) == (Shard(shard_dim),) for p in model.parameters())
        gen = torch.Generator().manual_seed(seed + 1000 + rank)
        xs = [torch.randn(2, 5, 16, generator=gen) for _ in range(2)]
        if shard_dim not in refs:  # the same weights and inputs: one plain run per dim
            refs[shard_dim] = _compiled(model, xs, transport="nccl")[:2]
        ref, ref_code = refs[shard_dim]
        try:
            with native.kernels_unavailable("cpu") if refuse else contextlib.nullcontext():
                outs, code, e = _compiled(model, xs, transport="copy_engine", symm_min_shard_mib=0)
        finally:
            torch_ce.release_all()
        out[case] = dict(
            exact=[torch.equal(a, b) for a, b in zip(outs, ref, strict=True)],
            max_diff=max(float((a - b).abs().max()) for a, b in zip(outs, ref, strict=True)),
            dim_calls=len(DIM_CALL.findall(code)), ref_dim_calls=len(DIM_CALL.findall(ref_code)),
            rows={w.param: w.status for w in e.weights}, table=e.table())
    return out


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    return run_ranks(_rank_experts, 2, str(tmp_path_factory.mktemp("dim1")), seed_base(), timeout=400)


@pytest.mark.parametrize("case", ["dim1", pytest.param("dim2", marks=[
    pytest.mark.slow, pytest.mark.skipif(not SLOW, reason="set TORCH_CE_SLOW=1")])])
def test_experts_shard_dim_inference(experts, case):
    for res in experts:
        r = res[case]
        assert all(r["exact"]), (r["max_diff"], r["table"])
        assert r["dim_calls"] == 2 and r["ref_dim_calls"] == 0, r
        assert set(r["rows"].values()) == {"bound"}, r["table"]


def test_refused_fallback_exact(experts):
    for res in experts:
        r = res["dim1_refused"]
        assert all(r["exact"]), (r["max_diff"], r["table"])
        assert set(r["rows"].values()) == {"fallback"}, r["table"]


def _rank_eager(rank, world, seed):
    """Bound shards gathered eagerly by ``magi.ce_all_gather_dim`` in every dim, against the
    backend's own gather re-split; and torch.library.opcheck (NOTE in test_ops_host.py:
    the sub-tests that clone their inputs run at group_size 1, where no binding is read;
    on the bound shards the un-cloned checks)."""
    import torch.distributed as dist
    import torch_ce
    from mp_harness import reference_all_gather, wait
    from torch.library import opcheck
    from torch.testing._internal.optests.fake_tensor import fake_check
    from torch.testing._internal.optests.generate_tests import safe_schema_check

    gen = torch.Generator().manual_seed(seed + rank)
    shards = [torch.randn(3, 5, 7, generator=gen), torch.randn(4, 6, generator=gen).to(torch.bfloat16)]
    assert len(torch_ce.bind(shards, group=dist.group.WORLD, min_shard_mib=0).bound) == 2
    g = dist.group.WORLD.group_name
    op = torch.ops.magi.ce_all_gather_dim.default
    exact = {}
    for i, s in enumerate(shards):
        ref = reference_all_gather(s)
        for d in range(s.dim()):
            exp = torch.cat(ref.split(s.shape[0]), d)
            exact[f"{i}_dim{d}"] = torch.equal(wait(op(s, world, g, d)), exp)
            safe_schema_check(op, (s, world, g, d), {}, copy_inputs=False)
            fake_check(op, (s, world, g, d), {})
        opcheck(op, (s, world, g, 1), test_utils=("test_autograd_registration",))
        opcheck(op, (s, 1, g, 1))
    try:
        op(torch.randn(2, 2), world, g, 1)
        exact["unbound_raises"] = False
    except RuntimeError as e:
        exact["unbound_raises"] = "not bound" in str(e)
    return exact


def test_eager_dim_gathers_exact_and_opcheck():
    for r in run_ranks(_rank_eager, 2, seed_base(), timeout=200):
        assert all(r.values()), r


def _build_moe(seed, world, dim=32, hidden=48, experts=2):
    """torchtitan's own MoE layer (router, local token dispatcher, GroupedExperts: what
    Qwen3-MoE stacks) wrapped as graph_trainer's ``apply_simple_fsdp`` wraps it when
    ``efsdp * ep > num_experts``: the routed experts ``data_parallel(..., shard_dim=1)``,
    then the layer (the router's gate) Shard(0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch_ce.bench import zoo

    zoo.load("qwen3")  # the zoo's training-only imports stubbed (triton-free CPU)
    from torchtitan.experiments.graph_trainer import simple_fsdp
    from torchtitan.models.common.config_utils import (make_moe_config, make_router_config,
                                                       make_routed_experts_config)

    simple_fsdp._wrap_class_cache.clear()
    init = {}
    cfg = make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init=init, top_k=1,
                                  score_func="softmax", route_norm=True),
        routed_experts=make_routed_experts_config(dim=dim, hidden_dim=hidden, num_experts=experts,
                                                  top_k=1, param_init=init, comm_backend="standard"),
        load_balance_coeff=None)
    torch.manual_seed(seed)
    moe = cfg.build()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
            p.requires_grad_(False)
    moe = moe.to(torch.bfloat16).eval()
    mesh = init_device_mesh("cpu", (world,))
    moe.routed_experts.inner_experts = simple_fsdp.data_parallel(
        moe.routed_experts.inner_experts, mesh, mode="fully_shard", shard_dim=1)
    return simple_fsdp.data_parallel(moe, mesh, mode="fully_shard")


def _rank_moe(rank, world, cache_dir, seed):
    setup_compile(cache_dir, rank)
    import torch_ce
    from torch.distributed.tensor import Shard

    model = _build_moe(seed, world)
    placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    xs = [torch.randn(1, 6, 32, generator=gen).to(torch.bfloat16) for _ in range(2)]
    ref, _, _ = _compiled(model, xs, transport="nccl")
    try:
        outs, code, e = _compiled(model, xs, transport="copy_engine", symm_min_shard_mib=0)
    finally:
        torch_ce.release_all()
    return dict(exact=[torch.equal(a, b) for a, b in zip(outs, ref, strict=True)],
                dim1=sorted(n for n, pl in placements.items() if pl == (Shard(1),)),
                dim_calls=len(DIM_CALL.findall(code)),
                rows={w.param: w.status for w in e.weights}, table=e.table())


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="set TORCH_CE_SLOW=1 (about 2.5 min on 2 cores)")
def test_torchtitan_moe_dim1_inference(tmp_path):
    res = run_ranks(_rank_moe, 2, str(tmp_path), seed_base(), timeout=400)
    for r in res:
        assert len(r["dim1"]) == 3, r["dim1"]  # w1, w2, w3 of the routed experts
        assert all(r["exact"]), r["table"]
        assert r["dim_calls"] == 3, (r["dim_calls"], r["table"])
        assert set(r["rows"].values()) == {"bound"}, r["table"]


def _build_train(seed, world, mp_policy=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.experiments.graph_trainer import simple_fsdp

    simple_fsdp._wrap_class_cache.clear()
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    return simple_fsdp.data_parallel(Experts().train(), mesh, mode="fully_shard", shard_dim=1,
                                     mp_policy=mp_policy)


def _train(transport, model, batches, **cfg):
    """Compile and train with AdamW; (per-step losses, the first step's generated code)."""
    import torch_ce
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch_ce.enable(transport=transport, reshard_after_forward=True, **cfg)
    try:
        compiled = torch.compile(model, fullgraph=True)
        losses, code = [], ""
        for i, x in enumerate(batches):
            def step():
                loss = compiled(x).square().mean()
                loss.backward()
                return loss
            if i == 0:
                loss, codes = run_and_get_code(step)
                code = "\n".join(codes)
            else:
                loss = step()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        return losses, code
    finally:
        torch_ce.disable()


def _rank_train(rank, world, cache_dir, seed, bf16):
    setup_compile(cache_dir, rank)
    import torch_ce
    from torchtitan.experiments.graph_trainer import simple_fsdp

    policy = simple_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    batches = [torch.randn(2, 5, 16, generator=gen) for _ in range(4)]
    ref, _ = _train("nccl", _build_train(seed, world, policy), batches)
    from torch_ce import report

    report.clear()  # explain() below: the copy-engine run's graphs (the reference's are "nccl" rows)
    try:
        got, code = _train("copy_engine", _build_train(seed, world, policy), batches,
                           training=True, symm_min_shard_mib=0)
        e = torch_ce.explain()
    finally:
        torch_ce.release_all()
    return dict(ref=ref, got=got, dim_calls=len(DIM_CALL.findall(code)),
                rows={(w.graph_id, w.param): w.status for w in e.weights}, table=e.table())


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=[
    pytest.mark.slow, pytest.mark.skipif(not SLOW, reason="set TORCH_CE_SLOW=1")])])
def test_experts_shard1_training(tmp_path, bf16):
    """Training (staging slots, reshard after forward): every step's loss bit-identical to
    the plain compiled run; the forward gathers w1 and w2 from their staging slots, the
    backward gathers w2 again (its re-split is recomputed with the gather)."""
    for r in run_ranks(_rank_train, 2, str(tmp_path), seed_base(), bf16, timeout=400):
        assert r["got"] == r["ref"], (r["got"], r["ref"], r["table"])
        assert r["dim_calls"] == 3, (r["dim_calls"], r["table"])  # forward 2, backward 1
        assert set(r["rows"].values()) == {"bound"}, r["table"]


class ExpertsAndHead(torch.nn.Module):
    """Experts on an expert-data-parallel sub-mesh, a dense head on the whole world."""

    def __init__(self):
        super().__init__()
        self.experts = Experts()
        self.head = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.head(self.experts(x))


def _rank_world4(rank, world, cache_dir, seed):
    """World 4 as graph_trainer lays out ep=2: a (ep=2, efsdp=2) mesh; the experts
    ``data_parallel(..., shard_dim=1)`` over efsdp (groups {0,1} and {2,3}), the rest over
    all four ranks."""
    setup_compile(cache_dir, rank)
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.experiments.graph_trainer import simple_fsdp

    def build():
        simple_fsdp._wrap_class_cache.clear()
        torch.manual_seed(seed)
        m = ExpertsAndHead().eval()
        for p in m.parameters():
            p.requires_grad_(False)
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
        m.experts = simple_fsdp.data_parallel(m.experts, mesh2["efsdp"], mode="fully_shard", shard_dim=1)
        return simple_fsdp.data_parallel(m, init_device_mesh("cpu", (world,)), mode="fully_shard")

    model = build()
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    xs = [torch.randn(2, 5, 16, generator=gen) for _ in range(2)]
    ref, _, _ = _compiled(model, xs, transport="nccl")
    try:
        outs, code, e = _compiled(model, xs, transport="copy_engine", symm_min_shard_mib=0)
    finally:
        torch_ce.release_all()
    return dict(exact=[torch.equal(a, b) for a, b in zip(outs, ref, strict=True)], dim_calls=len(DIM_CALL.findall(code)),
                rows={w.param: w.status for w in e.weights}, table=e.table())


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="set TORCH_CE_SLOW=1 (4 ranks)")
def test_world4_ep2_layout_inference(tmp_path):
    for r in run_ranks(_rank_world4, 4, str(tmp_path), seed_base(), timeout=600):
        assert all(r["exact"]), r["table"]
        assert r["dim_calls"] == 2, (r["dim_calls"], r["table"])
        assert set(r["rows"].values()) == {"bound"} and len(r["rows"]) == 3, r["table"]
