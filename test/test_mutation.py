"""A graph that updates a buffer in place keeps its weight gathers on the copy engines.

NOTE [mutated inputs are refused per weight] in passes/gate.py: only gathers of an input
the graph mutates stay on the collective. The model here counts its activations in a
registered buffer (``seen.add_``, as an MoE layer counts tokens per expert or BatchNorm
keeps running stats) under torchtitan's SimpleFSDP ``fully_shard`` on 2 gloo ranks.
Inference (weights bound in place) and training (AdamW, staging slots): outputs, losses
and the buffer are bit-identical to the plain compiled run, and explain() shows every
weight bound with 100% of the gathered bytes on the copy engines. (The gate used to
refuse the whole graph: "graph mutates its inputs".)

``test_mutated_weight_stays_on_the_collective``: a graph that mutates a *gathered* weight
keeps that weight's gathers on the collective and serves the other weights.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")  # its modules then import, or the file fails loudly

from mp_harness import run_ranks, seed_base, setup_compile  # noqa: E402

WORLD = 2


class Counting(torch.nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=True)
        self.down = torch.nn.Linear(hidden, dim, bias=False)
        self.register_buffer("seen", torch.zeros(hidden))

    def forward(self, x):
        h = torch.relu(self.up(x))
        self.seen.add_(h.detach().sum(dim=(0, 1)))  # an in-place buffer update
        return x + self.down(h)


def _build(seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.experiments.graph_trainer import simple_fsdp

    torch.manual_seed(seed)
    simple_fsdp._wrap_class_cache.clear()
    return simple_fsdp.data_parallel(Counting(), init_device_mesh("cpu", (WORLD,)), mode="fully_shard")


def _run(transport, seed, xs, training):
    import torch_ce
    from torch_ce import report

    torch._dynamo.reset()
    report.clear()
    model = _build(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if training else None
    torch_ce.enable(transport=transport, reshard_after_forward=True if training else None)
    try:
        compiled = torch.compile(model, fullgraph=True)
        outs = []
        for x in xs:
            if training:
                loss = compiled(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                outs.append(loss.detach())
            else:
                with torch.no_grad():
                    outs.append(compiled(x))
        e = torch_ce.explain()
        return outs, model.seen.clone(), e
    finally:
        torch_ce.disable()


def _rank_buffer(rank, world, seed, cache):
    setup_compile(cache, rank)
    gen = torch.Generator().manual_seed(seed + rank)
    xs = [torch.randn(3, 5, 32, generator=gen) for _ in range(3)]
    out = {}
    for training in (False, True):
        ref, ref_seen, _ = _run("nccl", seed, xs, training)
        ce, ce_seen, e = _run("copy_engine", seed, xs, training)
        cov = e.coverage()
        out["training" if training else "inference"] = dict(
            exact=[torch.equal(a, b) for a, b in zip(ref, ce, strict=True)],
            seen_exact=torch.equal(ref_seen, ce_seen),
            seen_changed=bool(ce_seen.abs().sum() > 0),
            rows=sorted({(w.param, w.status) for w in e.weights}),
            share=cov.total.share, by_reason=cov.total.by_reason,
            ce_bytes=cov.total.ce_bytes,
        )
    return out


def _rank_both(rank, world, seed, cache):
    return dict(buffer=_rank_buffer(rank, world, seed, cache),
                weight=_rank_weight_mutation(rank, world, seed, cache))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One spawn of 2 ranks for both tests (a spawn and its compiles are the cost)."""
    return run_ranks(_rank_both, WORLD, seed_base(), str(tmp_path_factory.mktemp("mutation")), timeout=400)


def test_buffer_mutation_keeps_weights_on_the_copy_engines(results):
    for rank, r in enumerate(results):
        for mode, m in r["buffer"].items():
            what = f"rank {rank} {mode}"
            assert all(m["exact"]) and m["exact"], f"{what}: differs from the plain compiled run: {m['exact']}"
            assert m["seen_exact"] and m["seen_changed"], f"{what}: the buffer update differs"
            assert m["rows"] and all(st == "bound" for _, st in m["rows"]), f"{what}: {m['rows']}"
            params = {p for p, _ in m["rows"]}
            assert {"up.weight", "up.bias", "down.weight"} <= params, f"{what}: {params}"
            assert m["share"] == 1.0 and m["ce_bytes"] > 0, f"{what}: coverage {m['share']} {m['by_reason']}"


def _rank_weight_mutation(rank, world, seed, cache):
    setup_compile(cache, rank)
    import torch_ce
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(seed)
    full_a, full_b = torch.randn(8, 8), torch.randn(8, 8)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed + rank))

    def f(x, a, b):
        a.mul_(2.0)  # a gathered weight changes on every call: its gathers must stay
        ga = a.redistribute(placements=[Replicate()]).to_local()
        gb = b.redistribute(placements=[Replicate()]).to_local()
        return x @ ga.t() + x @ gb.t()

    outs = {}
    for transport in ("nccl", "copy_engine"):
        a = distribute_tensor(full_a.clone(), mesh, [Shard(0)])
        b = distribute_tensor(full_b.clone(), mesh, [Shard(0)])
        torch._dynamo.reset()
        torch_ce.enable(transport=transport)
        try:
            c = torch.compile(f, fullgraph=True)
            with torch.no_grad():
                outs[transport] = [c(x, a, b) for _ in range(2)]
        finally:
            torch_ce.disable()
    e = torch_ce.explain()
    rec = e.graphs[-1]
    return dict(exact=[torch.equal(p, q) for p, q in zip(outs["nccl"], outs["copy_engine"], strict=True)],
                refused=[(r.name, r.reason) for r in rec.refused], bound=len(rec.bound),
                share=e.coverage().per_graph[-1].share)


def test_mutated_weight_stays_on_the_collective(results):
    for rank, r in enumerate(r["weight"] for r in results):
        assert all(r["exact"]), (rank, r)
        assert len(r["refused"]) == 1 and "mutates this weight" in r["refused"][0][1], (rank, r)
        assert r["bound"] == 1, (rank, r)
        assert r["share"] == 0.5, (rank, r)
