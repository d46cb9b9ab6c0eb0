"""The refusal matrix under plain torch.compile: every gather torch_ce must NOT move to the
copy engine stays on the collective backend (gloo here), with the right reason, and the
compiled result equals eager exactly.

2 gloo ranks, the host transport, ``torch_ce.enable(transport="copy_engine")``. One spawned
run compiles one model whose forward holds one gather per case (plus an eligible control
weight), then a few small graphs for the cases that need their own graph (host transport
off, training, in-place weight updates) and the public bind API's refusals; the test
functions below assert on what the ranks report. A second spawned run on 4 ranks covers a
real 2-D ``[Shard(0), Shard(0)]`` placement on a (2, 2) mesh.

Each rank compiles into its own fresh Inductor cache dir with the FX graph cache off: the
uneven Shard(0) weight (eligible: padded slots) makes the post-grad graphs differ across
ranks before the passes (only the short rank pads).
"""
from __future__ import annotations

import os

import pytest
import torch

from mp_harness import run_ranks, setup_compile

TIMEOUT = 240

# Substrings of the gate's reasons, per case, in the program order of the gathers of the
# matrix model (see _Matrix.forward). "uneven" (5 + 4 rows: rank 1 pads) is bound (padded
# slots) beside the control and "shard1" (NOTE [Shard(1) reads]); "cast" is refused because
# the matrix runs with cast_slots off.
MATRIX_ORDER = ["input", "noncontig", "cast", "tiny", "act", "twice", "twice2"]
BOUND = ["ok", "shard1", "uneven"]
EXPECTED = {
    "input": ["not a parameter"],
    "noncontig": ["non-contiguous shard"],
    "cast": ["cast before gather"],
    "tiny": ["symm_min_shard_mib"],
    "act": ["not directly a graph input"],
    "twice": ["gather of a gathered tensor"],
    "twice2": ["gather of a gathered tensor"],
}
# Weights whose gathers the bind step lists (refused ones too): Fallback after the run.
# Their reasons are looked up by parameter name; the other gathers' (a graph input, an
# activation, a gathered tensor) in program order.
WEIGHT_CASES = ["noncontig", "cast", "tiny", "twice"]
OTHER_ORDER = [c for c in MATRIX_ORDER if c not in WEIGHT_CASES]




# ---------------------------------------------------------------------------------------
# Rank side (module level: spawn pickles them by name)
# ---------------------------------------------------------------------------------------


def _gather_full(w, **kw):
    """SimpleFSDP's view of a sharded weight: the full tensor."""
    from torch.distributed.tensor import Replicate

    return w.redistribute(placements=[Replicate()] * w.device_mesh.ndim, **kw).to_local()


def _collective_lines(code: str) -> list[str]:
    keys = ("magi.ce_bind", "magi.ce_all_gather", "_c10d_functional.all_gather_into_tensor")
    return [ln.strip() for ln in code.splitlines()
            if any(k in ln for k in keys) and "assert_" not in ln and not ln.lstrip().startswith("#")]


class _Matrix(torch.nn.Module):
    """One weight per refusal case, plus ``ok`` (eligible: the control)."""

    def __init__(self, mesh, rank: int, ws: int):
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        super().__init__()
        torch.manual_seed(0)  # the same full weights on every rank
        P = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.ok = P(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]))
        self.uneven = P(distribute_tensor(torch.randn(9, 8), mesh, [Shard(0)]))  # 5 + 4 rows
        self.shard1 = P(distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)]))
        # A Shard(0) parameter whose local shard is a transposed (non-contiguous) view.
        full = torch.randn(8, 8)
        local = full.chunk(ws, 0)[rank].t().contiguous().t()
        assert not local.is_contiguous()
        self.noncontig = P(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                              shape=(8, 8), stride=(8, 1)))
        self.cast = P(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]))
        self.tiny = P(distribute_tensor(torch.randn(2, 8), mesh, [Shard(0)]))  # 32 B per rank
        self.twice = P(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]))
        self.group = mesh.get_group(0)

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        out = {}
        # A gather of a plain graph input, first in program order: a launch with no producer,
        # which the reorder must still keep after the bind step.
        out["input"] = funcol.all_gather_tensor(x, 0, self.group)
        out["ok"] = x @ _gather_full(self.ok).t()
        out["uneven"] = x @ _gather_full(self.uneven).t()
        out["shard1"] = x @ _gather_full(self.shard1).t()
        out["noncontig"] = x @ _gather_full(self.noncontig).t()
        out["cast"] = x @ _gather_full(self.cast, forward_dtype=torch.bfloat16).float().t()
        out["tiny"] = x @ _gather_full(self.tiny).t()
        out["act"] = funcol.all_gather_tensor(out["ok"], 0, self.group)  # an activation
        out["twice"] = funcol.all_gather_tensor(_gather_full(self.twice), 0, self.group)
        return out


