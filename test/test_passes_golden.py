"""Golden FX dumps of what torch_ce's passes do to post-grad graphs.

One process, the fake process group (world size 2, rank 0): tracing and compiling need no
peers. Each test compiles a small SimpleFSDP-style model with plain torch.compile and
records the post-grad graph after our passes, as the projection of what torch_ce did
(golden_projection.py: its own nodes, the collectives and waits, inputs by parameter name),
which a torch release that renumbers or refolds the graph leaves alone. Regenerate with
EXPECTTEST_ACCEPT=1.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase
from golden_projection import project
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import torch_ce
from torch_ce import report
from torch_ce.passes import census, manager
from torch_ce.simple_fsdp import gathered, shard_param


def shard_weight(mod: nn.Module, mesh, name="weight", cast=None):
    shard_param(mod, name, mesh, cast=cast)


@pytest.fixture(scope="module", autouse=True)
def fake_pg():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


class GoldenCase(TestCase):
    maxDiff = None  # a golden failure prints its whole diff

    def setUp(self):
        torch.manual_seed(0)
        self.mesh = init_device_mesh("cpu", (2,))
        report.clear()
        self.graphs: list[str] = []  # projections
        self.raw: list[str] = []  # the graphs as FX prints them
        self.enterContext(manager.observing(self._record))
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(
            torch._inductor.config.patch(fx_graph_cache=False, compile_threads=1)
        )
        torch._dynamo.reset()

    def tearDown(self):
        torch_ce.disable()
        self.stack.close()
        torch._dynamo.reset()
        torch_ce.release_all()

    def _record(self, graph):
        self.graphs.append(project(graph))
        self.raw.append(str(graph).strip())

    def compile_and_run(self, model, *inputs, **cfg):
        torch_ce.enable(**cfg)
        with torch.no_grad():
            out = torch.compile(model)(*inputs)
            ref = model(*inputs)
        # The fake group returns garbage data, but the shapes must match eager.
        self.assertEqual(out.shape, ref.shape)
        self.assertEqual(len(self.graphs), 1)
        return self.graphs[0]

    def mlp(self, dims=(8, 16, 8)):
        m = nn.Sequential(*[nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:])])
        for lin in m:
            shard_weight(lin, self.mesh)
        return m


class GoldenTest(GoldenCase):
    def test_all_eligible(self):
        g = self.compile_and_run(self.mlp(), torch.randn(4, 8), transport="copy_engine")
        self.assertExpectedInline(g, """\
magi.ce_bind([0.weight, 1.weight], [2, 2], ['0', '0'], ['0.weight', '1.weight'], ['', ''])
%0 = magi.ce_all_gather(0.weight, 2, '0')
%1 = _c10d_functional.wait_tensor(%0) -> aten.permute
%2 = magi.ce_all_gather(1.weight, 2, '0')
%3 = _c10d_functional.wait_tensor(%2) -> aten.permute""")
        rec = report.graphs[-1]
        self.assertEqual(len(rec.bound), 2)
        self.assertEqual(rec.refused, [])

    def test_prefetch_next_call(self):
        """The leading CE weights within the budget, listed once after the last launch."""
        mlp = self.mlp((8, 16, 8, 4))
        # Gathered bytes: 512 + 512 + 128; a budget of 1100 B takes the first two.
        g = self.compile_and_run(mlp, torch.randn(4, 8), transport="copy_engine",
                                 prefetch_next_call_mib=1100 / 2**20)
        self.assertExpectedInline(g, """\
