"""Uneven Shard(0) weights and cast slots on the copy-engine path, on CPU (host transport,
3 gloo ranks), exact against the plain compiled run.

torch.chunk gives 3 ranks of a 5-row weight 2, 2 and 1 rows, and of a 2-row weight 1, 1
and none; DTensor pads the short shards before the gather and slices after it, so before
our passes the ranks' graphs differ. NOTE [uneven Shard(0): padded slots] in
torch_ce/runtime/windows.py says what the passes make of them; NOTE [cast slots] in
torch_ce/runtime/staging.py what an inference graph's cast gathers read.

- ``test_uneven_inference``: a SimpleFSDP-style model of uneven weights (one of them empty
  on the last rank, one an embedding table) is bound in place and gathered on the copy
  engines, every weight, the outputs bit-identical to the plain compiled run; the graphs
  after our passes are the same on every rank; the uneven table's lookups are row
  gathers from its padded slots.
- ``test_cast_slots_inference``: the same weights in fp32 under a bf16 ``param_dtype``:
  every gather reads a cast slot, exact; the bind record states the slots' bytes;
  ``cast_slots=False`` keeps them on the collective ("cast before gather"); an in-place
  update of a weight after its cast slot was made raises on every rank.
- ``test_uneven_training``: torchtitan's SimpleFSDP ``fully_shard`` with AdamW, uneven
  layers (an empty shard included), a few steps, losses bit-identical to the collective
  run, reshard after forward on (bf16 ``param_dtype``) and off (fp32).
"""
from __future__ import annotations

import os

import pytest
import torch

from mp_harness import collectives_in_flight, run_ranks, seed_base, setup_compile

WORLD = 3
TIMEOUT = 600  # catches hangs; 3 ranks compiling on 2 loaded cores take minutes
# No calibration (seconds of timed gathers on 3 ranks sharing 2 cores); the reference runs
# are compiled with the same settings.
ENV = {"TORCH_CE_COST_MODE": "default", "TORCH_CE_BIND_ARRIVAL_TIMEOUT_S": "240"}
PADDED_CALL = "torch.ops.magi.ce_all_gather_padded.default("
GLOO_CALL = "torch.ops._c10d_functional.all_gather_into_tensor.default("


# ---------------------------------------------------------------------------------------
# Inference (rank side: module level, spawn pickles by name)
# ---------------------------------------------------------------------------------------


class _Gather(torch.nn.Module):
    """SimpleFSDP's parametrization: the forward gathers the full weight (cast first)."""

    def __init__(self, dtype=None):
        super().__init__()
        self.dtype = dtype

    def forward(self, w):
        from torch.distributed.tensor import Replicate

        return w.redistribute(placements=[Replicate()], forward_dtype=self.dtype).to_local()


class _Uneven(torch.nn.Module):
    """Every weight uneven over 3 ranks: emb 10 rows (4, 4, 2), a 5 rows (2, 2, 1),
    b 2 rows (1, 1, 0: empty on rank 2), c 7 rows (3, 3, 1)."""

    def __init__(self, mesh, dtype=torch.float32, cast=None):
        import torch.nn.utils.parametrize as P
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        self.cast = cast
        torch.manual_seed(0)  # the same full weights on every rank
        self.emb = torch.nn.Embedding(10, 8)
        self.a = torch.nn.Linear(8, 5, bias=False)
        self.b = torch.nn.Linear(5, 2, bias=False)
        self.c = torch.nn.Linear(2, 7, bias=False)
        for m in (self.emb, self.a, self.b, self.c):
            full = m.weight.detach().to(dtype)
            m.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]), requires_grad=False)
            P.register_parametrization(m, "weight", _Gather(cast), unsafe=True)

    def forward(self, ids):
        x = self.emb(ids)
        if self.cast is not None:
            x = x.to(self.cast)
        return self.c(self.b(self.a(x))).float()


def _run(model, inputs, transport, **cfg):
    """Compile ``model`` (fresh dynamo) and run it on ``inputs``: (outputs, generated code)."""
    import torch_ce
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    if transport is None:
        torch_ce.disable()
    else:
        torch_ce.enable(transport=transport, **{"cast_slots": True, **cfg})
    try:
        compiled = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            first, code = run_and_get_code(compiled, inputs[0])
            outs = [first] + [compiled(x) for x in inputs[1:]]
        return outs, "\n".join(code)
    finally:
        torch_ce.disable()