def _matrix(rank, ws, mesh):
    """The main model: one compile, every per-gather refusal at once."""
    import torch_ce
    from torch._inductor.utils import run_and_get_code
    from torch_ce import report
    from torch_ce.runtime import windows as W

    model = _Matrix(mesh, rank, ws)
    gen = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(4, 8, generator=gen) for _ in range(2)]
    with torch.no_grad():
        eager = [{k: v.clone() for k, v in model(x).items()} for x in xs]

    n_graphs = len(report.graphs)
    # 100 B floor: every shard here is >= 128 B except ``tiny`` (32 B).
    # cast_slots off: the cast case keeps its refusal (the switch; cast slots: test_uneven_host.py).
    torch_ce.enable(transport="copy_engine", symm_min_shard_mib=100 / 2**20, cast_slots=False)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        out0, codes = run_and_get_code(compiled, xs[0])
        out1 = compiled(xs[1])  # second run: the bind step is a no-op
    recs = report.graphs[n_graphs:]
    assert len(recs) == 1, f"expected one graph (no graph break), got {len(recs)}"
    rec = recs[0]
    torch_ce.config.update(cast_slots=True)
    lookup = {n: type(W.lookup(getattr(model, n)._local_tensor)).__name__
              for n in ["ok", "shard1"] + WEIGHT_CASES}
    hit = W.padded(model.uneven._local_tensor)
    lookup["uneven"] = "Slot" if isinstance(hit, tuple) else type(hit).__name__
    params = set(dict(model.named_parameters()))
    return dict(
        reasons=[r["reason"] for r in rec.refused],
        # Each weight's verdict by its parameter's name (never by position: a torch
        # release that adds or drops a gather must not move one weight's reason to
        # another); the gathers of non-parameters in program order.
        by_param={r["param"]: r["reason"] for r in rec.refused if r["param"] in params},
        others=[r["reason"] for r in rec.refused if r["param"] not in params],
        bound=sorted(b["param"] for b in rec.bound),
        exact={k: [torch.equal(out0[k], eager[0][k]), torch.equal(out1[k], eager[1][k])] for k in eager[0]},
        lookup=lookup,
        lines=_collective_lines("\n".join(codes)),
        binds=[repr(b) for b in report.binds],
    )


def _host_off(rank, ws, mesh):
    """A CPU weight with the host transport off: the CUDA transport cannot serve it."""
    import torch_ce
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch_ce import report
    from torch_ce.runtime import windows as W

    torch.manual_seed(1)
    w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]), requires_grad=False)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(200 + rank))

    def f(x):
        return x @ _gather_full(w).t()

    with torch.no_grad():
        eager = f(x)
    n_graphs = len(report.graphs)
    torch._dynamo.reset()
    torch_ce.enable(transport="copy_engine", host_transport=False, symm_min_shard_mib=0)
    try:
        with torch.no_grad():
            out, codes = run_and_get_code(torch.compile(f, fullgraph=True), x)
    finally:
        torch_ce.config.update(host_transport=True)
    recs = report.graphs[n_graphs:]
    return dict(
        reasons=[r["reason"] for g in recs for r in g.refused],
        bound=[b["name"] for g in recs for b in g.bound],
        exact=[torch.equal(out, eager)],
        lookup=type(W.lookup(w._local_tensor)).__name__,
        lines=_collective_lines("\n".join(codes)),
    )