magi.ce_bind([0.weight, 1.weight, 2.weight], [2, 2, 2], ['0', '0', '0'], ['0.weight', '1.weight', '2.weight'], ['', '', ''])
%0 = magi.ce_all_gather(0.weight, 2, '0')
%1 = _c10d_functional.wait_tensor(%0) -> aten.permute
%2 = magi.ce_all_gather(1.weight, 2, '0')
%3 = _c10d_functional.wait_tensor(%2) -> aten.permute
%4 = magi.ce_all_gather(2.weight, 2, '0')
magi.ce_prefetch([0.weight, 1.weight], 2, '0')
%5 = _c10d_functional.wait_tensor(%4) -> aten.permute""")
        self.assertEqual(len(report.graphs[-1].prefetch["members"]), 2)  # which: the golden

    def test_prefetch_after_the_last_padded_gather(self):
        """The prefetch goes after the group's last launch of any form: a padded gather
        after it would drop the parked set on every call (perf-notes section 21)."""
        mlp = self.mlp((8, 16, 9, 5))  # 16 rows even, then 9 and 5 rows over 2: padded
        g = self.compile_and_run(mlp, torch.randn(4, 8), transport="copy_engine",
                                 prefetch_next_call_mib=1.0)
        self.assertExpectedInline(g, """\
