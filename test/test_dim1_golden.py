"""Golden FX dump of the Shard(1) rewrite (NOTE [Shard(1) reads] in passes/gate.py).

One process, the fake process group (world size 2, rank 0), as test_passes_golden.py: a
3-D expert weight sharded on dim 1 is gathered along dim 0 and re-split by
split + getitem + cat in the post-grad graph; after the passes the gather is one
``magi.ce_all_gather_dim(%w, 2, '0', 1)`` whose wait feeds the users of the cat, and the
split, getitems and cat are gone. The golden is the projection of what torch_ce did
(golden_projection.py). Regenerate with EXPECTTEST_ACCEPT=1.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.utils.parametrize as P
from expecttest import TestCase
from golden_projection import project
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import torch_ce
from torch_ce import report
from torch_ce.passes import manager


class Gather(nn.Module):
    def forward(self, w):
        return w.redistribute(placements=[Replicate()]).to_local()


class Experts(nn.Module):
    def __init__(self, E=2, D=8, H=12):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, H, D))
        self.w2 = nn.Parameter(torch.randn(E, D, H))

    def forward(self, x):
        h = torch.bmm(x, self.w1.transpose(1, 2))
        return torch.bmm(torch.relu(h), self.w2.transpose(1, 2))


@pytest.fixture(scope="module", autouse=True)
def fake_pg():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


class Dim1GoldenTest(TestCase):
    maxDiff = None  # a golden failure prints its whole diff

    def setUp(self):
        torch.manual_seed(0)
        self.mesh = init_device_mesh("cpu", (2,))
        report.clear()
        self.graphs: list[str] = []
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(manager.observing(self._record))
        self.stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False, compile_threads=1))
        torch._dynamo.reset()

    def tearDown(self):
        torch_ce.disable()
        self.stack.close()
        torch._dynamo.reset()
        torch_ce.release_all()

    def _record(self, graph):
        self.graphs.append(project(graph))

    def experts(self, dims=(1, 1)):
        m = Experts()
        for name, d in zip(("w1", "w2"), dims, strict=True):
            w = getattr(m, name)
            setattr(m, name, nn.Parameter(distribute_tensor(w.data, self.mesh, [Shard(d)]), requires_grad=False))
            P.register_parametrization(m, name, Gather(), unsafe=True)
        return m

    def test_dim1_gather_folds_the_resplit(self):
        torch_ce.enable(transport="copy_engine", symm_min_shard_mib=0)
        with torch.no_grad():
            out = torch.compile(self.experts())(torch.randn(2, 3, 8))
        self.assertEqual(out.shape, (2, 3, 8))
        self.assertEqual(len(self.graphs), 1)
        self.assertExpectedInline(self.graphs[0], """\
magi.ce_bind([w1, w2], [2, 2], ['0', '0'], ['w1', 'w2'], ['', ''])
%0 = magi.ce_all_gather_dim(w1, 2, '0', 1)
%1 = _c10d_functional.wait_tensor(%0) -> aten.permute
%2 = magi.ce_all_gather_dim(w2, 2, '0', 1)
%3 = _c10d_functional.wait_tensor(%2) -> aten.permute""")
        rec = report.graphs[-1]
        self.assertEqual([b["param"] for b in rec.bound], ["w1", "w2"])
        self.assertEqual(rec.refused, [])