def _training(rank, ws, mesh):
    """With ``training=False`` a graph that needs gradients keeps gloo and still trains:
    grads equal eager grads (training on CE: test_training_host.py)."""
    import torch_ce
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch_ce import report
    from torch_ce.runtime import windows as W

    torch.manual_seed(2)
    full = [torch.randn(8, 8), torch.randn(6, 8)]
    ws_c = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in full]
    ws_e = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in full]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(300 + rank))

    def f(x, a, b):
        return (x @ _gather_full(a).t()) @ _gather_full(b).t()

    eager = f(x, *ws_e)
    eager.sum().backward()
    n_graphs, n_binds = len(report.graphs), len(report.binds)
    torch._dynamo.reset()
    torch_ce.enable(transport="copy_engine", symm_min_shard_mib=0, training=False)
    try:
        out = torch.compile(f, fullgraph=True)(x, *ws_c)
        out.sum().backward()
    finally:
        torch_ce.config.update(training=True)
    recs = report.graphs[n_graphs:]
    return dict(
        reasons=[r["reason"] for g in recs for r in g.refused],
        bound=[b["name"] for g in recs for b in g.bound],
        exact=[torch.equal(out, eager)]
        + [torch.equal(c.grad.to_local(), e.grad.to_local()) for c, e in zip(ws_c, ws_e, strict=True)],
        lookup=[type(W.lookup(w._local_tensor)).__name__ for w in ws_c],
        new_binds=[repr(b) for b in report.binds[n_binds:]],
    )


def _mutation(rank, ws, mesh):
    """An inference graph that updates a weight in place keeps gloo; results stay exact."""
    import torch_ce
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch_ce import report
    from torch_ce.runtime import windows as W

    torch.manual_seed(3)
    full = torch.randn(8, 8)
    w_c = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]), requires_grad=False)
    w_e = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]), requires_grad=False)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(400 + rank))

    def f(x, w):
        w.mul_(2.0)  # the weight changes on every call
        return x @ _gather_full(w).t()

    with torch.no_grad():
        eager = [f(x, w_e) for _ in range(2)]
    n_graphs = len(report.graphs)
    torch._dynamo.reset()
    torch_ce.enable(transport="copy_engine", symm_min_shard_mib=0)
    c = torch.compile(f, fullgraph=True)
    with torch.no_grad():
        out = [c(x, w_c) for _ in range(2)]
    recs = report.graphs[n_graphs:]
    return dict(
        reasons=[r["reason"] for g in recs for r in g.refused],
        bound=[b["name"] for g in recs for b in g.bound],
        exact=[torch.equal(a, b) for a, b in zip(out, eager, strict=True)]
        + [torch.equal(w_c.to_local(), w_e.to_local())],
        lookup=type(W.lookup(w_c._local_tensor)).__name__,
    )


def _bind_api(rank, ws, mesh):
    """The public bind API's refusals for the same kinds of parameters."""
    import torch.distributed as dist
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    torch.manual_seed(4)
    mesh2 = init_device_mesh("cpu", (1, ws))
    params = {
        "shard1": distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)]),
        "uneven": distribute_tensor(torch.randn(9, 8), mesh, [Shard(0)]),
        "noncontig": DTensor.from_local(torch.randn(8, 4).t(), mesh, [Shard(0)], run_check=False,
                                        shape=(4 * ws, 8), stride=(8, 1)),
        "tiny": distribute_tensor(torch.randn(2, 8), mesh, [Shard(0)]),
    }
    res = torch_ce.bind(params, min_shard_mib=100 / 2**20)
    plain = torch.randn(4, 8)
    with torch_ce.config.patch(host_transport=False):
        res_host = torch_ce.bind([plain], group=dist.group.WORLD)
    res_nogroup = torch_ce.bind([torch.randn(4, 8)])
    skipped = dict(res.skipped)
    skipped["host_off"] = res_host.skipped.get("param0", "")
    skipped["no_group"] = res_nogroup.skipped.get("param0", "")
    # Replicate x Shard(0) (HSDP-style) binds over the shard dim's group, as compiled.
    full = torch.randn(8 * ws, 8, generator=torch.Generator().manual_seed(5))
    hsdp = distribute_tensor(full, mesh2, [Replicate(), Shard(0)])
    res_hsdp = torch_ce.bind({"hsdp": hsdp})
    gathered = torch_ce.all_gather(hsdp._local_tensor, mesh2.get_group(1))
    return dict(bound=res.bound + res_host.bound + res_nogroup.bound, skipped=skipped,
                hsdp=dict(bound=res_hsdp.bound, skipped=res_hsdp.skipped,
                          exact=bool(torch.equal(gathered, full))))