magi.ce_bind([0.weight, 1.weight, 2.weight], [2, 2, 2], ['0', '0', '0'], ['0.weight', '1.weight', '2.weight'], ['', '', ''], [0, 5, 3])
%0 = magi.ce_all_gather(0.weight, 2, '0')
%1 = _c10d_functional.wait_tensor(%0) -> aten.permute
%2 = magi.ce_all_gather_padded(1.weight, 5, 2, '0')
%3 = _c10d_functional.wait_tensor(%2) -> aten.slice
%4 = magi.ce_all_gather_padded(2.weight, 3, 2, '0')
magi.ce_prefetch([0.weight], 2, '0')
%5 = _c10d_functional.wait_tensor(%4) -> aten.slice""")
        self.assertEqual(len(report.graphs[-1].prefetch["members"]), 1)  # which: the golden

    def test_prefetch_budget_below_first_bucket(self):
        g = self.compile_and_run(self.mlp(), torch.randn(4, 8), transport="copy_engine",
                                 prefetch_next_call_mib=100 / 2**20)
        self.assertNotIn("ce_prefetch", g)
        self.assertEqual(report.graphs[-1].prefetch["members"], [])
        self.assertIn("> prefetch_next_call_mib", report.graphs[-1].prefetch["what"])

    def test_transport_nccl_untouched(self):
        """transport="nccl" changes no graph: a user's post-grad pass sees the graph as
        Inductor made it, and ours (chained after it only to carry the cache identity,
        NOTE [a cache shared by ranks]) leaves it exactly as the user's pass saw it."""
        from torch_ce.passes import install
        from torch._inductor.custom_graph_pass import CustomGraphPass

        class Recorder(CustomGraphPass):
            def __call__(s, graph):
                self._record(graph)

            def uuid(s):
                return "recorder"

        rec = Recorder()
        self.stack.enter_context(torch._inductor.config.patch(post_grad_custom_post_pass=rec))
        torch_ce.enable(transport="nccl")
        installed = torch._inductor.config.post_grad_custom_post_pass
        self.assertIsInstance(installed, install._Chained)
        self.assertIs(installed.first, rec)
        with torch.no_grad():
            torch.compile(self.mlp())(torch.randn(4, 8))
        # The user's pass saw the graph, then our observer saw it after our pass: the same.
        self.assertEqual(len(self.graphs), 2)
        self.assertEqual(self.raw[0], self.raw[1])
        g = self.graphs[0]
        self.assertNotIn("magi", self.raw[0])
        self.assertExpectedInline(g, """\
%0 = _c10d_functional.all_gather_into_tensor(0.weight, 2, '0')
%1 = _c10d_functional.wait_tensor(%0) -> aten.permute
%2 = _c10d_functional.all_gather_into_tensor(1.weight, 2, '0')
%3 = _c10d_functional.wait_tensor(%2) -> aten.permute""")
        # Counted, never "100.0% of 0 gathered B" (NOTE [every gather is counted]).
        cov = torch_ce.explain().coverage().total
        dims = (8, 16, 8)  # mlp()'s: fp32 weights gathered in full
        weight_bytes = sum(a * b for a, b in zip(dims, dims[1:])) * 4
        self.assertEqual((cov.ce_bytes, cov.collective_bytes), (0, weight_bytes))
        self.assertEqual({r.code for r in report.graphs[-1].refused}, {int(census.NCCL_TRANSPORT.code)})
        e = torch_ce.explain()  # the user's choice, not a refusal
        self.assertEqual({(w.param, w.status) for w in e.weights}, {("0.weight", "collective"), ("1.weight", "collective")})
        self.assertIn("(transport=nccl): 2 weight(s) on the collective", e.table())

    def test_mixed_refusals_stay_on_nccl(self):
        mesh = self.mesh

        class Mixed(nn.Module):
            def __init__(s):
                super().__init__()
                s.ok = nn.Linear(8, 8, bias=False)
                s.uneven = nn.Linear(8, 9, bias=False)  # 9 rows over 2 ranks
                s.cast = nn.Linear(9, 8, bias=False)
                s.tiny = nn.Linear(8, 2, bias=False)  # below the floor
                shard_weight(s.ok, mesh)
                shard_weight(s.uneven, mesh)
                shard_weight(s.cast, mesh, cast=torch.bfloat16)
                shard_weight(s.tiny, mesh)

            def forward(s, x):
                x = s.ok(x)
                x = s.uneven(x)
                x = s.cast(x.to(torch.bfloat16)).float()
                # A gather whose input is not a graph input (an activation).
                y = torch.distributed._functional_collectives.all_gather_tensor(x * 2, 0, dist.group.WORLD)
                return s.tiny(x) + y[: x.shape[0], :2]

        # cast_slots off: the cast stays a refusal here (cast slots: test_uneven_and_cast_slots).
        g = self.compile_and_run(Mixed(), torch.randn(4, 8), transport="copy_engine",
                                 symm_min_shard_mib=100 / 2**20, cast_slots=False)
        self.assertExpectedInline(g, """\
magi.ce_bind([ok.weight, uneven.weight, cast.weight, tiny.weight], [2, 2, 2, 2], ['0', '0', '0', '0'], ['ok.weight', 'uneven.weight', 'cast.weight', 'tiny.weight'], ['', '', '24|cast before gather (store inference weights in the compute dtype)', '8|shard below symm_min_shard_mib (32 B < 100 B)'], [0, 5, 0, 0])
%0 = magi.ce_all_gather(ok.weight, 2, '0')
%1 = _c10d_functional.wait_tensor(%0) -> aten.permute
%2 = magi.ce_all_gather_padded(uneven.weight, 5, 2, '0')
%3 = _c10d_functional.wait_tensor(%2) -> aten.slice
%4 = _c10d_functional.all_gather_into_tensor(cast.weight.to(bfloat16), 2, '0')
%5 = _c10d_functional.wait_tensor(%4) -> aten.permute
%6 = _c10d_functional.all_gather_into_tensor(<aten.mul>, 2, '0')
%7 = _c10d_functional.wait_tensor(%6) -> aten.slice
%8 = _c10d_functional.all_gather_into_tensor(tiny.weight, 2, '0')
%9 = _c10d_functional.wait_tensor(%8) -> aten.permute""")
        reasons = sorted(r["reason"] for r in report.graphs[-1].refused)
        self.assertEqual(len(report.graphs[-1].bound), 2)  # ok, and uneven (a padded slot)
        self.assertTrue(any("cast before gather" in r for r in reasons), reasons)
        self.assertTrue(any("symm_min_shard_mib" in r for r in reasons), reasons)
        self.assertTrue(any("not directly a graph input" in r for r in reasons), reasons)

    def test_uneven_and_cast_slots(self):
        """An uneven Shard(0) gather becomes ``ce_all_gather_padded`` with the rows every
        rank's slot holds (9 rows over 2: 5, the short rank's 4 padded to 5; this is rank 0,
        which has no pad to drop), and the slice after the wait stays; an inference cast
        gather reads a cast slot (``ce_stage`` with ``static``; ``ce_staged``)."""
        mesh = self.mesh

        class Uneven(nn.Module):
            def __init__(s):
                super().__init__()
                s.uneven = nn.Linear(8, 9, bias=False)  # 9 rows over 2 ranks
                s.one = nn.Linear(9, 1, bias=False)  # 1 row over 2: rank 1's shard is empty
                s.cast = nn.Linear(1, 8, bias=False)
                shard_weight(s.uneven, mesh)
                shard_weight(s.one, mesh)
                shard_weight(s.cast, mesh, cast=torch.bfloat16)

            def forward(s, x):
                return s.cast(s.one(s.uneven(x)).to(torch.bfloat16)).float()

        g = self.compile_and_run(Uneven(), torch.randn(4, 8), transport="copy_engine")
        self.assertExpectedInline(g, """\
magi.ce_bind([uneven.weight, one.weight], [2, 2], ['0', '0'], ['uneven.weight', 'one.weight'], ['', ''], [5, 1])
magi.ce_stage([cast.weight], ['bfloat16'], [2], ['0'], ['cast.weight'], [''], False, [0], True)
%0 = magi.ce_staged([cast.weight], ['bfloat16'], ['0'], True)
%1 = %0[0]
%2 = magi.ce_all_gather_padded(uneven.weight, 5, 2, '0')
%3 = _c10d_functional.wait_tensor(%2) -> aten.slice
%4 = magi.ce_all_gather_padded(one.weight, 1, 2, '0')
%5 = _c10d_functional.wait_tensor(%4) -> aten.slice
%6 = magi.ce_all_gather(%1, 2, '0')
%7 = _c10d_functional.wait_tensor(%6) -> aten.permute""")
        rec = report.graphs[-1]
        self.assertEqual(rec.refused, [])
        self.assertEqual(sorted((b["param"], b["padded_rows"], b["cast_slot"]) for b in rec.bound),
                         [("cast.weight", None, "bfloat16"), ("one.weight", 1, None),
                          ("uneven.weight", 5, None)])

    def test_bucketing_splits_on_dtype_cap_and_bind_flag(self):
        mesh = self.mesh

        class Stack(nn.Module):
            """Gathers every weight up front (program-adjacent), then computes."""

            def __init__(s):
                super().__init__()
                dts = [torch.float32, torch.float32, torch.bfloat16, torch.float32,
                       torch.float32, torch.float32, torch.float32]
                rows = [8, 8, 8, 8, 64, 8, 2]  # the 64-row one breaks the size cap; the
                s.ws = nn.ParameterList()    # last (2 rows) is below the floor: unbound
                for r, dt in zip(rows, dts, strict=True):
                    w = distribute_tensor(torch.randn(r, 8, dtype=dt), mesh, [Shard(0)])
                    s.ws.append(nn.Parameter(w, requires_grad=False))

            def forward(s, x):
                full = [gathered(w) for w in s.ws]
                return sum((x @ f.float().t()).sum() for f in full)

        g = self.compile_and_run(Stack(), torch.randn(4, 8), transport="copy_engine",
                                 bucket_size_mib=600 / 2**20, symm_min_shard_mib=40 / 2**20)
        self.assertExpectedInline(g, """\
magi.ce_bind([ws.0, ws.1, ws.2, ws.3, ws.4, ws.5, ws.6], [2, 2, 2, 2, 2, 2, 2], ['0', '0', '0', '0', '0', '0', '0'], ['ws.0', 'ws.1', 'ws.2', 'ws.3', 'ws.4', 'ws.5', 'ws.6'], ['', '', '', '', '', '', '8|shard below symm_min_shard_mib (32 B < 40 B)'])
%0 = magi.ce_all_gather_coalesced([ws.0, ws.1], 2, '0')
%1 = %0[0]
%2 = %0[1]
%3 = _c10d_functional.wait_tensor(%1) -> aten.permute
%4 = _c10d_functional.wait_tensor(%2) -> aten.permute
%5 = magi.ce_all_gather(ws.2, 2, '0')
%6 = _c10d_functional.wait_tensor(%5) -> prims.convert_element_type
%7 = magi.ce_all_gather(ws.3, 2, '0')
%8 = _c10d_functional.wait_tensor(%7) -> aten.permute
%9 = magi.ce_all_gather(ws.4, 2, '0')
%10 = _c10d_functional.wait_tensor(%9) -> aten.permute
%11 = magi.ce_all_gather(ws.5, 2, '0')
%12 = _c10d_functional.wait_tensor(%11) -> aten.permute
%13 = _c10d_functional.all_gather_into_tensor(ws.6, 2, '0')
%14 = _c10d_functional.wait_tensor(%13) -> aten.permute""")
        kinds = [(b["kind"], len(b["members"])) for b in report.graphs[-1].buckets]
        self.assertExpectedInline(str(kinds), """[('ce', 2), ('ce', 1), ('ce', 1), ('ce', 1), ('ce', 1), ('collective', 1)]""")

    def embedding_lm(self, tied: bool):
        """torchtitan's Embedding.forward (the parametrized weight read twice: two gathers,
        the first dead), a linear, and with ``tied`` an LM head on the embedding weight."""

        class TitanEmbedding(nn.Embedding):
            def forward(self, t):
                from torch.distributed.tensor import DTensor

                w = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
                return F.embedding(t, w)

        class LM(nn.Module):
            def __init__(self, mesh):
                super().__init__()
                self.tok = TitanEmbedding(16, 8)
                self.lin = nn.Linear(8, 8, bias=False)
                shard_weight(self.tok, mesh)
                shard_weight(self.lin, mesh)

            def forward(self, t):
                h = self.lin(self.tok(t))
                return h @ self.tok.weight.t() if tied else h

        return LM(self.mesh)

    def test_embedding_rows(self):
        """NOTE [row gathers]: the lookup reads its rows; both gathers of the table go."""
        ids = torch.randint(0, 16, (2, 3))
        g = self.compile_and_run(self.embedding_lm(tied=False), ids, transport="copy_engine")
        self.assertExpectedInline(g, """\
magi.ce_bind([tok.weight, lin.weight], [2, 2], ['0', '0'], ['tok.weight', 'lin.weight'], ['', ''])
%0 = magi.ce_gather_rows(tok.weight, t, 2, '0') -> aten.view
%1 = magi.ce_row_positions(t) -> aten.embedding
%2 = magi.ce_all_gather(lin.weight, 2, '0')
%3 = _c10d_functional.wait_tensor(%2) -> aten.permute""")
        rows = report.graphs[-1].bound[0]["rows"]
        self.assertEqual((rows["rows"], rows["row_bytes"], rows["reason"]), (6, 32, ""))

    def test_embedding_rows_from_cast_slot(self):
        """NOTE [row gathers], a bf16 ``param_dtype`` table (issue 47): the gather reads the
        table's cast slot, so its lookup reads the slot's rows (never the fp32 shard), and
        the lookup stays, through its positions (NOTE [row gathers fuse as lookups])."""
        mesh = self.mesh

        class LM(nn.Module):
            def __init__(s):
                super().__init__()
                s.tok = nn.Embedding(16, 8)
                s.lin = nn.Linear(8, 8, bias=False)
                shard_weight(s.tok, mesh, cast=torch.bfloat16)
                shard_weight(s.lin, mesh, cast=torch.bfloat16)

            def forward(s, t):
                return s.lin(s.tok(t)).float()

        g = self.compile_and_run(LM(), torch.randint(0, 16, (2, 3)), transport="copy_engine")
        self.assertExpectedInline(g, """\
magi.ce_stage([tok.weight, lin.weight], ['bfloat16', 'bfloat16'], [2, 2], ['0', '0'], ['tok.weight', 'lin.weight'], ['', ''], False, [0, 0], True)
%0 = magi.ce_staged([tok.weight, lin.weight], ['bfloat16', 'bfloat16'], ['0', '0'], True)
%1 = %0[0]
%2 = %0[1]
%3 = magi.ce_gather_rows(%1, t, 2, '0') -> aten.view
%4 = magi.ce_row_positions(t) -> aten.embedding
%5 = magi.ce_all_gather(%2, 2, '0')
%6 = _c10d_functional.wait_tensor(%5) -> aten.permute""")
        rec = report.graphs[-1]
        self.assertEqual(rec.refused, [])
        tok = next(b for b in rec.bound if b["param"] == "tok.weight")
        # 6 rows of 8 bf16 values: the cast slot's rows, not the fp32 shard's.
        self.assertEqual((tok["cast_slot"], tok["rows"]["rows"], tok["rows"]["row_bytes"],
                          tok["rows"]["bytes_per_forward"], tok["rows"]["reason"]),
                         ("bfloat16", 6, 16, 96, ""))
        self.assertEqual(tok["ce_gathered_bytes"], 96)

    def test_row_gathers_off_keeps_full_gathers(self):
        """row_gathers=False (the bench's ce_fullrows A/B): the table is gathered in full."""
        ids = torch.randint(0, 16, (2, 3))
        g = self.compile_and_run(self.embedding_lm(tied=False), ids, transport="copy_engine",
                                 row_gathers=False)
        self.assertNotIn("ce_gather_rows", g)
        self.assertIn("-> aten.embedding", g)
        self.assertEqual(g.count("magi.ce_all_gather"), 2)  # the table (coalesced twice) and lin

    def test_embedding_tied_head_stays_full(self):
        """A tied head reads the gathered table: every gather of it stays a full CE gather."""
        ids = torch.randint(0, 16, (2, 3))
        g = self.compile_and_run(self.embedding_lm(tied=True), ids, transport="copy_engine")
        self.assertExpectedInline(g, """\
magi.ce_bind([tok.weight, lin.weight], [2, 2], ['0', '0'], ['tok.weight', 'lin.weight'], ['', ''])
%0 = magi.ce_all_gather(tok.weight, 2, '0')
%1 = _c10d_functional.wait_tensor(%0) -> aten.embedding
%2 = magi.ce_all_gather(lin.weight, 2, '0')
%3 = _c10d_functional.wait_tensor(%2) -> aten.permute
%4 = magi.ce_all_gather(tok.weight, 2, '0')
%5 = _c10d_functional.wait_tensor(%4) -> aten.permute""")
        rows = report.graphs[-1].bound[0]["rows"]
        self.assertIn("tied LM head", rows["reason"])