def _ids(seed, rank):
    gen = torch.Generator().manual_seed(seed + 100 + rank)  # different data per rank
    return [torch.randint(0, 10, (3, 4), generator=gen) for _ in range(3)]


def _graph_lines(graphs) -> list[str]:
    """The post-grad graphs after our passes, without shapes (which differ by rank)."""
    return [ln.split("=", 1)[1].strip() for g in graphs for ln in str(g).splitlines()
            if "=" in ln and "placeholder" not in ln]


def _rank_inference(rank, world, seed, cache):
    setup_compile(cache, rank)
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh
    from torch_ce import report
    from torch_ce.passes import manager
    from torch_ce.runtime import windows as W

    mesh = init_device_mesh("cpu", (world,))
    inputs = _ids(seed, rank)
    model = _Uneven(mesh)
    ref, ref_code = _run(model, inputs, None)  # the plain compiled run: gloo gathers
    graphs = []
    with manager.observing(graphs.append):
        report.clear()
        ce, code = _run(model, inputs, "copy_engine")
    e = torch_ce.explain()
    lookups = {}
    for name in ("emb", "a", "b", "c"):
        hit = W.padded(getattr(model, name).parametrizations.weight.original._local_tensor)
        lookups[name] = "Slot" if isinstance(hit, tuple) else type(hit).__name__
    rec = report.graphs[-1]
    return dict(
        exact=[torch.equal(a, b) for a, b in zip(ce, ref, strict=True)],
        ref_in_flight=collectives_in_flight(ref_code),
        ref_gloo_calls=ref_code.count(GLOO_CALL),
        shards=[tuple(getattr(model, n).parametrizations.weight.original._local_tensor.shape)
                for n in ("emb", "a", "b", "c")],
        padded_calls=code.count(PADDED_CALL),
        rows_calls=code.count("torch.ops.magi.ce_gather_rows.default("),
        gloo_calls=code.count(GLOO_CALL),
        bound=sorted(b["param"] for b in rec.bound),
        refused=[r["reason"] for r in rec.refused],
        rows=[(b["param"], b["rows"]["reason"]) for b in rec.bound if b.get("rows")],
        explained=sorted((w.param, w.status) for w in e.weights),
        skipped=[why for b in report.binds for why in b.skipped.values()],
        lookups=lookups,
        graph=_graph_lines(graphs),
    )


def _rank_both(rank, world, seed, cache):
    """One spawn for both inference tests (3 ranks' start-up is paid once)."""
    import torch_ce

    out = dict(inference=_rank_inference(rank, world, seed, cache))
    torch_ce.release_all()
    out["cast"] = _rank_cast(rank, world, seed, cache)
    return out


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("uneven_inf").resolve())
    return run_ranks(_rank_both, WORLD, seed_base(), root, timeout=TIMEOUT, env=ENV)


@pytest.fixture(scope="module")
def inference(both):
    return [r["inference"] for r in both]


@pytest.fixture(scope="module")
def cast(both):
    return [r["cast"] for r in both]


def test_uneven_inference(inference):
    for rank, r in enumerate(inference):
        assert r["exact"] == [True] * 3, f"rank {rank}: compiled CE != plain compiled: {r['exact']}"
        # The reference gathered every weight on gloo, one at a time (NOTE [one gloo
        # collective in flight in the references] in mp_harness.py).
        assert r["ref_gloo_calls"] == 4 and r["ref_in_flight"] == 1, (rank, r["ref_gloo_calls"], r["ref_in_flight"])
        assert r["refused"] == [] and r["skipped"] == [], (rank, r["refused"], r["skipped"])
        assert r["bound"] == ["a.weight", "b.weight", "c.weight", "emb.weight"], (rank, r["bound"])
        assert r["lookups"] == dict(emb="Slot", a="Slot", b="Slot", c="Slot"), (rank, r["lookups"])
        assert r["gloo_calls"] == 0, f"rank {rank}: a gather stayed on gloo"
        assert r["padded_calls"] == 3, f"rank {rank}: {r['padded_calls']} padded gathers"
        assert all(st == "bound" for _, st in r["explained"]), (rank, r["explained"])
        # The uneven table: its lookups read just their rows, from the padded slots.
        assert r["rows"] == [("emb.weight", "")] and r["rows_calls"] == 1, (rank, r["rows"], r["rows_calls"])
    assert inference[2]["shards"][2] == (0, 5), "rank 2's shard of b should be empty"
    assert inference[0]["graph"] == inference[1]["graph"] == inference[2]["graph"], \
        "the graphs after the passes differ across ranks"