def _rank_matrix(rank, ws, cache_root):
    setup_compile(cache_root, rank)
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh

    torch_ce.config.update(cost_cache_dir=os.path.join(cache_root, "cost"))
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    try:
        # Order matters for the collectives: every rank runs the same sequence.
        for name, fn in (("matrix", _matrix), ("host_off", _host_off), ("training", _training),
                         ("mutation", _mutation), ("bind_api", _bind_api)):
            out[name] = fn(rank, ws, mesh)
    finally:
        torch_ce.disable()
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("refusals").resolve())
    return run_ranks(_rank_matrix, 2, root, timeout=TIMEOUT)


# ---------------------------------------------------------------------------------------
# The per-gather cases of the matrix model
# ---------------------------------------------------------------------------------------


def test_matrix_reasons_in_program_order(matrix):
    """Exactly the control, ``shard1`` (its re-split folded into the reads: NOTE [Shard(1)
    reads]) and the uneven weight are retargeted; every other gather is refused, in order."""
    for rank, r in enumerate(matrix):
        m = r["matrix"]
        assert m["bound"] == sorted(BOUND), (rank, m["bound"])
        assert sorted(m["by_param"]) == sorted(WEIGHT_CASES), (rank, m["by_param"])
        assert len(m["others"]) == len(OTHER_ORDER), (rank, m["others"])


@pytest.mark.parametrize("case", MATRIX_ORDER)
def test_refused_with_reason_and_exact(matrix, case):
    expected = EXPECTED[case]
    for rank, r in enumerate(matrix):
        m = r["matrix"]
        why = m["by_param"][case] if case in WEIGHT_CASES else m["others"][OTHER_ORDER.index(case)]
        want = expected[rank] if len(expected) > 1 else expected[0]
        assert want in why, f"rank {rank}, case {case}: reason {why!r} lacks {want!r}"
        out_key = "twice" if case == "twice2" else case
        assert m["exact"][out_key] == [True, True], f"rank {rank}, case {case}: compiled != eager"


@pytest.mark.parametrize("case", BOUND)
def test_eligible_control_is_bound_and_exact(matrix, case):
    for rank, r in enumerate(matrix):
        m = r["matrix"]
        assert m["lookup"][case] == "Slot", (rank, m["lookup"])
        assert m["exact"][case] == [True, True], rank


@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_refused_weights_fall_back_at_run_time(matrix, case):
    """The bind step lists refused weights too (so ranks agree) and marks them Fallback."""
    for rank, r in enumerate(matrix):
        assert r["matrix"]["lookup"][case] == "Fallback", (rank, r["matrix"]["lookup"], r["matrix"]["binds"])


def test_refused_gathers_stay_on_gloo_in_program_order(matrix):
    """The CE gathers (BOUND); every refused gather is a gloo all_gather_into_tensor;
    the bind step comes before every collective (it issues collectives itself on its first
    run); and both ranks issue the same collective sequence."""
    seqs = []
    for rank, r in enumerate(matrix):
        lines = r["matrix"]["lines"]
        kinds = ["bind" if "ce_bind" in ln else "ce" if "magi.ce_all_gather" in ln else "gloo"
                 for ln in lines]
        assert kinds[0] == "bind" and kinds.count("bind") == 1, (rank, lines)
        assert kinds.count("ce") == len(BOUND), (rank, lines)
        assert kinds.count("gloo") == len(MATRIX_ORDER), (rank, lines)
        seqs.append(kinds)
    assert seqs[0] == seqs[1], seqs


# ---------------------------------------------------------------------------------------
# Cases with a graph of their own
# ---------------------------------------------------------------------------------------


def test_cpu_weight_with_host_transport_off(matrix):
    for rank, r in enumerate(matrix):
        h = r["host_off"]
        assert h["bound"] == [] and h["reasons"], (rank, h)
        assert all("host transport off" in why for why in h["reasons"]), (rank, h["reasons"])
        assert h["exact"] == [True], rank
        assert not any("magi.ce_all_gather" in ln for ln in h["lines"]), h["lines"]
        assert h["lookup"] != "Slot", h


def test_training_graph_keeps_gloo_and_trains(matrix):
    for rank, r in enumerate(matrix):
        t = r["training"]
        assert t["bound"] == [] and t["reasons"], (rank, t)
        assert all("gradients" in why for why in t["reasons"]), (rank, t["reasons"])
        assert t["exact"] == [True, True, True], f"rank {rank}: output / grads differ from eager"
        assert t["lookup"] == ["NoneType", "NoneType"], t  # nothing bound, nothing marked
        assert all("bound=0" in b for b in t["new_binds"]), t["new_binds"]


