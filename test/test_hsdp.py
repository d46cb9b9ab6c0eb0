"""HSDP (torchtitan SimpleFSDP ``hybrid_shard``) on CPU gloo ranks, with ONE Inductor cache
dir shared by every rank, as PyTorch's default is.

On a (2, 2) mesh each host's shard group has its own process-group name, and an uneven
weight has another local shape on each rank; AOTAutograd's cache key holds neither, so a
warm shared cache served one rank another's code, with or without torch_ce (NOTE [a cache
shared by ranks] in torch_ce/passes/identity.py). Here every rank compiles three models
twice into the same dir, cold and then warm in fresh processes: an even HSDP model, one
with an uneven weight, and a 1-D fully_shard model over all ranks. Each run must use the
magi ops, match eager on fresh data, bind into windows of its shard group only, and the
warm run must be served from the cache (which cache depends on torch: ``AOT_CACHE_TAKES_DTENSOR``).
The AOTAutograd keys show the sharing: equal within a shard group (even HSDP), equal on
all ranks (1-D), all distinct (uneven).

The 8-rank cases (a (2, 4) HSDP mesh and an 8-rank fully_shard mesh) share one spawn and
one compile of a tiny model: ~35 s on 2 cores, so they run by default.
"""
from __future__ import annotations

import random
import re

import pytest
import torch

pytest.importorskip("torchtitan")  # its modules then import, or the file fails loudly

from mp_harness import count_gathers, run_ranks, setup_compile  # noqa: E402
from test_torchtitan import TinyDecoder  # noqa: E402

TIMEOUT = 300
CE_CALL = re.compile(r"= torch\.ops\.magi\.ce_all_gather(_coalesced|_padded)?\.default\(")
DIMS = ("dp_replicate", "dp_shard")


def _aot_cache_takes_dtensor() -> bool:
    """The torch fact the warm-run test relies on, checked on this torch.

    Torch 2.11 (2.11.0+cu130, seen on the GPU machine): Dynamo records ``redistribute`` as
    a call of a local closure (``TensorVariable.method_redistribute``'s
    ``prim_redistribute``), which AOTAutograd's cache refuses ("Bypassing autograd cache
    due to: Unsupported call_function target ... prim_redistribute"): every DTensor graph
    bypasses it, and the FX graph cache serves the warm run (keyed on the AOT output graph,
    which names each rank's groups and local shapes). Torch 2.13 (CI) has no such closure:
    AOTAutograd's cache serves the warm run, keyed by torch_ce's identity (NOTE [a cache
    shared by ranks] in torch_ce/passes/identity.py)."""
    from torch._dynamo.variables.tensor import TensorVariable

    return not hasattr(TensorVariable, "method_redistribute")


AOT_CACHE_TAKES_DTENSOR = _aot_cache_takes_dtensor()


def _build(mesh, mode, out=8, seed=0):
    """A tiny decoder wrapped by torchtitan's SimpleFSDP (the same weights on every rank);
    ``out`` odd makes the head weight uneven over a shard group of 2."""
    from torchtitan.experiments.graph_trainer import simple_fsdp

    simple_fsdp._wrap_class_cache.clear()  # its wrapper class closes over the first mesh
    torch.manual_seed(seed)
    model = TinyDecoder(dim=16, hidden=32, layers=1, out=out).eval()
    return simple_fsdp.data_parallel(model, mesh, mode=mode)


def _spy_keys():
    """Record the AOTAutograd cache key of every graph compiled (None if torch moved it)."""
    try:
        from torch._functorch._aot_autograd import autograd_cache as ac
    except ImportError:
        return None
    keys, real = [], ac.autograd_cache_key

    def spy(*a, **k):
        key, lines = real(*a, **k)
        keys.append(key)
        return key, lines

    ac.autograd_cache_key = spy
    return keys


