"""The refusal matrix on TORCH_CE_GPU_WORLD GPUs (default 2): CUDA bf16 weights, NCCL, ``transport="copy_engine"``.

The same cases as test_refusals.py (CPU, gloo), in one spawned NCCL run: one compiled
model holds one gather per refusal case plus an eligible control weight; then a CPU model
with the host transport off while the process has GPUs (its gathers go through a gloo
subgroup), a training graph and a weight-mutating graph. Each refused gather stays on
the collective backend with the right reason, and compiled results equal eager exactly
(training gradients: to within float rounding). The refusal counts are printed (-s).

Skipped with fewer CUDA GPUs. Written for torch 2.11 and 2.13.
"""
from __future__ import annotations

import collections
import os
import warnings

import pytest
import torch

from cuda_helpers import GPU_WORLD, needs_gpu_world
from mp_harness import run_ranks
from test_refusals import _gather_full as _full, _host_off

pytestmark = needs_gpu_world

D = 16  # bf16: 16 / world x 16 x 2 B per rank for the normal weights; ``tiny`` 32 B
FLOOR_MIB = 100 / 2**20  # 100 B: refuses ``tiny`` only
# ``uneven`` (D + 1 rows) is bound beside ``ok`` and ``shard1`` (padded slots; NOTE [Shard(1)
# reads]); ``cast`` stays refused: the matrix compiles with cast_slots off.
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
WEIGHT_CASES = ["noncontig", "cast", "tiny", "twice"]


def _kinds(code: str) -> list[str]:
    """The collective calls of generated code, in order: bind / ce / coll."""
    out = []
    for ln in code.splitlines():
        s = ln.strip()
        if s.startswith("#") or "assert_" in s:
            continue
        if "magi.ce_bind" in s:
            out.append("bind")
        elif "magi.ce_all_gather" in s:
            out.append("ce")
        elif "_c10d_functional.all_gather_into_tensor" in s and "(" in s:
            out.append("coll")
    return out


def _max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


class _Matrix(torch.nn.Module):
    def __init__(self, mesh, rank, ws, dev, dtype):
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        super().__init__()
        torch.manual_seed(0)
        mk = lambda *s: torch.randn(*s).to(device=dev, dtype=dtype)  # noqa: E731
        P = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.ok = P(distribute_tensor(mk(D, D), mesh, [Shard(0)]))
        self.uneven = P(distribute_tensor(mk(D + 1, D), mesh, [Shard(0)]))
        self.shard1 = P(distribute_tensor(mk(D, D), mesh, [Shard(1)]))
        local = mk(D, D).chunk(ws, 0)[rank].t().contiguous().t()
        self.noncontig = P(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                              shape=(D, D), stride=(D, 1)))
        self.cast = P(distribute_tensor(mk(D, D), mesh, [Shard(0)]))
        self.tiny = P(distribute_tensor(mk(ws, D), mesh, [Shard(0)]))  # one row per rank
        self.twice = P(distribute_tensor(mk(D, D), mesh, [Shard(0)]))
        self.group = mesh.get_group(0)

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        out = {}
        out["input"] = funcol.all_gather_tensor(x, 0, self.group)
        out["ok"] = x @ _full(self.ok).t()
        out["uneven"] = x @ _full(self.uneven).t()
        out["shard1"] = x @ _full(self.shard1).t()
        out["noncontig"] = x @ _full(self.noncontig).t()
        out["cast"] = x.float() @ _full(self.cast, forward_dtype=torch.float32).t()  # lossless upcast
        out["tiny"] = x @ _full(self.tiny).t()
        out["act"] = funcol.all_gather_tensor(out["ok"], 0, self.group)
        out["twice"] = funcol.all_gather_tensor(_full(self.twice), 0, self.group)
        return out


