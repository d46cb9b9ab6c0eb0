"""Golden FX dumps of what torch_ce's passes do to post-grad graphs.

One process, the fake process group (world size 2, rank 0): tracing and compiling need no
peers. Each test compiles a small SimpleFSDP-style model with plain torch.compile and
records the post-grad graph after our passes. Regenerate with EXPECTTEST_ACCEPT=1.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import torch_ce
from torch_ce import report
from torch_ce.passes import manager
from torch_ce.simple_fsdp import gathered, shard_param


def shard_weight(mod: nn.Module, mesh, name="weight", cast=None):
    shard_param(mod, name, mesh, cast=cast)


@pytest.fixture(scope="module", autouse=True)
def fake_pg():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


class GoldenTest(TestCase):
    def setUp(self):
        torch.manual_seed(0)
        self.mesh = init_device_mesh("cpu", (2,))
        report.clear()
        self.graphs: list[str] = []
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
        self.graphs.append(str(graph).strip())

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

    def test_all_eligible(self):
        g = self.compile_and_run(self.mlp(), torch.randn(4, 8), transport="copy_engine")
        self.assertExpectedInline(g, """\
graph():
    %arg0_1 : [num_users=2] = placeholder[target=arg0_1]
    %arg1_1 : [num_users=0] = placeholder[target=arg1_1]
    %arg2_1 : [num_users=1] = placeholder[target=arg2_1]
    %arg3_1 : [num_users=2] = placeholder[target=arg3_1]
    %arg4_1 : [num_users=0] = placeholder[target=arg4_1]
    %ce_bind_default : [num_users=0] = call_function[target=torch.ops.magi.ce_bind.default](args = ([%arg0_1, %arg3_1], [2, 2], [0, 0], [0.weight, 1.weight], [, ]), kwargs = {})
    %all_gather_into_tensor : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg0_1, 2, 0), kwargs = {})
    %wait_tensor : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor,), kwargs = {})
    %permute : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor, [1, 0]), kwargs = {})
    %mm : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%arg2_1, %permute), kwargs = {})
    %all_gather_into_tensor_1 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg3_1, 2, 0), kwargs = {})
    %wait_tensor_1 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_1,), kwargs = {})
    %permute_1 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_1, [1, 0]), kwargs = {})
    %mm_1 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%mm, %permute_1), kwargs = {})
    return (mm_1,)""")
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
graph():
    %arg0_1 : [num_users=3] = placeholder[target=arg0_1]
    %arg1_1 : [num_users=0] = placeholder[target=arg1_1]
    %arg2_1 : [num_users=1] = placeholder[target=arg2_1]
    %arg3_1 : [num_users=3] = placeholder[target=arg3_1]
    %arg4_1 : [num_users=0] = placeholder[target=arg4_1]
    %arg5_1 : [num_users=2] = placeholder[target=arg5_1]
    %arg6_1 : [num_users=0] = placeholder[target=arg6_1]
    %ce_bind_default : [num_users=0] = call_function[target=torch.ops.magi.ce_bind.default](args = ([%arg0_1, %arg3_1, %arg5_1], [2, 2, 2], [0, 0, 0], [0.weight, 1.weight, 2.weight], [, , ]), kwargs = {})
    %all_gather_into_tensor : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg0_1, 2, 0), kwargs = {})
    %wait_tensor : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor,), kwargs = {})
    %permute : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor, [1, 0]), kwargs = {})
    %mm : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%arg2_1, %permute), kwargs = {})
    %all_gather_into_tensor_1 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg3_1, 2, 0), kwargs = {})
    %wait_tensor_1 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_1,), kwargs = {})
    %permute_1 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_1, [1, 0]), kwargs = {})
    %mm_1 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%mm, %permute_1), kwargs = {})
    %all_gather_into_tensor_2 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg5_1, 2, 0), kwargs = {})
    %ce_prefetch_default : [num_users=0] = call_function[target=torch.ops.magi.ce_prefetch.default](args = ([%arg0_1, %arg3_1], 2, 0), kwargs = {})
    %wait_tensor_2 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_2,), kwargs = {})
    %permute_2 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_2, [1, 0]), kwargs = {})
    %mm_2 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%mm_1, %permute_2), kwargs = {})
    return (mm_2,)""")
        self.assertEqual(report.graphs[-1].prefetch["members"], ["arg0_1", "arg3_1"])

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
        self.assertEqual(self.graphs[0], self.graphs[1])
        g = self.graphs[0]
        self.assertNotIn("magi", g)
        self.assertExpectedInline(g, """\
graph():
    %arg0_1 : [num_users=1] = placeholder[target=arg0_1]
    %arg1_1 : [num_users=0] = placeholder[target=arg1_1]
    %arg2_1 : [num_users=1] = placeholder[target=arg2_1]
    %arg3_1 : [num_users=1] = placeholder[target=arg3_1]
    %arg4_1 : [num_users=0] = placeholder[target=arg4_1]
    %all_gather_into_tensor : [num_users=1] = call_function[target=torch.ops._c10d_functional.all_gather_into_tensor.default](args = (%arg0_1, 2, 0), kwargs = {})
    %wait_tensor : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor,), kwargs = {})
    %permute : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor, [1, 0]), kwargs = {})
    %mm : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%arg2_1, %permute), kwargs = {})
    %all_gather_into_tensor_1 : [num_users=1] = call_function[target=torch.ops._c10d_functional.all_gather_into_tensor.default](args = (%arg3_1, 2, 0), kwargs = {})
    %wait_tensor_1 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_1,), kwargs = {})
    %permute_1 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_1, [1, 0]), kwargs = {})
    %mm_1 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%mm, %permute_1), kwargs = {})
    return (mm_1,)""")

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
graph():
    %arg0_1 : [num_users=2] = placeholder[target=arg0_1]
    %arg1_1 : [num_users=0] = placeholder[target=arg1_1]
    %arg2_1 : [num_users=1] = placeholder[target=arg2_1]
    %arg3_1 : [num_users=2] = placeholder[target=arg3_1]
    %arg4_1 : [num_users=0] = placeholder[target=arg4_1]
    %arg5_1 : [num_users=2] = placeholder[target=arg5_1]
    %arg6_1 : [num_users=0] = placeholder[target=arg6_1]
    %arg7_1 : [num_users=2] = placeholder[target=arg7_1]
    %arg8_1 : [num_users=0] = placeholder[target=arg8_1]
    %ce_bind_default : [num_users=0] = call_function[target=torch.ops.magi.ce_bind.default](args = ([%arg0_1, %arg3_1, %arg5_1, %arg7_1], [2, 2, 2, 2], [0, 0, 0, 0], [ok.weight, uneven.weight, cast.weight, tiny.weight], [, , 24|cast before gather (store inference weights in the compute dtype), 8|shard below symm_min_shard_mib (32 B < 100 B)], [0, 5, 0, 0]), kwargs = {})
    %all_gather_into_tensor : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg0_1, 2, 0), kwargs = {})
    %wait_tensor : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor,), kwargs = {})
    %permute : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor, [1, 0]), kwargs = {})
    %mm : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%arg2_1, %permute), kwargs = {})
    %all_gather_into_tensor_1 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather_padded.default](args = (%arg3_1, 5, 2, 0), kwargs = {})
    %wait_tensor_1 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_1,), kwargs = {})
    %slice_1 : [num_users=1] = call_function[target=torch.ops.aten.slice.Tensor](args = (%wait_tensor_1, 0, 0, 9), kwargs = {})
    %permute_1 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%slice_1, [1, 0]), kwargs = {})
    %mm_1 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%mm, %permute_1), kwargs = {})
    %convert_element_type : [num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mm_1, torch.bfloat16), kwargs = {})
    %convert_element_type_1 : [num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%arg5_1, torch.bfloat16), kwargs = {})
    %all_gather_into_tensor_2 : [num_users=1] = call_function[target=torch.ops._c10d_functional.all_gather_into_tensor.default](args = (%convert_element_type_1, 2, 0), kwargs = {})
    %wait_tensor_2 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_2,), kwargs = {})
    %permute_2 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_2, [1, 0]), kwargs = {})
    %mm_2 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%convert_element_type, %permute_2), kwargs = {})
    %convert_element_type_4 : [num_users=2] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mm_2, torch.float32), kwargs = {})
    %mul : [num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_4, 2), kwargs = {})
    %all_gather_into_tensor_3 : [num_users=1] = call_function[target=torch.ops._c10d_functional.all_gather_into_tensor.default](args = (%mul, 2, 0), kwargs = {})
    %wait_tensor_3 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_3,), kwargs = {})
    %all_gather_into_tensor_4 : [num_users=1] = call_function[target=torch.ops._c10d_functional.all_gather_into_tensor.default](args = (%arg7_1, 2, 0), kwargs = {})
    %wait_tensor_4 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_4,), kwargs = {})
    %permute_3 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_4, [1, 0]), kwargs = {})
    %slice_2 : [num_users=1] = call_function[target=torch.ops.aten.slice.Tensor](args = (%wait_tensor_3, 0, 0, 4), kwargs = {})
    %slice_3 : [num_users=1] = call_function[target=torch.ops.aten.slice.Tensor](args = (%slice_2, 1, 0, 2), kwargs = {})
    %addmm_default : [num_users=1] = call_function[target=torch.ops.aten.addmm.default](args = (%slice_3, %convert_element_type_4, %permute_3), kwargs = {})
    return (addmm_default,)""")
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
graph():
    %arg0_1 : [num_users=2] = placeholder[target=arg0_1]
    %arg1_1 : [num_users=0] = placeholder[target=arg1_1]
    %arg2_1 : [num_users=1] = placeholder[target=arg2_1]
    %arg3_1 : [num_users=2] = placeholder[target=arg3_1]
    %arg4_1 : [num_users=0] = placeholder[target=arg4_1]
    %arg5_1 : [num_users=2] = placeholder[target=arg5_1]
    %arg6_1 : [num_users=0] = placeholder[target=arg6_1]
    %ce_bind_default : [num_users=0] = call_function[target=torch.ops.magi.ce_bind.default](args = ([%arg0_1, %arg3_1], [2, 2], [0, 0], [uneven.weight, one.weight], [, ], [5, 1]), kwargs = {})
    %ce_stage_default : [num_users=0] = call_function[target=torch.ops.magi.ce_stage.default](args = ([%arg5_1], [bfloat16], [2], [0], [cast.weight], [], False, [0], True), kwargs = {})
    %ce_staged_default : [num_users=1] = call_function[target=torch.ops.magi.ce_staged.default](args = ([%arg5_1], [bfloat16], [0], True), kwargs = {})
    %getitem : [num_users=1] = call_function[target=operator.getitem](args = (%ce_staged_default, 0), kwargs = {})
    %all_gather_into_tensor : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather_padded.default](args = (%arg0_1, 5, 2, 0), kwargs = {})
    %wait_tensor : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor,), kwargs = {})
    %slice_1 : [num_users=1] = call_function[target=torch.ops.aten.slice.Tensor](args = (%wait_tensor, 0, 0, 9), kwargs = {})
    %permute : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%slice_1, [1, 0]), kwargs = {})
    %mm : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%arg2_1, %permute), kwargs = {})
    %all_gather_into_tensor_1 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather_padded.default](args = (%arg3_1, 1, 2, 0), kwargs = {})
    %wait_tensor_1 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_1,), kwargs = {})
    %slice_2 : [num_users=1] = call_function[target=torch.ops.aten.slice.Tensor](args = (%wait_tensor_1, 0, 0, 1), kwargs = {})
    %permute_1 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%slice_2, [1, 0]), kwargs = {})
    %mm_1 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%mm, %permute_1), kwargs = {})
    %convert_element_type : [num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mm_1, torch.bfloat16), kwargs = {})
    %all_gather_into_tensor_2 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%getitem, 2, 0), kwargs = {})
    %wait_tensor_2 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_2,), kwargs = {})
    %permute_2 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_2, [1, 0]), kwargs = {})
    %convert_element_type_2 : [num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%convert_element_type, torch.float32), kwargs = {})
    %convert_element_type_3 : [num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%permute_2, torch.float32), kwargs = {})
    %mul : [num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_2, %convert_element_type_3), kwargs = {})
    %convert_element_type_4 : [num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mul, torch.bfloat16), kwargs = {})
    %convert_element_type_5 : [num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%convert_element_type_4, torch.float32), kwargs = {})
    return (convert_element_type_5,)""")
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
                for r, dt in zip(rows, dts):
                    w = distribute_tensor(torch.randn(r, 8, dtype=dt), mesh, [Shard(0)])
                    s.ws.append(nn.Parameter(w, requires_grad=False))

            def forward(s, x):
                full = [gathered(w) for w in s.ws]
                return sum((x @ f.float().t()).sum() for f in full)

        g = self.compile_and_run(Stack(), torch.randn(4, 8), transport="copy_engine",
                                 bucket_size_mib=600 / 2**20, symm_min_shard_mib=40 / 2**20)
        self.assertExpectedInline(g, """\
graph():
    %arg0_1 : [num_users=2] = placeholder[target=arg0_1]
    %arg1_1 : [num_users=0] = placeholder[target=arg1_1]
    %arg2_1 : [num_users=2] = placeholder[target=arg2_1]
    %arg3_1 : [num_users=0] = placeholder[target=arg3_1]
    %arg4_1 : [num_users=2] = placeholder[target=arg4_1]
    %arg5_1 : [num_users=0] = placeholder[target=arg5_1]
    %arg6_1 : [num_users=2] = placeholder[target=arg6_1]
    %arg7_1 : [num_users=0] = placeholder[target=arg7_1]
    %arg8_1 : [num_users=2] = placeholder[target=arg8_1]
    %arg9_1 : [num_users=0] = placeholder[target=arg9_1]
    %arg10_1 : [num_users=2] = placeholder[target=arg10_1]
    %arg11_1 : [num_users=0] = placeholder[target=arg11_1]
    %arg12_1 : [num_users=2] = placeholder[target=arg12_1]
    %arg13_1 : [num_users=0] = placeholder[target=arg13_1]
    %arg14_1 : [num_users=7] = placeholder[target=arg14_1]
    %ce_bind_default : [num_users=0] = call_function[target=torch.ops.magi.ce_bind.default](args = ([%arg0_1, %arg2_1, %arg4_1, %arg6_1, %arg8_1, %arg10_1, %arg12_1], [2, 2, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0], [ws.0, ws.1, ws.2, ws.3, ws.4, ws.5, ws.6], [, , , , , , 8|shard below symm_min_shard_mib (32 B < 40 B)]), kwargs = {})
    %ce_all_gather_coalesced_default : [num_users=2] = call_function[target=torch.ops.magi.ce_all_gather_coalesced.default](args = ([%arg0_1, %arg2_1], 2, 0), kwargs = {})
    %getitem : [num_users=1] = call_function[target=operator.getitem](args = (%ce_all_gather_coalesced_default, 0), kwargs = {})
    %getitem_1 : [num_users=1] = call_function[target=operator.getitem](args = (%ce_all_gather_coalesced_default, 1), kwargs = {})
    %wait_tensor : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%getitem,), kwargs = {})
    %wait_tensor_1 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%getitem_1,), kwargs = {})
    %all_gather_into_tensor_2 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg4_1, 2, 0), kwargs = {})
    %wait_tensor_2 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_2,), kwargs = {})
    %all_gather_into_tensor_3 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg6_1, 2, 0), kwargs = {})
    %wait_tensor_3 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_3,), kwargs = {})
    %all_gather_into_tensor_4 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg8_1, 2, 0), kwargs = {})
    %wait_tensor_4 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_4,), kwargs = {})
    %all_gather_into_tensor_5 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg10_1, 2, 0), kwargs = {})
    %wait_tensor_5 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_5,), kwargs = {})
    %all_gather_into_tensor_6 : [num_users=1] = call_function[target=torch.ops._c10d_functional.all_gather_into_tensor.default](args = (%arg12_1, 2, 0), kwargs = {})
    %wait_tensor_6 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_6,), kwargs = {})
    %permute : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor, [1, 0]), kwargs = {})
    %mm : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%arg14_1, %permute), kwargs = {})
    %sum_1 : [num_users=1] = call_function[target=torch.ops.aten.sum.default](args = (%mm,), kwargs = {})
    %add : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%sum_1, 0), kwargs = {})
    %permute_1 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_1, [1, 0]), kwargs = {})
    %mm_1 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%arg14_1, %permute_1), kwargs = {})
    %sum_2 : [num_users=1] = call_function[target=torch.ops.aten.sum.default](args = (%mm_1,), kwargs = {})
    %add_1 : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%add, %sum_2), kwargs = {})
    %convert_element_type : [num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%wait_tensor_2, torch.float32), kwargs = {})
    %permute_2 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%convert_element_type, [1, 0]), kwargs = {})
    %mm_2 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%arg14_1, %permute_2), kwargs = {})
    %sum_3 : [num_users=1] = call_function[target=torch.ops.aten.sum.default](args = (%mm_2,), kwargs = {})
    %add_2 : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%add_1, %sum_3), kwargs = {})
    %permute_3 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_3, [1, 0]), kwargs = {})
    %mm_3 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%arg14_1, %permute_3), kwargs = {})
    %sum_4 : [num_users=1] = call_function[target=torch.ops.aten.sum.default](args = (%mm_3,), kwargs = {})
    %add_3 : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%add_2, %sum_4), kwargs = {})
    %permute_4 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_4, [1, 0]), kwargs = {})
    %mm_4 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%arg14_1, %permute_4), kwargs = {})
    %sum_5 : [num_users=1] = call_function[target=torch.ops.aten.sum.default](args = (%mm_4,), kwargs = {})
    %add_4 : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%add_3, %sum_5), kwargs = {})
    %permute_5 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_5, [1, 0]), kwargs = {})
    %mm_5 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%arg14_1, %permute_5), kwargs = {})
    %sum_6 : [num_users=1] = call_function[target=torch.ops.aten.sum.default](args = (%mm_5,), kwargs = {})
    %add_5 : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%add_4, %sum_6), kwargs = {})
    %permute_6 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_6, [1, 0]), kwargs = {})
    %mm_6 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%arg14_1, %permute_6), kwargs = {})
    %sum_7 : [num_users=1] = call_function[target=torch.ops.aten.sum.default](args = (%mm_6,), kwargs = {})
    %add_6 : [num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%add_5, %sum_7), kwargs = {})
    return (add_6,)""")
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
graph():
    %arg0_1 : [num_users=2] = placeholder[target=arg0_1]
    %arg1_1 : [num_users=0] = placeholder[target=arg1_1]
    %arg2_1 : [num_users=1] = placeholder[target=arg2_1]
    %arg3_1 : [num_users=2] = placeholder[target=arg3_1]
    %arg4_1 : [num_users=0] = placeholder[target=arg4_1]
    %ce_bind_default : [num_users=0] = call_function[target=torch.ops.magi.ce_bind.default](args = ([%arg0_1, %arg3_1], [2, 2], [0, 0], [tok.weight, lin.weight], [, ]), kwargs = {})
    %ce_gather_rows_default : [num_users=1] = call_function[target=torch.ops.magi.ce_gather_rows.default](args = (%arg0_1, %arg2_1, 2, 0), kwargs = {})
    %all_gather_into_tensor_2 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg3_1, 2, 0), kwargs = {})
    %wait_tensor_2 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_2,), kwargs = {})
    %permute : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_2, [1, 0]), kwargs = {})
    %view : [num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%ce_gather_rows_default, [6, 8]), kwargs = {})
    %mm : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%view, %permute), kwargs = {})
    %view_1 : [num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm, [2, 3, 8]), kwargs = {})
    return (view_1,)""")
        rows = report.graphs[-1].bound[0]["rows"]
        self.assertEqual((rows["rows"], rows["row_bytes"], rows["reason"]), (6, 32, ""))

    def test_row_gathers_off_keeps_full_gathers(self):
        """row_gathers=False (the bench's ce_fullrows A/B): the table is gathered in full."""
        ids = torch.randint(0, 16, (2, 3))
        g = self.compile_and_run(self.embedding_lm(tied=False), ids, transport="copy_engine",
                                 row_gathers=False)
        self.assertNotIn("ce_gather_rows", g)
        self.assertIn("aten.embedding.default", g)
        self.assertEqual(g.count("magi.ce_all_gather"), 2)  # the table (coalesced twice) and lin

    def test_embedding_tied_head_stays_full(self):
        """A tied head reads the gathered table: every gather of it stays a full CE gather."""
        ids = torch.randint(0, 16, (2, 3))
        g = self.compile_and_run(self.embedding_lm(tied=True), ids, transport="copy_engine")
        self.assertExpectedInline(g, """\
graph():
    %arg0_1 : [num_users=3] = placeholder[target=arg0_1]
    %arg1_1 : [num_users=0] = placeholder[target=arg1_1]
    %arg2_1 : [num_users=1] = placeholder[target=arg2_1]
    %arg3_1 : [num_users=2] = placeholder[target=arg3_1]
    %arg4_1 : [num_users=0] = placeholder[target=arg4_1]
    %ce_bind_default : [num_users=0] = call_function[target=torch.ops.magi.ce_bind.default](args = ([%arg0_1, %arg3_1], [2, 2], [0, 0], [tok.weight, lin.weight], [, ]), kwargs = {})
    %all_gather_into_tensor_1 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg0_1, 2, 0), kwargs = {})
    %wait_tensor_1 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_1,), kwargs = {})
    %embedding : [num_users=1] = call_function[target=torch.ops.aten.embedding.default](args = (%wait_tensor_1, %arg2_1), kwargs = {})
    %all_gather_into_tensor_2 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg3_1, 2, 0), kwargs = {})
    %wait_tensor_2 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_2,), kwargs = {})
    %permute : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_2, [1, 0]), kwargs = {})
    %view : [num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%embedding, [6, 8]), kwargs = {})
    %mm : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%view, %permute), kwargs = {})
    %all_gather_into_tensor_3 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%arg0_1, 2, 0), kwargs = {})
    %wait_tensor_3 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_3,), kwargs = {})
    %permute_1 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_3, [1, 0]), kwargs = {})
    %mm_1 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%mm, %permute_1), kwargs = {})
    %view_3 : [num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm_1, [2, 3, 16]), kwargs = {})
    return (view_3,)""")
        rows = report.graphs[-1].bound[0]["rows"]
        self.assertIn("tied LM head", rows["reason"])


class GoldenTrainingTest(GoldenTest):
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
graph():
    %primals_1 : [num_users=3] = placeholder[target=primals_1]
    %primals_2 : [num_users=1] = placeholder[target=primals_2]
    %primals_3 : [num_users=2] = placeholder[target=primals_3]
    %primals_4 : [num_users=3] = placeholder[target=primals_4]
    %primals_5 : [num_users=0] = placeholder[target=primals_5]
    %ce_stage_default : [num_users=0] = call_function[target=torch.ops.magi.ce_stage.default](args = ([%primals_1, %primals_4], [bfloat16, bfloat16], [2, 2], [0, 0], [0.weight, 1.weight], [, ], True), kwargs = {})
    %ce_staged_default : [num_users=2] = call_function[target=torch.ops.magi.ce_staged.default](args = ([%primals_1, %primals_4], [bfloat16, bfloat16], [0, 0]), kwargs = {})
    %getitem : [num_users=1] = call_function[target=operator.getitem](args = (%ce_staged_default, 0), kwargs = {})
    %getitem_1 : [num_users=1] = call_function[target=operator.getitem](args = (%ce_staged_default, 1), kwargs = {})
    %all_gather_into_tensor : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%getitem, 2, 0), kwargs = {})
    %wait_tensor : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor,), kwargs = {})
    %permute : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor, [1, 0]), kwargs = {})
    %mm : [num_users=2] = call_function[target=torch.ops.aten.mm.default](args = (%primals_3, %permute), kwargs = {})
    %all_gather_into_tensor_1 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%getitem_1, 2, 0), kwargs = {})
    %wait_tensor_1 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_1,), kwargs = {})
    %permute_1 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_1, [1, 0]), kwargs = {})
    %mm_1 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%mm, %permute_1), kwargs = {})
    return (mm_1, primals_1, primals_3, primals_4, mm, primals_2)""")
        self.assertExpectedInline(bw, """\