class GoldenTrainingTest(GoldenCase):
    def test_training_forward_and_backward_staged(self):
        """NOTE [training: staged windows and step fences]: a bf16 param_dtype training
        step. The forward's ce_stage refreshes (last arg True) and its gathers read the
        staging slots, the casts gone; reshard after forward makes the backward gather
        again, from the same slots (ce_stage read-only, last arg False). (The fake
        group's DTensor reduces the gradients by a local split.)"""
        m = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False))
        for lin in m:
            shard_param(lin, "weight", self.mesh, cast=torch.bfloat16, requires_grad=True)
        torch_ce.enable(transport="copy_engine")
        out = torch.compile(m)(torch.randn(4, 8, dtype=torch.bfloat16))
        out.float().sum().backward()
        self.assertEqual(len(self.graphs), 2)
        fw, bw = self.graphs
        self.assertExpectedInline(fw, """\
magi.ce_stage([0.weight, 1.weight], ['bfloat16', 'bfloat16'], [2, 2], ['0', '0'], ['0.weight', '1.weight'], ['', ''], True)
%0 = magi.ce_staged([0.weight, 1.weight], ['bfloat16', 'bfloat16'], ['0', '0'])
%1 = %0[0]
%2 = %0[1]
%3 = magi.ce_all_gather(%1, 2, '0')
%4 = _c10d_functional.wait_tensor(%3) -> aten.permute
%5 = magi.ce_all_gather(%2, 2, '0')
%6 = _c10d_functional.wait_tensor(%5) -> aten.permute""")
        self.assertExpectedInline(bw, """\
magi.ce_stage([1.weight], ['bfloat16'], [2], ['0'], ['1.weight'], [''], False)
%0 = magi.ce_staged([1.weight], ['bfloat16'], ['0'])
%1 = %0[0]
%2 = magi.ce_all_gather(%1, 2, '0')
%3 = _c10d_functional.wait_tensor(%2) -> aten.permute""")