def _matrix(rank, ws, dev, dtype):
    import torch_ce
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh
    from torch_ce import report
    from torch_ce.runtime import windows as W

    mesh = init_device_mesh(dev.type, (ws,))
    model = _Matrix(mesh, rank, ws, dev, dtype)
    gen = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(4, D, generator=gen).to(device=dev, dtype=dtype) for _ in range(2)]
    with torch.no_grad():
        eager = [{k: v.clone() for k, v in model(x).items()} for x in xs]
    n = len(report.graphs)
    torch._dynamo.reset()
    torch_ce.enable(transport="copy_engine", symm_min_shard_mib=FLOOR_MIB, cast_slots=False)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        out0, codes = run_and_get_code(compiled, xs[0])
        out1 = compiled(xs[1])
    if dev.type == "cuda":
        torch.cuda.synchronize()
    recs = report.graphs[n:]
    return dict(
        graphs=len(recs),
        reasons=[r["reason"] for g in recs for r in g.refused],
        bound=[b["name"] for g in recs for b in g.bound],
        exact={k: [torch.equal(out0[k], eager[0][k]), torch.equal(out1[k], eager[1][k])] for k in eager[0]},
        max_diff={k: _max_diff(out0[k], eager[0][k]) for k in eager[0]},
        lookup={c: type(W.lookup(getattr(model, c)._local_tensor)).__name__ for c in ["ok", "shard1"] + WEIGHT_CASES}
        | {"uneven": "Slot" if isinstance(W.padded(model.uneven._local_tensor), tuple) else "not bound"},
        kinds=_kinds("\n".join(codes)),
    )


