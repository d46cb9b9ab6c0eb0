"""Latest-safe-launch on real Inductor scheduler nodes, with a toy cost function.

One process, the fake process group. Inductor's own runtime estimates are 0 on CPU, so
each test injects a toy cost: every launch costs ``LAUNCH_US``, every compute node 4 us.
"""
from __future__ import annotations

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


class Layers(nn.Module):
    """n layers; layer i gathers its weight(s) right before using them."""

    def __init__(self, mesh, n=4, per_layer=1, dim=16, dtype=torch.float32):
        super().__init__()
        self.ws = nn.ParameterList(
            nn.Parameter(distribute_tensor(torch.randn(dim, dim, dtype=dtype), mesh, [Shard(0)]),
                         requires_grad=False)
            for _ in range(n * per_layer)
        )
        self.per_layer = per_layer

    def forward(self, x):
        for i in range(0, len(self.ws), self.per_layer):
            full = [w.redistribute(placements=[Replicate()]).to_local() for w in self.ws[i:i + self.per_layer]]
            for f in full:
                x = torch.relu(x @ f.t())
        return x


class ReorderTest(TestCase):
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
            self.orders.append((self.names(snodes), self.names(out)))
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

    def names(self, snodes):
        self._snodes = {s.get_name(): s for s in snodes}
        return [f"{s.get_name()}:{self.kind(s)}" for s in snodes]

    def run_model(self, model, x, **cfg):
        torch_ce.enable(**cfg)
        with torch.no_grad():
            torch.compile(model)(x)
        self.assertEqual(len(self.orders), 1)
        return self.orders[0]

    def test_ce_launch_lands_where_the_rule_says(self):
        before, after = self.run_model(Layers(self.mesh), torch.randn(4, 16), transport="copy_engine")
        self.assertExpectedInline(" ".join(before), """op0:bind op1:ce op2:item op3:wait op4:compute op5:ce op6:item op7:wait op8:compute op9:compute op10:ce op11:item op12:wait op13:compute op14:compute op15:ce op16:item op17:wait op18:compute op19:compute op20:compute""")
        self.assertExpectedInline(" ".join(after), """op0:bind op1:ce op2:item op5:ce op6:item op3:wait op4:compute op10:ce op11:item op8:compute op7:wait op9:compute op15:ce op16:item op13:compute op12:wait op14:compute op18:compute op17:wait op19:compute op20:compute""")
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
        self.assertExpectedInline(" ".join(after), """op0:bind op1:ce op2:item op3:item op4:wait op6:compute op9:ce op10:item op11:item op7:compute op5:wait op8:compute op14:compute op12:wait op15:compute op18:ce op19:item op20:item op16:compute op13:wait op17:compute op23:compute op21:wait op24:compute op25:compute op22:wait op26:compute op27:compute""")

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
        self.assertExpectedInline(" ".join(after), """op0:bind op1:ce op2:item op5:ce op6:item op3:wait op4:compute op10:ce op11:item op8:compute op7:wait op9:compute op15:ce op16:item op13:compute op12:wait op14:compute op17:ce op19:compute op18:wait op20:compute op21:compute""")

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
        self.assertExpectedInline(" ".join(after), """op0:nccl op3:nccl op7:nccl op11:nccl op1:wait op15:nccl op2:compute op5:compute op4:wait op6:compute op9:compute op8:wait op10:compute op13:compute op12:wait op14:compute op17:compute op16:wait op18:compute op19:compute""")


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
                torch.compile(Layers(mesh, n=2))(torch.randn(4, 16))
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