graph():
    %primals_1 : [num_users=0] = placeholder[target=primals_1]
    %primals_3 : [num_users=1] = placeholder[target=primals_3]
    %primals_4 : [num_users=2] = placeholder[target=primals_4]
    %mm : [num_users=1] = placeholder[target=mm]
    %primals_2 : [num_users=1] = placeholder[target=primals_2]
    %tangents_1 : [num_users=2] = placeholder[target=tangents_1]
    %ce_stage_default : [num_users=0] = call_function[target=torch.ops.magi.ce_stage.default](args = ([%primals_4], [bfloat16], [2], [0], [1.weight], [], False), kwargs = {})
    %ce_staged_default : [num_users=1] = call_function[target=torch.ops.magi.ce_staged.default](args = ([%primals_4], [bfloat16], [0]), kwargs = {})
    %getitem_3 : [num_users=1] = call_function[target=operator.getitem](args = (%ce_staged_default, 0), kwargs = {})
    %permute_2 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%tangents_1, [1, 0]), kwargs = {})
    %mm_2 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%permute_2, %mm), kwargs = {})
    %all_gather_into_tensor_1 : [num_users=1] = call_function[target=torch.ops.magi.ce_all_gather.default](args = (%getitem_3, 2, 0), kwargs = {})
    %wait_tensor_1 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_gather_into_tensor_1,), kwargs = {})
    %permute_1 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%wait_tensor_1, [1, 0]), kwargs = {})
    %permute_4 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%permute_1, [1, 0]), kwargs = {})
    %mm_3 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%tangents_1, %permute_4), kwargs = {})
    %convert_element_type_10 : [num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mm_2, torch.float32), kwargs = {})
    %split : [num_users=1] = call_function[target=torch.ops.aten.split.Tensor](args = (%convert_element_type_10, 4), kwargs = {})
    %getitem : [num_users=1] = call_function[target=operator.getitem](args = (%split, 0), kwargs = {})
    %permute_6 : [num_users=1] = call_function[target=torch.ops.aten.permute.default](args = (%mm_3, [1, 0]), kwargs = {})
    %mm_4 : [num_users=1] = call_function[target=torch.ops.aten.mm.default](args = (%permute_6, %primals_3), kwargs = {})
    %convert_element_type_13 : [num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mm_4, torch.float32), kwargs = {})
    %split_1 : [num_users=1] = call_function[target=torch.ops.aten.split.Tensor](args = (%convert_element_type_13, 8), kwargs = {})
    %getitem_2 : [num_users=1] = call_function[target=operator.getitem](args = (%split_1, 0), kwargs = {})
    return (getitem_2, primals_2, None, getitem, primals_2)""")


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