# ---------------------------------------------------------------------------------------
# Cast slots
# ---------------------------------------------------------------------------------------


def _rank_cast(rank, world, seed, cache):
    setup_compile(cache, rank)
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh
    from torch_ce import report

    mesh = init_device_mesh("cpu", (world,))
    inputs = _ids(seed, rank)
    model = _Uneven(mesh, torch.float32, cast=torch.bfloat16)
    model.emb.parametrizations.weight[0].dtype = None  # the lookup table stays fp32
    ref, _ = _run(model, inputs, None)
    report.clear()
    off, off_code = _run(model, inputs, "copy_engine", cast_slots=False)
    off_refused = [r["reason"] for g in report.graphs for r in g.refused]
    torch_ce.release_all()
    report.clear()
    ce, code = _run(model, inputs, "copy_engine")
    rec = report.graphs[-1]
    table = torch_ce.explain().table()
    cast_bytes = sum(b.cast_slot_bytes for b in report.binds)
    # An in-place update of a weight whose cast slot was made: every rank raises.
    torch._dynamo.reset()
    torch_ce.enable(transport="copy_engine", cast_slots=True)
    err = ""
    try:
        compiled = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            compiled(inputs[0])
            model.a.parametrizations.weight.original._local_tensor.mul_(2.0)
            compiled(inputs[1])
    except RuntimeError as ex:
        err = str(ex)
    finally:
        torch_ce.disable()
    return dict(
        exact=[torch.equal(a, b) for a, b in zip(ce, ref, strict=True)],
        off_exact=[torch.equal(a, b) for a, b in zip(off, ref, strict=True)],
        off_refused=off_refused, off_padded=off_code.count(PADDED_CALL),
        refused=[r["reason"] for r in rec.refused],
        cast=sorted((b["param"], b.get("cast_slot")) for b in rec.bound),
        padded_calls=code.count(PADDED_CALL), gloo_calls=code.count(GLOO_CALL),
        cast_bytes=cast_bytes, table=table, err=err,
    )


def test_cast_slots_inference(cast):
    # bf16 slots of a (2 rows x 8), b (1 x 5), c (3 x 2): ceil rows on every rank.
    want = 2 * (2 * 8 + 1 * 5 + 3 * 2)
    for rank, r in enumerate(cast):
        assert r["exact"] == [True] * 3, f"rank {rank}: cast slots != plain compiled: {r['exact']}"
        assert r["refused"] == [], (rank, r["refused"])
        assert r["cast"] == [("a.weight", "bfloat16"), ("b.weight", "bfloat16"),
                             ("c.weight", "bfloat16"), ("emb.weight", None)], (rank, r["cast"])
        assert r["gloo_calls"] == 0 and r["padded_calls"] == 3, (rank, r["gloo_calls"], r["padded_calls"])
        assert r["cast_bytes"] == want, (rank, r["cast_bytes"], want)
        assert f"cast slots {want:,d} B" in r["table"], r["table"]
        # The switch: off, the casts stay on gloo (and the uneven table is still bound).
        assert r["off_exact"] == [True] * 3, rank
        assert len(r["off_refused"]) == 3 and all("cast before gather" in w for w in r["off_refused"]), \
            (rank, r["off_refused"])
        assert r["off_padded"] == 0, (rank, r["off_padded"])  # the table: a row gather
        assert "a.weight changed in place outside torch_ce.updating_weights" in r["err"], (rank, r["err"])