def _cpu_model_host_off(rank, ws):
    """CPU weights with the host transport off, in a process that has GPUs: refused. The
    CPU test's case (test_refusals._host_off), over a gloo subgroup."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    res = _host_off(rank, ws, DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu"))
    res["kinds"] = _kinds("\n".join(res["lines"]))
    return res


def _training(rank, ws, dev):
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch_ce import report

    mesh = init_device_mesh(dev.type, (ws,))
    torch.manual_seed(2)
    full = [torch.randn(D, D, device=dev), torch.randn(D - ws, D, device=dev)]  # fp32, even
    ws_c = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in full]
    ws_e = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in full]
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(300 + rank)).to(dev)

    def f(x, a, b):
        return (x @ _full(a).t()) @ _full(b).t()

    eager = f(x, *ws_e)
    eager.sum().backward()
    n, nb = len(report.graphs), len(report.binds)
    torch._dynamo.reset()
    torch_ce.enable(transport="copy_engine", symm_min_shard_mib=0)
    out = torch.compile(f, fullgraph=True)(x, *ws_c)
    out.sum().backward()
    grads = [(c.grad.to_local(), e.grad.to_local()) for c, e in zip(ws_c, ws_e, strict=True)]
    recs = report.graphs[n:]
    return dict(
        reasons=[r["reason"] for g in recs for r in g.refused],
        bound=[b["name"] for g in recs for b in g.bound],
        out_exact=torch.equal(out, eager),
        out_close=torch.allclose(out, eager, rtol=1e-5, atol=1e-5),
        grads_exact=[torch.equal(c, e) for c, e in grads],
        grads_close=[torch.allclose(c, e, rtol=1e-5, atol=1e-5) for c, e in grads],
        grad_diff=[_max_diff(c, e) for c, e in grads],
        new_bound=sum(len(b.bound) for b in report.binds[nb:]),
    )


def _mutation(rank, ws, dev, dtype):
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch_ce import report
    from torch_ce.runtime import windows as W

    mesh = init_device_mesh(dev.type, (ws,))
    torch.manual_seed(3)
    full = torch.randn(D, D).to(device=dev, dtype=dtype)
    w_c = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]), requires_grad=False)
    w_e = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]), requires_grad=False)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(400 + rank)).to(device=dev, dtype=dtype)

    def f(x, w):
        w.mul_(2.0)
        return x @ _full(w).t()

    with torch.no_grad():
        eager = [f(x, w_e) for _ in range(2)]
    n = len(report.graphs)
    torch._dynamo.reset()
    torch_ce.enable(transport="copy_engine", symm_min_shard_mib=0)
    c = torch.compile(f, fullgraph=True)
    with torch.no_grad():
        out = [c(x, w_c) for _ in range(2)]
    recs = report.graphs[n:]
    return dict(
        reasons=[r["reason"] for g in recs for r in g.refused],
        bound=[b["name"] for g in recs for b in g.bound],
        exact=[torch.equal(a, b) for a, b in zip(out, eager, strict=True)] + [torch.equal(w_c.to_local(), w_e.to_local())],
        lookup=type(W.lookup(w_c._local_tensor)).__name__,
    )


def _rank_cuda_matrix(rank, ws, cache_root, device_type="cuda"):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, f"inductor_rank{rank}")
    import torch._inductor.config as ic
    import torch_ce

    ic.fx_graph_cache = False  # uneven shards: the graphs differ across ranks
    ic.compile_threads = 1
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch_ce.config.update(cost_cache_dir=os.path.join(cache_root, "cost"))
    if device_type == "cuda":
        dev, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    else:  # a CPU dry run of this file's logic (gloo)
        dev, dtype = torch.device("cpu"), torch.bfloat16
    out = {}
    try:
        out["matrix"] = _matrix(rank, ws, dev, dtype)
        out["host_off"] = _cpu_model_host_off(rank, ws)
        out["training"] = _training(rank, ws, dev)
        out["mutation"] = _mutation(rank, ws, dev, dtype)
    finally:
        torch_ce.disable()
    return out


@pytest.fixture(scope="module")
def cuda_matrix(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("refusals_cuda").resolve())
    res = run_ranks(_rank_cuda_matrix, GPU_WORLD, root, timeout=420, backend="nccl")
    for rank, r in enumerate(res):
        counts = collections.Counter(r["matrix"]["reasons"] + r["host_off"]["reasons"]
                                     + r["training"]["reasons"] + r["mutation"]["reasons"])
        print(f"\n[refusals cuda] rank {rank}: {sum(counts.values())} refused gathers, "
              f"{len(r['matrix']['bound'])} retargeted")
        for why, n in sorted(counts.items()):
            print(f"  {n:2d}  {why}")
    return res


def test_cuda_matrix_reasons_and_exact(cuda_matrix):
    for rank, r in enumerate(cuda_matrix):
        m = r["matrix"]
        assert m["graphs"] == 1, (rank, m["graphs"])
        assert len(m["bound"]) == len(BOUND) and len(m["reasons"]) == len(MATRIX_ORDER), \
            (rank, m["bound"], m["reasons"])
        for i, case in enumerate(MATRIX_ORDER):
            assert EXPECTED[case][0] in m["reasons"][i], (rank, case, m["reasons"][i])
        bad = {k: (v, m["max_diff"][k]) for k, v in m["exact"].items() if v != [True, True]}
        assert not bad, f"rank {rank}: compiled != eager: {bad}"


def test_cuda_matrix_bind_and_fallback(cuda_matrix):
    for rank, r in enumerate(cuda_matrix):
        lk = r["matrix"]["lookup"]
        assert lk["ok"] == lk["shard1"] == lk["uneven"] == "Slot", (rank, lk)  # NOTE [Shard(1) reads]
        assert all(lk[c] == "Fallback" for c in WEIGHT_CASES), (rank, lk)
        k = r["matrix"]["kinds"]
        assert k[0] == "bind" and k.count("bind") == 1 and k.count("ce") == len(BOUND), (rank, k)
        assert k.count("coll") == len(MATRIX_ORDER), (rank, k)
    assert all(r["matrix"]["kinds"] == cuda_matrix[0]["matrix"]["kinds"] for r in cuda_matrix)


def test_cpu_model_with_host_transport_off_on_a_gpu_machine(cuda_matrix):
    for rank, r in enumerate(cuda_matrix):
        h = r["host_off"]
        assert h["bound"] == [] and h["reasons"], (rank, h)
        assert all("host transport off" in w for w in h["reasons"]), (rank, h)
        assert h["exact"] == [True] and h["lookup"] != "Slot" and "ce" not in h["kinds"], (rank, h)


def test_cuda_training_graph_keeps_nccl(cuda_matrix):
    for rank, r in enumerate(cuda_matrix):
        t = r["training"]
        assert t["bound"] == [] and t["reasons"] and t["new_bound"] == 0, (rank, t)
        assert all("gradients" in w for w in t["reasons"]), (rank, t["reasons"])
        assert t["out_close"] and all(t["grads_close"]), (rank, t)
        print(f"[refusals cuda] rank {rank} training: output exact {t['out_exact']}, "
              f"grads exact {t['grads_exact']}, max grad diff {t['grad_diff']}")


def test_cuda_weight_mutating_graph_keeps_nccl(cuda_matrix):
    for rank, r in enumerate(cuda_matrix):
        m = r["mutation"]
        assert m["bound"] == [] and m["reasons"], (rank, m)
        assert all("mutates" in w for w in m["reasons"]), (rank, m["reasons"])
        assert m["exact"] == [True, True, True] and m["lookup"] != "Slot", (rank, m)