def test_graph_with_gradients_stays_on_nccl():
    """With ``training=False`` a training graph keeps NCCL and still trains correctly."""
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    lin = nn.Linear(8, 8, bias=False)
    w = nn.Parameter(distribute_tensor(lin.weight.data.clone(), mesh, [Shard(0)]))
    report.clear()
    torch._dynamo.reset()
    torch_ce.enable(transport="copy_engine", training=False)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            f = torch.compile(lambda x: (x @ gathered(w).t()).sum())
            x = torch.randn(4, 8)
            loss = f(x)
            loss.backward()
        assert w.grad is not None
        refused = [r["reason"] for g in report.graphs for r in g.refused]
        assert refused and all("gradients" in r for r in refused), refused
        assert all(not g.bound for g in report.graphs)
    finally:
        torch_ce.disable()
        torch_ce.config.update(training=True)
        torch._dynamo.reset()


def test_projection_ignores_numbering_and_cast_folding():
    """The goldens survive a torch release that renumbers placeholders, adds unused ones
    or spells a cast another way (golden_projection.py); a dtype change still shows."""
    from torch_ce.passes import param_names

    c10d, aten, prims = torch.ops._c10d_functional, torch.ops.aten, torch.ops.prims

    def graph(placeholders, cast):
        g = torch.fx.Graph()
        phs = {}
        for name in placeholders:
            phs[name] = g.placeholder(name)
            phs[name].meta["val"] = torch.empty(4, 8, device="meta")
        w = phs[placeholders[-1]]
        w.meta[param_names._META_KEY] = "lin.weight"  # what annotate() finds in a compile
        x = cast(g, w)
        ag = g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "0"))
        wt = g.call_function(c10d.wait_tensor.default, (ag,))
        g.output((g.call_function(aten.permute.default, (wt, [1, 0])),))
        return project(g)

    def convert(dtype):
        def cast(g, w):
            n = g.call_function(prims.convert_element_type.default, (w, dtype))
            n.meta["val"] = torch.empty(4, 8, dtype=dtype, device="meta")
            return n
        return cast

    def to_copy(g, w):
        n = g.call_function(aten._to_copy.default, (w,), {"dtype": torch.bfloat16})
        n.meta["val"] = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
        return n

    def twice(g, w):
        return convert(torch.bfloat16)(g, convert(torch.float32)(g, w))

    golden = graph(["arg0_1"], convert(torch.bfloat16))
    assert golden == """\
%0 = _c10d_functional.all_gather_into_tensor(lin.weight.to(bfloat16), 2, '0')
%1 = _c10d_functional.wait_tensor(%0) -> aten.permute"""
    assert graph(["primals_1", "primals_2", "primals_7"], to_copy) == golden
    assert graph(["arg3_1"], twice) == golden
    assert graph(["arg0_1"], convert(torch.float16)) != golden
    assert graph(["arg0_1"], lambda g, w: w) != golden
