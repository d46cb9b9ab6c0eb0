"""Coverage and "never worse than plain" (2 gloo ranks, host transport).

- ``test_refused_model_adds_no_collectives``: SimpleFSDP training (AdamW) of a model whose
  weights the gate refuses (every one, then some, by ``symm_min_shard_mib``): the collective
  gathers per training step (count and bytes, read from every compiled graph after the
  passes, forward and backward) are never more than the plain compiled run's, and the
  same for the fully refused model (NOTE [reshard only what the copy engines serve] in
  passes/reshard.py). Without that rule torch_ce resharded refused weights: each one was
  gathered again, on the collective, in the backward.
- ``test_coverage_counts_looked_up_rows``: explain().coverage() per graph and in total; a
  row-gathered embedding counts the rows it looks up, a refused weight its full gather under
  its reason; as_dict() and table() show the same.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("torchtitan")  # its modules then import, or the file fails loudly

from mp_harness import fsdp_every_param, run_ranks, seed_base, setup_compile  # noqa: E402

WORLD = 2


class Net(torch.nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=True)
        self.down = torch.nn.Linear(hidden, dim, bias=False)
        self.head = torch.nn.Linear(dim, 16, bias=False)

    def forward(self, x):
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(x)


def _counter(store: list):
    """A function of a post-grad graph that appends its collective gathers: (count, bytes)."""
    c10d = torch.ops._c10d_functional

    def count(graph):
        n = nb = 0
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is c10d.all_gather_into_tensor.default:
                vals = [node.meta.get("val")]
            elif node.target is c10d.all_gather_into_tensor_coalesced.default:
                vals = list(node.meta.get("val") or [])
            else:
                continue
            n += len(vals)
            nb += sum(v.numel() * v.element_size() for v in vals if v is not None)
        store.append((n, nb))

    return count


class _PlainCounter(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, graph):
        self.fn(graph)

    def uuid(self):
        return None


def _train_counting(torch_ce_on: bool, seed, xs, **cfg):
    import torch._inductor.config as ic
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh
    from torch_ce.passes import manager
    from torchtitan.experiments.graph_trainer import simple_fsdp

    torch._dynamo.reset()
    torch.manual_seed(seed)
    simple_fsdp._wrap_class_cache.clear()
    model = simple_fsdp.data_parallel(Net(), init_device_mesh("cpu", (WORLD,)), mode="fully_shard")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    graphs: list = []
    count = _counter(graphs)
    observing = contextlib.ExitStack()
    if torch_ce_on:
        torch_ce.enable(transport="copy_engine", **cfg)
        observing.enter_context(manager.observing(count))
    else:
        saved = ic.post_grad_custom_post_pass
        ic.post_grad_custom_post_pass = _PlainCounter(count)
    try:
        compiled = torch.compile(model, fullgraph=True)
        losses = []
        for x in xs:
            loss = compiled(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        observing.close()
        if torch_ce_on:
            torch_ce.disable()
        else:
            ic.post_grad_custom_post_pass = saved
    return losses, graphs


def _rank_never_worse(rank, world, seed, cache):
    setup_compile(cache, rank)
    gen = torch.Generator().manual_seed(seed + rank)
    xs = [torch.randn(3, 5, 32, generator=gen) for _ in range(2)]
    plain, plain_graphs = _train_counting(False, seed, xs)
    out = dict(plain=plain, plain_graphs=plain_graphs)
    # Every weight refused (all below the minimum), then the large ones served (4 KiB
    # shards: up.weight and down.weight) and the small ones refused (bias, head).
    for name, mib in (("all_refused", 1024.0), ("some_refused", 2048 / 2**20)):
        losses, graphs = _train_counting(True, seed, xs, symm_min_shard_mib=mib)
        out[name] = dict(losses=losses, graphs=graphs)
    return out


def test_refused_model_adds_no_collectives(results):
    for rank, r in enumerate(r["never_worse"] for r in results):
        plain = tuple(map(sum, zip(*r["plain_graphs"], strict=True)))
        assert len(r["plain_graphs"]) == 2 and plain[0] > 0, (rank, r["plain_graphs"])
        for name in ("all_refused", "some_refused"):
            m = r[name]
            assert m["losses"] == r["plain"], f"rank {rank} {name}: losses differ from the plain run"
            got = tuple(map(sum, zip(*m["graphs"], strict=True)))
            what = f"rank {rank} {name}: collective gathers per step (count, bytes) {got}, plain {plain}"
            assert got[0] <= plain[0] and got[1] <= plain[1], what
            if name == "all_refused":
                assert got == plain, what
            else:
                assert got[0] < plain[0], what  # the served weights left the collective


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(64, 16)
        self.lin = torch.nn.Linear(16, 16, bias=False)
        self.small = torch.nn.Linear(16, 2, bias=False)  # refused: below the minimum

    def forward(self, ids):
        return self.small(self.lin(self.tok(ids)))


def _rank_rows(rank, world, seed, cache):
    setup_compile(cache, rank)
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh
    from torch_ce import report

    torch.manual_seed(seed)
    model = fsdp_every_param(Embed(), init_device_mesh("cpu", (WORLD,)))
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(seed + rank))
    with torch.no_grad():
        eager = model(ids)
    report.clear()
    torch._dynamo.reset()
    torch_ce.enable(transport="copy_engine", symm_min_shard_mib=100 / 2**20)
    try:
        with torch.no_grad():
            out = torch.compile(model, fullgraph=True)(ids)
    finally:
        torch_ce.disable()
    e = torch_ce.explain()
    cov = e.coverage()
    return dict(exact=torch.equal(out, eager), rows={w.param: (w.status, w.ce_bytes, w.by_reason) for w in e.weights},
                per_graph=[c.as_dict() for c in cov.per_graph], total=cov.total.as_dict(),
                as_dict=e.as_dict()["coverage"], table=e.table(), graphs=len(e.graphs))


def _rank_both(rank, world, seed, cache):
    return dict(never_worse=_rank_never_worse(rank, world, seed, cache),
                rows=_rank_rows(rank, world, seed, cache))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One spawn of 2 ranks for both tests."""
    return run_ranks(_rank_both, WORLD, seed_base(), str(tmp_path_factory.mktemp("coverage")), timeout=400)


def test_coverage_counts_looked_up_rows(results):
    for rank, r in enumerate(r["rows"] for r in results):
        assert r["exact"], rank
        rows = r["rows"]
        # 10 looked-up rows of 16 fp32 values; the full table would be 64 x 16 x 4 B.
        assert rows["tok.weight"] == ("bound", 10 * 16 * 4, {}), rows
        assert rows["lin.weight"] == ("bound", 16 * 16 * 4, {}), rows
        status, ce, by = rows["small.weight"]
        assert status == "refused" and ce == 0 and list(by.values()) == [2 * 16 * 4], rows
        assert "symm_min_shard_mib" in next(iter(by)), by
        total = r["total"]
        assert total["ce_bytes"] == 640 + 1024 and total["collective_bytes"] == 128, total
        assert total["share"] == pytest.approx(1664 / 1792), total
        assert r["graphs"] == 1 and r["per_graph"][0]["ce_bytes"] == total["ce_bytes"], r["per_graph"]
        assert r["as_dict"] == dict(total=total, per_graph=r["per_graph"], eager=[]), r["as_dict"]
        assert "coverage graph 0: 92.9%" in r["table"] and "coverage total: 92.9%" in r["table"], r["table"]
