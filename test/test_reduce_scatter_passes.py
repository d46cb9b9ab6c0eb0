"""The reduce-scatter pass (torch_ce/passes/reduce_scatter.py) on hand-built post-grad
graphs: what it retargets, what it refuses and why, as golden projections (expecttest,
test/golden_projection.py) and as the record's rows. The runs of the retargeted ops are
test/test_reduce_scatter_host.py's and test/test_reduce_scatter_training.py's."""
from __future__ import annotations

import expecttest
import torch
import torch.fx as fx
from golden_projection import project
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_ce  # noqa: F401  (the magi ops)
from torch_ce.config import config
from torch_ce.passes import reduce_scatter as rs_mod

C10D = torch.ops._c10d_functional


def _graph(specs):
    """One placeholder and one reduce-scatter + wait per (shape, dtype, op, device) spec,
    and a coalesced one over the first two fp32 inputs."""
    mode = FakeTensorMode()
    g = fx.Graph()
    phs = []
    for k, (shape, dtype, op, dev) in enumerate(specs):
        ph = g.placeholder(f"grad{k}")
        with mode:
            ph.meta["val"] = torch.empty(shape, dtype=dtype, device=dev)
        phs.append(ph)
        rs = g.call_function(C10D.reduce_scatter_tensor.default, (ph, op, 2, "0"))
        with mode:
            rs.meta["val"] = torch.empty((shape[0] // 2, *shape[1:]), dtype=dtype, device=dev)
        g.call_function(C10D.wait_tensor.default, (rs,))
    co = g.call_function(C10D.reduce_scatter_tensor_coalesced.default, (phs[:2], "avg", 2, "0"))
    g.output([co])
    return g


SPECS = [((8, 4), torch.float32, "sum", "cpu"), ((6,), torch.float32, "sum", "cpu"),
         ((4, 4), torch.bfloat16, "avg", "cpu"), ((4, 4), torch.float16, "sum", "cpu"),
         ((4, 4), torch.float32, "max", "cpu"), ((4, 4), torch.float32, "sum", "cuda")]


class ReduceScatterPassTest(expecttest.TestCase):
    def test_off_by_default(self):
        g = _graph(SPECS)
        before = project(g)
        rows = rs_mod.rewrite(g, config)
        self.assertEqual(project(g), before)
        self.assertEqual({r["kind"] for r in rows}, {"collective"})
        self.assertTrue(all(r["reason"] == rs_mod.OFF for r in rows))

    def test_retargets_what_it_can_and_says_why_not(self):
        g = _graph(SPECS)
        with config.patch(reduce_scatter="copy_engine"):
            rows = rs_mod.rewrite(g, config)
        self.assertExpectedInline(project(g), """\
%0 = magi.ce_reduce_scatter(grad0, 'sum', 2, '0', 'reduce_scatter_tensor_default (float32[8, 4])')
_c10d_functional.wait_tensor(%0)
%1 = magi.ce_reduce_scatter(grad1, 'sum', 2, '0', 'reduce_scatter_tensor_default_1 (float32[6])')
_c10d_functional.wait_tensor(%1)
%2 = magi.ce_reduce_scatter(grad2, 'avg', 2, '0', 'reduce_scatter_tensor_default_2 (bfloat16[4, 4])')
_c10d_functional.wait_tensor(%2)
%3 = _c10d_functional.reduce_scatter_tensor(grad3, 'sum', 2, '0')
_c10d_functional.wait_tensor(%3)
%4 = _c10d_functional.reduce_scatter_tensor(grad4, 'max', 2, '0')
_c10d_functional.wait_tensor(%4)
%5 = magi.ce_reduce_scatter(grad5, 'sum', 2, '0', 'reduce_scatter_tensor_default_5 (float32[4, 4])')
_c10d_functional.wait_tensor(%5)
%6 = magi.ce_reduce_scatter_coalesced([grad0, grad1], 'avg', 2, '0', 'reduce_scatter_tensor_coalesced_default (float32[8, 4], float32[6])') -> output""")
        why = {r["name"].split(" ")[0]: r["reason"] for r in rows if r["kind"] != "ce"}
        self.assertEqual(set(why), {"reduce_scatter_tensor_default_3", "reduce_scatter_tensor_default_4"})
        self.assertIn("fp32, bf16", why["reduce_scatter_tensor_default_3"])
        self.assertIn("'max'", why["reduce_scatter_tensor_default_4"])
        self.assertEqual([r["bytes"] for r in rows if r["kind"] == "ce"], [128, 24, 32, 64, 152])

    def test_host_transport_off_keeps_cpu_gradients(self):
        g = _graph(SPECS[:1])
        with config.patch(reduce_scatter="copy_engine", host_transport=False):
            rows = rs_mod.rewrite(g, config)
        self.assertEqual([r["reason"] for r in rows], ["host_transport is off"] * 2)  # single, coalesced


if __name__ == "__main__":
    expecttest.run_tests()