def test_weight_mutating_graph_keeps_gloo(matrix):
    for rank, r in enumerate(matrix):
        m = r["mutation"]
        assert m["bound"] == [] and m["reasons"], (rank, m)
        assert all("mutates" in why for why in m["reasons"]), (rank, m["reasons"])
        assert m["exact"] == [True, True, True], f"rank {rank}: outputs / updated weight differ"
        assert m["lookup"] != "Slot", m


@pytest.mark.parametrize("name,want", [
    ("shard1", "not Shard(0)"),
    ("uneven", "uneven"),
    ("noncontig", "non-contiguous"),
    ("tiny", "symm_min_shard_mib"),
    ("host_off", "host transport off"),
    ("no_group", "no process group"),
])
def test_bind_api_refusals(matrix, name, want):
    # Mesh and placement verdicts (2-D meshes, size-1 dims): test_mesh_verdicts.py.
    for rank, r in enumerate(matrix):
        b = r["bind_api"]
        assert b["bound"] == [], (rank, b)
        assert want in b["skipped"].get(name, ""), (rank, name, b["skipped"])


def test_bind_api_binds_replicate_x_shard(matrix):
    """[Replicate(), Shard(0)] on a (1, 2) mesh: bound over the shard dim, gathered exactly."""
    for rank, r in enumerate(matrix):
        h = r["bind_api"]["hsdp"]
        assert h["bound"] == ["hsdp"] and not h["skipped"], (rank, h)
        assert h["exact"], (rank, h)


# ---------------------------------------------------------------------------------------
# A real 2-D placement: [Shard(0), Shard(0)] on a (2, 2) mesh, 4 ranks
# ---------------------------------------------------------------------------------------


def _rank_two_d(rank, ws, cache_root):
    setup_compile(cache_root, rank)
    import torch_ce
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch_ce import report
    from torch_ce.runtime import windows as W

    torch_ce.config.update(cost_cache_dir=os.path.join(cache_root, "cost"))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    torch.manual_seed(0)
    P = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
    w_ss = P(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0), Shard(0)]))  # two gathers
    w_rs = P(distribute_tensor(torch.randn(8, 8), mesh, [Replicate(), Shard(0)]))  # one, over "b"
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))

    def f(x):
        y = x @ _gather_full(w_ss).t()
        return y @ _gather_full(w_rs).t()

    try:
        with torch.no_grad():
            eager = f(x)
            torch_ce.enable(transport="copy_engine")
            out, codes = run_and_get_code(torch.compile(f, fullgraph=True), x)
        rec = report.graphs[-1]
        return dict(
            exact=torch.equal(out, eager),
            reasons=[r["reason"] for r in rec.refused],
            bound=len(rec.bound),
            lookup=[type(W.lookup(w._local_tensor)).__name__ for w in (w_ss, w_rs)],
            lines=_collective_lines("\n".join(codes)),
        )
    finally:
        torch_ce.disable()


@pytest.mark.slow  # default suite under 15 min on 2 cores: 4 ranks; the (2, 2) [Shard(0), Shard(0)] refusal runs in test_mesh_verdicts
def test_two_d_placement_4_ranks(tmp_path):
    res = run_ranks(_rank_two_d, 4, str(tmp_path.resolve()), timeout=TIMEOUT)
    for rank, r in enumerate(res):
        # [Shard(0), Shard(0)]: gathered over "b", then the result over "a": both refused.
        assert len(r["reasons"]) == 2, (rank, r)
        assert all("gather of a gathered tensor" in why for why in r["reasons"]), (rank, r["reasons"])
        # [Replicate(), Shard(0)] is a plain 1-D gather over "b": retargeted and bound.
        assert r["bound"] == 1 and r["lookup"] == ["Fallback", "Slot"], (rank, r)
        assert r["exact"], f"rank {rank}: compiled != eager"
    kinds = [["ce" if "magi.ce_all_gather" in ln else "bind" if "ce_bind" in ln else "gloo"
              for ln in r["lines"]] for r in res]
    assert all(k == ["bind", "gloo", "gloo", "ce"] for k in kinds), kinds
