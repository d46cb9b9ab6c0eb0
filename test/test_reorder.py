"""Latest-safe-launch on real Inductor scheduler nodes, with a toy cost function.

One process, the fake process group. Inductor's own runtime estimates are 0 on CPU, so
each test injects a toy cost: every launch costs ``LAUNCH_US``, every compute node 4 us.
The goldens name scheduler nodes by their place in the order before the reorder
(``ReorderTest.labels``), not by Inductor's names.
"""
from __future__ import annotations

import collections
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from expecttest import TestCase
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import torch_ce
from torch_ce import report
from torch_ce.inductor_lowering import _issues_transfer
from torch_ce.passes import cost, reorder

COMPUTE_US = 4.0


@pytest.fixture(scope="module", autouse=True)
def fake_pg():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


class _Weight(nn.Module):
    def __init__(self, mesh, dim, dtype):
        super().__init__()
        self.weight = nn.Parameter(distribute_tensor(torch.randn(dim, dim, dtype=dtype), mesh, [Shard(0)]),
                                   requires_grad=False)


class Layers(nn.Module):
    """n layers; layer i gathers its weight(s) right before using them.

    Nested ``nn.ModuleList``s, iterated whole: every supported torch traces this as one
    graph (torch 2.11's Dynamo cannot slice an ``nn.ParameterList``: ``slice.indices``)."""

    def __init__(self, mesh, n=4, per_layer=1, dim=16, dtype=torch.float32):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList(_Weight(mesh, dim, dtype) for _ in range(per_layer))
                                    for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            full = [m.weight.redistribute(placements=[Replicate()]).to_local() for m in layer]
            for f in full:
                x = torch.relu(x @ f.t())
        return x


class ReorderTest(TestCase):
    maxDiff = None  # a golden failure prints its whole diff

    def setUp(self):
        torch.manual_seed(0)
        self.mesh = init_device_mesh("cpu", (2,))
        report.clear()
        torch._dynamo.reset()
        self.orders = []
        self.launch_us = 10.0
        real = reorder.latest_safe_launch

        def spy(snodes, **kw):
            out = real(snodes, cost_us=self.toy_cost, scale=1.0, margin_us=0.0)
            self.orders.append(self.labels(snodes, out))
            return out

        self.mp = pytest.MonkeyPatch()
        self.mp.setattr(reorder, "latest_safe_launch", spy)
        self.patch = torch._inductor.config.patch(fx_graph_cache=False, compile_threads=1)
        self.patch.__enter__()

    def tearDown(self):
        self.patch.__exit__(None, None, None)
        self.mp.undo()
        torch_ce.disable()
        torch._dynamo.reset()
        torch_ce.release_all()

    def toy_cost(self, snode):
        if _issues_transfer(snode):
            return self.launch_us
        if reorder._is_wait(snode):
            return 0.0
        return COMPUTE_US

    @staticmethod
    def kind(snode):
        if _issues_transfer(snode):
            return "ce" if cost.ce_launch_info(snode) else "nccl"
        if reorder._is_wait(snode):
            return "wait"
        if reorder._is_multi_output(snode):
            return "item"
        op = getattr(getattr(snode, "node", None), "op_overload", None)
        if op is torch.ops.magi.ce_bind.default:
            return "bind"
        return "compute"

    def labels(self, before, after):
        """``i:kind`` for each scheduler node, ``i`` its place in ``before``: Inductor's
        own names (op0, op1, ...) and the MultiOutput node some releases put after a
        single-output launch (and others do not) are left out, so the goldens show the
        reorder's decision, not torch's numbering. A coalesced launch keeps its items."""
        items = collections.Counter(s.node.inputs[0].get_name() for s in before
                                    if self.kind(s) == "item")
        keep = [s for s in before
                if self.kind(s) != "item" or items[s.node.inputs[0].get_name()] > 1]
        index = {s.get_name(): i for i, s in enumerate(keep)}
        self._snodes = {str(i): s for i, s in enumerate(keep)}
        return tuple([f"{index[s.get_name()]}:{self.kind(s)}" for s in seq if s.get_name() in index]
                     for seq in (before, after))

    def run_model(self, model, x, **cfg):
        """The one graph's (order before, order after). fullgraph: a graph break fails here,
        with Dynamo's reason, not later as a missing or split order."""
        torch_ce.enable(**cfg)
        with torch.no_grad():
            torch.compile(model, fullgraph=True)(x)
        self.assertEqual(len(self.orders), 1, "the reorder should have run on exactly one graph")
        return self.orders[0]

    def test_ce_launch_lands_where_the_rule_says(self):
        before, after = self.run_model(Layers(self.mesh), torch.randn(4, 16), transport="copy_engine")
        self.assertExpectedInline(" ".join(before), """0:bind 1:ce 2:wait 3:compute 4:ce 5:wait 6:compute 7:compute 8:ce 9:wait 10:compute 11:compute 12:ce 13:wait 14:compute 15:compute 16:compute""")
        self.assertExpectedInline(" ".join(after), """0:bind 1:ce 4:ce 2:wait 3:compute 8:ce 6:compute 5:wait 7:compute 12:ce 10:compute 9:wait 11:compute 14:compute 13:wait 15:compute 16:compute""")
        placements = report.graphs[-1].reorder["placements"]
        # Each non-limited launch is covered by >= its need, and by less than need +
        # one compute node (it is the latest such position).
        for p in placements:
            if not p["compute_limited"]:
                self.assertGreaterEqual(p["covered_us"], p["need_us"])
                self.assertLess(p["covered_us"] - COMPUTE_US, p["need_us"])
        self.assertTrue(any(p["compute_limited"] for p in placements))
        # The deadline is the first consumer, and the launch sits before it.
        for p in placements:
            self.assertLessEqual(p["target"], p["deadline"], placements)

    def test_ce_op_is_a_transfer_not_compute(self):
        self.run_model(Layers(self.mesh, n=2), torch.randn(4, 16), transport="copy_engine")
        kinds = [k.split(":")[1] for k in self.orders[0][1]]
        self.assertIn("ce", kinds)
        self.assertNotIn("nccl", kinds)
        # Covered time never includes a launch: with launches costing 1000 us, only the
        # compute nodes count, so every launch is compute-limited.
        self.orders.clear()
        torch._dynamo.reset()
        self.launch_us = 1000.0
        self.run_model(Layers(self.mesh, n=2), torch.randn(4, 16), transport="copy_engine")
        for p in report.graphs[-1].reorder["placements"]:
            self.assertTrue(p["compute_limited"])
            self.assertEqual(p["covered_us"] % COMPUTE_US, 0.0)

    def test_coalesced_group_moves_as_one(self):
        _, after = self.run_model(Layers(self.mesh, n=3, per_layer=2), torch.randn(4, 16),
                                  transport="copy_engine")
        kinds = [k.split(":")[1] for k in after]
        for i, k in enumerate(kinds):
            if k == "ce" and i + 1 < len(kinds) and kinds[i + 1] == "item":
                self.assertEqual(kinds[i + 1:i + 3], ["item", "item"], after)
        self.assertEqual(kinds.count("item"), 6)
        self.assertExpectedInline(" ".join(after), """0:bind 1:ce 2:item 3:item 4:wait 6:compute 9:ce 10:item 11:item 7:compute 5:wait 8:compute 14:compute 12:wait 15:compute 18:ce 19:item 20:item 16:compute 13:wait 17:compute 23:compute 21:wait 24:compute 25:compute 22:wait 26:compute 27:compute""")

    def test_prefetch_is_a_launch_after_the_last_gather(self):
        """The cross-call prefetch is a CE launch: costed as one, never counted as compute,
        never ahead of the graph's other launches (NOTE [launch order])."""
        _, after = self.run_model(Layers(self.mesh, n=4), torch.randn(4, 16), transport="copy_engine",
                                  prefetch_next_call_mib=1.0)
        launches = [i for i, k in enumerate(after) if k.endswith(":ce")]
        prefetch_pos = [i for i, k in enumerate(after) if k.endswith(":ce") and self._is_prefetch(k)]
        self.assertEqual(len(prefetch_pos), 1, after)
        self.assertEqual(prefetch_pos[0], launches[-1], after)
        self.assertEqual(len(report.graphs[-1].reorder["placements"]), 5)
        self.assertExpectedInline(" ".join(after), """0:bind 1:ce 4:ce 2:wait 3:compute 8:ce 6:compute 5:wait 7:compute 12:ce 10:compute 9:wait 11:compute 13:ce 15:compute 14:wait 16:compute 17:compute""")

    def _is_prefetch(self, name):
        op = getattr(self._snodes.get(name.split(":")[0]), "node", None)
        return getattr(op, "op_overload", None) is torch.ops.magi.ce_prefetch.default

    def test_nccl_gathers_keep_their_order(self):
        self.launch_us = 30.0
        before, after = self.run_model(Layers(self.mesh, n=5), torch.randn(4, 16), transport="nccl")
        launches_before = [n for n in before if n.endswith(":nccl")]
        launches_after = [n for n in after if n.endswith(":nccl")]
        self.assertEqual(launches_before, launches_after)
        self.assertNotEqual(before, after)  # something did move
        self.assertExpectedInline(" ".join(after), """0:nccl 3:nccl 7:nccl 11:nccl 1:wait 15:nccl 2:compute 5:compute 4:wait 6:compute 9:compute 8:wait 10:compute 13:compute 12:wait 14:compute 17:compute 16:wait 18:compute 19:compute""")