# ---------------------------------------------------------------------------------------
# Training: torchtitan's SimpleFSDP, AdamW
# ---------------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=True)  # 14 rows: 5, 5, 4 (bias too)
        self.down = torch.nn.Linear(hidden, dim, bias=False)  # 10 rows: 4, 4, 2

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Net(torch.nn.Module):
    def __init__(self, dim: int = 10, hidden: int = 14):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(dim, hidden) for _ in range(2))
        self.head = torch.nn.Linear(dim, 2, bias=False)  # 2 rows: 1, 1, 0 (empty on rank 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(transport, seed, param_dtype, batches, reshard):
    import torch_ce
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.experiments.graph_trainer import simple_fsdp

    torch._dynamo.reset()
    torch.manual_seed(seed)
    simple_fsdp._wrap_class_cache.clear()
    policy = simple_fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    model = simple_fsdp.data_parallel(_Net(), init_device_mesh("cpu", (WORLD,)), mode="fully_shard",
                                      mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch_ce.enable(transport=transport, reshard_after_forward=reshard)
    try:
        compiled = torch.compile(model, fullgraph=True)
        losses, code = [], []
        for i, x in enumerate(batches):
            def step():
                loss = compiled(x).float().pow(2).mean()
                loss.backward()
                return loss

            if i == 0:
                loss, code = run_and_get_code(step)
            else:
                loss = step()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        shards = [tuple(p._local_tensor.shape) for p in model.parameters()]
        return losses, code, shards
    finally:
        torch_ce.disable()


def _rank_train(rank, world, seed, cache, reshard, dtype_name):
    setup_compile(cache, rank)
    from torch_ce import report

    pd = {"fp32": None, "bf16": torch.bfloat16}[dtype_name]
    gen = torch.Generator().manual_seed(seed + 100 + rank)
    batches = [torch.randn(3, 5, 10, generator=gen).to(pd or torch.float32) for _ in range(4)]
    ref, ref_code, _ = _train("nccl", seed, pd, batches, reshard)
    report.clear()
    ce, code, shards = _train("copy_engine", seed, pd, batches, reshard)
    return dict(
        ref=ref, ce=ce, shards=shards,
        padded=[c.count(PADDED_CALL) for c in code],
        refused=[r["reason"] for g in report.graphs for r in g.refused],
        skipped=[why for b in report.binds for why in b.skipped.values()],
    )


# Slow-marked (~3 compiles of a forward and a backward per rank on 3 ranks): the default
# suite trains uneven shards on 3 ranks in the zoo matrix's default case
# (test/test_zoo_matrix.py, bf16, reshard on).
@pytest.mark.slow
@pytest.mark.parametrize("reshard,dtype_name", [(True, "bf16"), (False, "fp32")])
def test_uneven_training(tmp_path, reshard, dtype_name):
    pytest.importorskip("torchtitan")  # its modules then import, or the test fails loudly
    res = run_ranks(_rank_train, WORLD, seed_base(), str(tmp_path), reshard, dtype_name,
                    timeout=TIMEOUT, env=ENV)
    for rank, r in enumerate(res):
        what = f"rank {rank} (reshard={reshard}, {dtype_name})"
        assert r["ce"] == r["ref"], f"{what}: losses differ\nref {r['ref']}\nce  {r['ce']}"
        assert len(set(r["ce"])) > 2, f"{what}: the loss does not change"
        assert r["refused"] == [] and r["skipped"] == [], (what, r["refused"], r["skipped"])
        # Forward: every weight (5 per block + head); backward: the recomputed gathers.
        assert r["padded"][0] == 7, (what, r["padded"])
        if reshard:
            assert r["padded"][-1] > 0, (what, r["padded"])
    assert (0, 10) in res[2]["shards"], "the head's shard on rank 2 should be empty"


def test_padded_op_opcheck_and_fake_shape():
    """The padded op's schema, fake impl and autograd registration (group of one: no
    binding, no process group); the fake output has the padded shape whatever the shard."""
    from torch.library import opcheck

    import torch_ce  # noqa: F401  (registers the ops)

    op = torch.ops.magi.ce_all_gather_padded.default
    for shard in (torch.randn(2, 3), torch.randn(0, 3), torch.randn(3, 3)):
        opcheck(op, (shard, 3, 1, "0"))
        out = op(shard, 3, 1, "0")
        assert out.shape == (3, 3) and torch.equal(out[: shard.shape[0]], shard)
        assert not out[shard.shape[0]:].any()  # the padding is zeros
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert op(torch.empty(0, 5), 4, 3, "0").shape == (12, 5)