def _run_model(model, rank, seed, keys):
    """Compile and run ``model`` on fresh data; what the test asserts on."""
    import torch_ce
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code
    from torch_ce.runtime import windows as W

    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed + rank))
    with torch.no_grad():
        eager = model(x)
    counters.clear()
    n_keys = len(keys) if keys is not None else 0
    torch_ce.enable(transport="copy_engine")
    try:
        with torch.no_grad():
            out, codes = run_and_get_code(torch.compile(model, fullgraph=True), x)
    finally:
        torch_ce.disable()
    slots = {}
    for name, p in model.named_parameters():
        e = W.lookup(p._local_tensor)
        hit = W.padded(p._local_tensor)  # an uneven weight: its padded slot
        if isinstance(hit, tuple):
            e = hit[0]
        slots[name] = (type(e).__name__, e.window.group_ranks if isinstance(e, W.Slot) else None)
    return dict(
        exact=torch.equal(out, eager), max_diff=float((out - eager).abs().max()),
        ce_calls=len(CE_CALL.findall("\n".join(codes))), slots=slots,
        aot={k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
        fx={k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
        key=keys[n_keys] if keys is not None and len(keys) > n_keys else None,
        shapes={n: tuple(p._local_tensor.shape) for n, p in model.named_parameters()},
    )


def _rank_shared_cache(rank, ws, seed, cache_root, shared_dir):
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch_ce import report

    setup_compile(cache_root, rank, fx_cache=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = shared_dir  # ONE dir for every rank
    counts = count_gathers()
    keys = _spy_keys()
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS)
    mesh1 = init_device_mesh("cpu", (ws,))
    out = {}
    for name, mesh, mode, rows in (("even", mesh2, "hybrid_shard", 8), ("uneven", mesh2, "hybrid_shard", 9),
                                   ("fsdp", mesh1, "fully_shard", 8)):
        before = counts["torch"]
        out[name] = _run_model(_build(mesh, mode, out=rows), rank, seed, keys)
        out[name]["host_gathers"] = counts["torch"] - before
    shard_pg = mesh2.get_group("dp_shard")
    out["shard_ranks"] = tuple(dist.get_process_group_ranks(shard_pg))
    out["mesh_dim"] = report.mesh_dims.get(shard_pg.group_name)
    return out


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    seed = random.randrange(1 << 20)
    root = tmp_path_factory.mktemp("hsdp")
    shared_dir = str((root / "inductor_shared").resolve())
    cold = run_ranks(_rank_shared_cache, 4, seed, str(root.resolve()), shared_dir, timeout=TIMEOUT)
    warm = run_ranks(_rank_shared_cache, 4, seed + 7, str(root.resolve()), shared_dir, timeout=TIMEOUT)
    return dict(cold=cold, warm=warm)


@pytest.mark.parametrize("phase", ["cold", "warm"])
@pytest.mark.parametrize("model", ["even", "uneven", "fsdp"])
def test_shared_cache_every_rank_runs_ce_and_matches_eager(shared, phase, model):
    for rank, r in enumerate(shared[phase]):
        m = r[model]
        assert m["exact"], f"{phase} rank {rank} {model}: compiled != eager (max diff {m['max_diff']})"
        assert m["ce_calls"] > 0 and m["host_gathers"] > 0, (phase, rank, model, m["ce_calls"])
        group = r["shard_ranks"] if model != "fsdp" else (0, 1, 2, 3)
        for name, (kind, ranks) in m["slots"].items():
            # The uneven head (9 rows over 2) too: a padded slot in its shard group.
            assert (kind, ranks) == ("Slot", group), (phase, rank, model, name, kind, ranks)


def test_warm_run_is_served_from_the_shared_cache(shared):
    for rank, r in enumerate(shared["warm"]):
        for model in ("even", "uneven", "fsdp"):
            aot, fx = r[model]["aot"], r[model]["fx"]
            if AOT_CACHE_TAKES_DTENSOR:
                assert aot.get("autograd_cache_hit", 0) >= 1 and not aot.get("autograd_cache_miss"), (rank, model, aot)
            else:  # torch 2.11: AOTAutograd bypasses DTensor graphs; the FX graph cache serves
                assert aot.get("autograd_cache_bypass", 0) >= 1 and not aot.get("autograd_cache_hit"), (rank, model, aot)
                assert fx.get("fxgraph_cache_hit", 0) >= 1 and not fx.get("fxgraph_cache_miss"), (rank, model, fx)


def test_cache_keys_share_exactly_where_the_code_is_the_same(shared):
    res = shared["cold"]
    keys = {m: [r[m]["key"] for r in res] for m in ("even", "uneven", "fsdp")}
    if not AOT_CACHE_TAKES_DTENSOR:
        pytest.skip("torch 2.11: AOTAutograd's cache takes no DTensor graph (no key to compare)")
    if any(k is None for ks in keys.values() for k in ks):
        pytest.skip("AOTAutograd's autograd_cache_key is not where this test looks")
    groups = [r["shard_ranks"] for r in res]
    for a in range(4):
        for b in range(a + 1, 4):
            same_group = groups[a] == groups[b]
            assert (keys["even"][a] == keys["even"][b]) == same_group, (a, b, keys["even"])
            assert keys["uneven"][a] != keys["uneven"][b], (a, b, "uneven shards, one key")
    assert len(set(keys["fsdp"])) == 1, keys["fsdp"]  # 1-D fully_shard: one entry for all


def test_explain_names_the_shard_mesh_dim(shared):
    for phase in ("cold", "warm"):
        for rank, r in enumerate(shared[phase]):
            assert "'dp_shard' (dim 1 of mesh (2, 2))" in (r["mesh_dim"] or ""), (phase, rank, r["mesh_dim"])


# ---------------------------------------------------------------------------------------
# 8 ranks: a (2, 4) HSDP mesh and an 8-rank fully_shard mesh, one compile
# ---------------------------------------------------------------------------------------


class _Two(torch.nn.Module):
    def __init__(self, hsdp, fsdp):
        super().__init__()
        self.hsdp, self.fsdp = hsdp, fsdp

    def forward(self, x):
        return self.fsdp(self.hsdp(x))


def _rank_8(rank, ws, seed, cache_root):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    setup_compile(cache_root, rank)
    counts = count_gathers()
    mesh24 = init_device_mesh("cpu", (2, 4), mesh_dim_names=DIMS)
    hsdp = _build(mesh24, "hybrid_shard", out=16, seed=1)
    fsdp = _build(init_device_mesh("cpu", (ws,)), "fully_shard", out=8, seed=2)
    r = _run_model(_Two(hsdp, fsdp), rank, seed, None)
    r["host_gathers"] = counts["torch"]
    r["shard_ranks"] = tuple(dist.get_process_group_ranks(mesh24.get_group("dp_shard")))
    return r


@pytest.mark.slow  # default suite under 15 min on 2 cores: 8 ranks; HSDP on 4 ranks is the default above
def test_eight_ranks_hsdp_2x4_and_fully_shard_8(tmp_path):
    seed = random.randrange(1 << 20)
    res = run_ranks(_rank_8, 8, seed, str(tmp_path.resolve()), timeout=900)
    for rank, r in enumerate(res):
        assert r["exact"], f"rank {rank}: compiled != eager (max diff {r['max_diff']})"
        assert r["ce_calls"] > 0 and r["host_gathers"] > 0, (rank, r["ce_calls"])
        assert r["shard_ranks"] == tuple(range(4 * (rank // 4), 4 * (rank // 4) + 4)), r["shard_ranks"]
        for name, (kind, ranks) in r["slots"].items():
            want = r["shard_ranks"] if name.startswith("hsdp.") else tuple(range(8))
            assert (kind, ranks) == ("Slot", want), (rank, name, kind, ranks)