def test_invalid_order_is_rejected(monkeypatch, caplog):
    """A rebuilt order that breaks a real dependency leaves the graph unchanged."""
    mesh = init_device_mesh("cpu", (2,))
    report.clear()
    torch._dynamo.reset()
    seen = {}
    real = reorder.latest_safe_launch

    def spy(snodes, **kw):
        out = real(snodes, cost_us=lambda s: 1.0, scale=1.0, margin_us=0.0)
        seen["same"] = [s.get_name() for s in out] == [s.get_name() for s in snodes]
        return out

    monkeypatch.setattr(reorder, "latest_safe_launch", spy)
    # Sabotage: reverse the non-launch order, so consumers come before producers.
    monkeypatch.setattr(reorder, "_sink_waits", lambda base: list(reversed(base)))
    torch_ce.enable(transport="copy_engine")
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), caplog.at_level(logging.WARNING, "torch_ce"):
            with torch.no_grad():
                torch.compile(Layers(mesh, n=2), fullgraph=True)(torch.randn(4, 16))
        assert seen, "the reorder never ran"
        assert seen["same"] is True
        assert "not topological" in caplog.text
        assert report.graphs[-1].reorder["valid"] is False
    finally:
        torch_ce.disable()
        torch._dynamo.reset()
        torch_ce.release_all()


def test_topological_check():
    class S:
        def __init__(self, name, deps):
            self.name, self.deps = name, deps
    a = reorder.Unit([], "compute")
    # Units built by hand: outputs/deps through a tiny stand-in.
    class U(reorder.Unit):
        def __init__(self, outs, deps):
            super().__init__([], "compute")
            self._o, self._d = set(outs), set(deps)
        @property
        def outputs(self):
            return self._o
        @property
        def deps(self):
            return self._d
    p, c = U({"x"}, set()), U({"y"}, {"x"})
    assert reorder._topological([p, c])
    assert not reorder._topological([c, p])
    del a
