"""Lifecycle: memory, re-compiles, teardown, several process groups, misuse.

* memory: after binding, parameters view the shared windows and their old storage is
  gone; release_all() plus dropping the model unmaps every window; nothing is left in
  /dev/shm.
* re-compiles: new input shapes, dynamic=True, torch._dynamo.reset(), a second process
  with a warm FX graph cache: the weights stay in their slots, nothing binds twice,
  results stay exact; after release_all() the next run binds again.
* several process groups: dense weights over 4 ranks and "expert" weights over pairs,
  compiled through torch_ce: separate pools, exact results, no hang.
* misuse: bad config values, unknown options and bad env values raise ValueError; an
  unbound tensor or a destroyed group raises a clear RuntimeError (no hang); a 1-rank
  group binds nothing (with a reason) and the op returns a copy; enable()/disable()
  restore torch._inductor.config exactly, also around a user's own post-grad pass.

Every multi-process check runs through run_ranks (spawned gloo ranks, with a timeout).
"""
from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist

from mp_harness import quiet_warnings, run_ranks, setup_compile
from mp_harness import reference_all_gather as _ref_gather
from mp_harness import seed_base as _base
from torch_ce import all_gather as _ce  # bound-shard gather + wait
from torch_ce.config import config


def _shm_maps() -> list[str]:
    """Lines of /proc/self/maps that map one of our shared-memory segments."""
    with open("/proc/self/maps") as f:
        return [ln.strip() for ln in f if f"/dev/shm/{config.shm_prefix}" in ln]


def _n_windows() -> int:
    import torch_ce.runtime.window_pools as WP

    return sum(len(p.windows) for p in WP.pools().values())


# ---------------------------------------------------------------------------------------
# Memory, teardown and misuse through the public bind API (one spawned run)
# ---------------------------------------------------------------------------------------


def _memory(rank, ws, base):
    import torch_ce
    import torch_ce.runtime.window_pools as WP
    import torch_ce.runtime.windows as W
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.multiprocessing.reductions import StorageWeakRef

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(base)
    model = torch.nn.ParameterDict({
        f"w{i}": torch.nn.Parameter(distribute_tensor(torch.randn(8, 6).to(dt), mesh, [Shard(0)]),
                                    requires_grad=False)
        for i, dt in enumerate((torch.float32, torch.bfloat16, torch.float32))
    })
    clones = {n: p._local_tensor.clone() for n, p in model.items()}
    refs = {n: _ref_gather(c) for n, c in clones.items()}
    old = {n: StorageWeakRef(p._local_tensor.untyped_storage()) for n, p in model.items()}
    maps_before = len(_shm_maps())

    res = torch_ce.bind(model)
    out = dict(bind=repr(res), bound=len(res.bound), windows_opened=res.windows_opened)
    gc.collect()
    out["old_expired"] = all(w.expired() for w in old.values())
    slots = {n: W.lookup(p._local_tensor) for n, p in model.items()}
    out["views_window"] = all(
        isinstance(s, W.Slot)
        and p._local_tensor.data_ptr() == s.window.local.data_ptr() + s.offset
        and p._local_tensor.untyped_storage().nbytes() == s.nbytes
        for (n, p), s in zip(model.items(), slots.values(), strict=True))
    out["maps_after_bind"] = len(_shm_maps()) - maps_before  # own + peer segments
    out["exact"] = [torch.equal(_ce(p._local_tensor), refs[n]) for n, p in model.items()]
    out["data_kept"] = [torch.equal(p._local_tensor, clones[n]) for n, p in model.items()]

    windows = [w for pool in WP.pools().values() for w in pool.windows]
    win_refs = [StorageWeakRef(w.local.untyped_storage()) for w in windows]
    peer_refs = [StorageWeakRef(v.untyped_storage()) for w in windows for v in w.peer_locals]
    del windows, slots
    dist.barrier()  # no peer reads this rank's windows any more

    # Teardown, then binding again works (fresh windows) and stays exact.
    torch_ce.release_all()
    out["forgotten"] = all(W.lookup(p._local_tensor) is None for p in model.values())
    res2 = torch_ce.bind(model)
    out["rebind"] = dict(bound=len(res2.bound), windows_opened=res2.windows_opened)
    out["rebind_exact"] = [torch.equal(_ce(p._local_tensor), refs[n]) for n, p in model.items()]
    dist.barrier()
    torch_ce.release_all()

    # Dropping the model (the last views of the windows) unmaps everything.
    del model, res, res2
    gc.collect()
    out["win_expired"] = [w.expired() for w in win_refs]
    out["peer_expired"] = [w.expired() for w in peer_refs]
    out["maps_left"] = _shm_maps()
    return out


def _misuse(rank, ws, base):
    import torch_ce
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    gen = torch.Generator().manual_seed(base + rank)
    out = {}
    world = dist.group.WORLD

    def err(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None

    # An unbound tensor: both ops raise RuntimeError and say what to do.
    t = torch.randn(4, 3, generator=gen)
    out["unbound"] = [
        err(lambda: torch.ops.magi.ce_all_gather(t, ws, world.group_name)),
        err(lambda: torch.ops.magi.ce_all_gather_coalesced([t], ws, world.group_name)),
    ]

    # A destroyed group: bind on it, gather, destroy it, gather again -> clear error.
    g = dist.new_group(list(range(ws)))
    name = g.group_name
    s = torch.randn(5, 2, generator=gen)
    ref = _ref_gather(s)
    res = torch_ce.bind([s], group=g)
    out["dead_group_bound"] = res.bound
    out["dead_group_before"] = torch.equal(_ce(s, g), ref)
    dist.barrier()
    dist.destroy_process_group(g)
    out["dead_group_op"] = [
        err(lambda: torch.ops.magi.ce_all_gather(s, ws, name)),
        err(lambda: torch.ops.magi.ce_all_gather_coalesced([s], ws, name)),
    ]
    out["dead_group_bind_step"] = err(
        lambda: torch.ops.magi.ce_bind([torch.randn(3, generator=gen)], [ws], [name], ["w"], [""]))

    # After release_all() a formerly bound shard is just a tensor again: "not bound".
    dist.barrier()
    torch_ce.release_all()
    out["released"] = err(lambda: torch.ops.magi.ce_all_gather(s, ws, world.group_name))

    # 1-rank groups (each rank its own): bind is a no-op with a reason; the op copies.
    singles = [dist.new_group([r]) for r in range(ws)]
    mine = singles[rank]
    p = torch.randn(6, 3, generator=gen)
    res_p = torch_ce.bind([p], group=mine)
    mesh1 = DeviceMesh.from_group(mine, "cpu")
    d = DTensor.from_local(torch.randn(4, 2, generator=gen), mesh1, [Shard(0)], run_check=False)
    res_d = torch_ce.bind({"d": d})
    o1 = _ce(p, mine)
    (o2,) = [torch.ops._c10d_functional.wait_tensor(x)
             for x in torch.ops.magi.ce_all_gather_coalesced([d._local_tensor], 1, mine.group_name)]
    out["world1"] = dict(
        bound=res_p.bound + res_d.bound,
        skipped=[res_p.skipped.get("param0", ""), res_d.skipped.get("d", "")],
        copy=[torch.equal(o1, p) and o1.data_ptr() != p.data_ptr(),
              torch.equal(o2, d._local_tensor) and o2.data_ptr() != d._local_tensor.data_ptr()],
    )
    return out


def _rank_bind_lifecycle(rank, ws, base):
    quiet_warnings()
    torch.set_num_threads(1)
    import torch_ce

    torch_ce.config.update(cost_mode="default")
    return dict(memory=_memory(rank, ws, base), misuse=_misuse(rank, ws, base))


@pytest.fixture(scope="module")
def bind_lifecycle():
    return run_ranks(_rank_bind_lifecycle, 2, _base(), timeout=90)


def test_bound_params_view_windows_and_old_storage_is_freed(bind_lifecycle):
    for rank, r in enumerate(bind_lifecycle):
        m = r["memory"]
        assert m["bound"] == 3 and m["windows_opened"] == 2, (rank, m["bind"])  # fp32 + bf16 pools
        assert m["old_expired"], f"rank {rank}: the pre-bind storage is still alive (weight held twice)"
        assert m["views_window"], rank
        assert m["maps_after_bind"] == 2 * 2, (rank, m["maps_after_bind"])  # 2 windows x (own + peer)
        assert all(m["exact"]) and all(m["data_kept"]), rank


def test_release_all_then_rebind(bind_lifecycle):
    for rank, r in enumerate(bind_lifecycle):
        m = r["memory"]
        assert m["forgotten"], rank
        assert m["rebind"] == dict(bound=3, windows_opened=2), (rank, m["rebind"])
        assert all(m["rebind_exact"]), rank


def test_release_all_and_dropping_the_model_unmaps_the_windows(bind_lifecycle):
    for rank, r in enumerate(bind_lifecycle):
        m = r["memory"]
        assert m["win_expired"] and all(m["win_expired"]), (rank, m["win_expired"])
        assert m["peer_expired"] and all(m["peer_expired"]), (rank, m["peer_expired"])
        assert m["maps_left"] == [], (rank, m["maps_left"])


def test_unbound_tensor_raises(bind_lifecycle):
    for r in bind_lifecycle:
        for e in r["misuse"]["unbound"]:
            assert e and e.startswith("RuntimeError") and "not bound" in e and "torch_ce.bind" in e, e


def test_destroyed_group_raises_clearly(bind_lifecycle):
    for r in bind_lifecycle:
        u = r["misuse"]
        assert u["dead_group_bound"] == ["param0"] and u["dead_group_before"], u
        for e in u["dead_group_op"]:
            assert e and e.startswith("RuntimeError") and "not a live process group" in e, e
        e = u["dead_group_bind_step"]
        assert e and e.startswith("RuntimeError") and "process group" in e, e
        e = u["released"]
        assert e and e.startswith("RuntimeError") and "not bound" in e, e


def test_one_rank_group_binds_nothing_and_copies(bind_lifecycle):
    for r in bind_lifecycle:
        w = r["misuse"]["world1"]
        assert w["bound"] == [], w
        assert all("size 1" in why for why in w["skipped"]), w
        assert w["copy"] == [True, True], w


# ---------------------------------------------------------------------------------------
# Re-compiles over the same weights
# ---------------------------------------------------------------------------------------


def _rank_recompile(rank, ws, cache_root, phase):
    """phase 0: cold cache; phase 1: a new process with the same (warm) per-rank cache."""
    setup_compile(cache_root, rank, fx_cache=True)
    import torch_ce
    import torch_ce.runtime.windows as W
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch_ce import report

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]), requires_grad=False)
          for _ in range(2)]
    old = [StorageWeakRef(p._local_tensor.untyped_storage()) for p in ps]

    def f(x):
        for w in ps:
            x = x @ w.redistribute(placements=[Replicate()]).to_local().t()
        return x

    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(n, 8, generator=gen) for n in (4, 6, 7, 5)]
    with torch.no_grad():
        eager = [f(x) for x in xs]
    torch_ce.enable(transport="copy_engine", cost_cache_dir=os.path.join(cache_root, "cost"))
    steps = []

    def step(name, fn, x_i):
        g0, b0 = len(report.graphs), len(report.binds)
        hit0, miss0 = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        with torch.no_grad():
            out = fn(xs[x_i])
        steps.append(dict(
            name=name, exact=torch.equal(out, eager[x_i]),
            graphs=[len(g.bound) for g in report.graphs[g0:]],
            binds=[(len(b.bound), len(b.already_bound), b.windows_opened) for b in report.binds[b0:]],
            windows=_n_windows(),
            ptrs=[p._local_tensor.data_ptr() for p in ps],
            slots=[type(W.lookup(p._local_tensor)).__name__ for p in ps],
            hits=counters["inductor"]["fxgraph_cache_hit"] - hit0,
            misses=counters["inductor"]["fxgraph_cache_miss"] - miss0,
        ))

    try:
        c = torch.compile(f, fullgraph=True)
        step("first", c, 0)
        gc.collect()
        old_expired = [w.expired() for w in old]
        step("again", c, 0)
        step("new shape", c, 1)  # recompile (automatic dynamic)
        step("another shape", c, 2)
        torch._dynamo.reset()
        step("dynamic=True", torch.compile(f, dynamic=True, fullgraph=True), 3)
        torch._dynamo.reset()
        step("after reset", torch.compile(f, fullgraph=True), 0)
        # Teardown mid-job: forget every window; the next run binds into new ones.
        dist.barrier()
        torch_ce.release_all()
        step("after release_all", c if phase else torch.compile(f, fullgraph=True), 0)
    finally:
        torch_ce.disable()
    return dict(steps=steps, old_expired=old_expired)


@pytest.fixture(scope="module")
def recompiles(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("recompile").resolve())
    cold = run_ranks(_rank_recompile, 2, root, 0, timeout=150)
    warm = run_ranks(_rank_recompile, 2, root, 1, timeout=150)  # same per-rank cache dirs
    return dict(cold=cold, warm=warm)


def _steps(r):
    return {s["name"]: s for s in r["steps"]}


@pytest.mark.parametrize("phase", ["cold", "warm"])
def test_recompiles_reuse_slots_and_bind_nothing_twice(recompiles, phase):
    for rank, r in enumerate(recompiles[phase]):
        st = _steps(r)
        first = st["first"]
        assert all(s["exact"] for s in r["steps"]), (rank, [(s["name"], s["exact"]) for s in r["steps"]])
        # The first run binds both weights into one window.
        assert first["binds"] == [(2, 0, 1)], (rank, first)
        assert first["slots"] == ["Slot", "Slot"] and first["windows"] == 1, (rank, first)
        assert r["old_expired"] == [True, True], f"rank {rank}: pre-bind storage still alive under compile"
        for name in ("again", "new shape", "another shape", "dynamic=True", "after reset"):
            s = st[name]
            # Nothing moves again: no bind that moved anything, no new window, same addresses.
            assert all(b[0] == 0 and b[2] == 0 for b in s["binds"]), (rank, name, s["binds"])
            assert s["windows"] == 1 and s["ptrs"] == first["ptrs"], (rank, name, s)
            assert s["slots"] == ["Slot", "Slot"], (rank, name, s)
        # A recompile whose passes ran still retargeted both gathers (graphs recorded).
        for name in ("new shape", "dynamic=True"):
            s = st[name]
            assert s["hits"] or s["graphs"] == [2], (rank, name, s)


def test_warm_fx_graph_cache_in_a_second_process_binds_from_cached_code(recompiles):
    for rank, r in enumerate(recompiles["warm"]):
        first = _steps(r)["first"]
        # The post-grad pass did not run (cache hit), yet the cached bind step moved the
        # weights into windows in this new process.
        assert first["hits"] >= 1 and first["misses"] == 0, (rank, first)
        assert first["graphs"] == [], (rank, first)
        assert first["binds"] == [(2, 0, 1)] and first["slots"] == ["Slot", "Slot"], (rank, first)
    for rank, r in enumerate(recompiles["cold"]):
        st = _steps(r)
        assert st["first"]["misses"] >= 1 and st["first"]["graphs"] == [2], (rank, st["first"])
        assert st["after reset"]["hits"] >= 1, (rank, st["after reset"])  # same graph: a hit


@pytest.mark.parametrize("phase", ["cold", "warm"])
def test_after_release_all_the_next_run_binds_again(recompiles, phase):
    for rank, r in enumerate(recompiles[phase]):
        s = _steps(r)["after release_all"]
        assert s["exact"], rank
        assert s["binds"] == [(2, 0, 1)], (rank, s)
        assert s["slots"] == ["Slot", "Slot"] and s["windows"] == 1, (rank, s)


# ---------------------------------------------------------------------------------------
# Several process groups: dense over 4 ranks, experts over pairs
# ---------------------------------------------------------------------------------------


def _rank_groups(rank, ws, cache_root):
    setup_compile(cache_root, rank, fx_cache=False)
    import torch_ce
    import torch_ce.runtime.window_pools as WP
    import torch_ce.runtime.windows as W
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch_ce import report

    torch_ce.config.update(cost_cache_dir=os.path.join(cache_root, "cost"))
    dense_mesh = init_device_mesh("cpu", (ws,))
    ep_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))["ep"]  # {0,1}, {2,3}
    P = lambda t, m: torch.nn.Parameter(distribute_tensor(t, m, [Shard(0)]), requires_grad=False)  # noqa: E731
    torch.manual_seed(0)
    dense = [P(torch.randn(8, 8), dense_mesh) for _ in range(2)]
    torch.manual_seed(100 + rank // 2)  # each pair holds different experts
    experts = [P(torch.randn(6, 8), ep_mesh), P(torch.randn(8, 6), ep_mesh)]

    from torch_ce.simple_fsdp import gathered as full

    def f(x):
        x = x @ full(dense[0]).t()
        h = x @ full(experts[0]).t()  # (n, 6)
        x = x + h @ full(experts[1]).t()
        return x @ full(dense[1]).t()

    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, 8, generator=gen) for _ in range(2)]
    with torch.no_grad():
        eager = [f(x) for x in xs]
    torch_ce.enable(transport="copy_engine")
    try:
        compiled = torch.compile(f, fullgraph=True)
        with torch.no_grad():
            outs = [compiled(x) for x in xs]
    finally:
        torch_ce.disable()
    slot_ranks = [W.lookup(p._local_tensor).window.group_ranks for p in dense + experts]
    return dict(
        exact=[torch.equal(o, e) for o, e in zip(outs, eager, strict=True)],
        pools=sorted(WP.pools()),
        slot_ranks=slot_ranks,
        compile_bound=len(report.graphs[-1].bound),
        refused=report.graphs[-1].refused,
        binds=[(len(b.bound), b.windows_opened) for b in report.binds],
        ep_group_name=ep_mesh.get_group(0).group_name,
    )


def test_dense_and_expert_groups_use_separate_pools(tmp_path):
    res = run_ranks(_rank_groups, 4, str(tmp_path.resolve()), timeout=180)
    for rank, r in enumerate(res):
        pair = (0, 1) if rank < 2 else (2, 3)
        assert r["exact"] == [True, True], f"rank {rank}: compiled != eager"
        assert r["compile_bound"] == 4 and r["refused"] == [], (rank, r)
        assert r["pools"] == sorted([((0, 1, 2, 3), "float32", "cpu"), (pair, "float32", "cpu")]), (rank, r["pools"])
        assert r["slot_ranks"] == [(0, 1, 2, 3), (0, 1, 2, 3), pair, pair], (rank, r["slot_ranks"])
        assert r["binds"] == [(4, 2)], (rank, r["binds"])  # one window per pool
    # The two pairs' expert groups are different groups.
    assert res[0]["ep_group_name"] == res[1]["ep_group_name"] != res[2]["ep_group_name"] == res[3]["ep_group_name"]


# ---------------------------------------------------------------------------------------
# Config misuse (in this process: no group needed)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,msg", [
    (dict(transport="bogus"), "transport must be one of"),
    (dict(cost_mode="fast"), "cost_mode must be one of"),
    (dict(symm_min_shard_mib=-1), "symm_min_shard_mib must be >= 0"),
    (dict(bucket_size_mib=-0.5), "bucket_size_mib must be >= 0"),
    (dict(comm_overlap_margin_us=-1), "comm_overlap_margin_us must be >= 0"),
    (dict(window_cap_mib=0), "window_cap_mib must be > 0"),
    (dict(window_cap_mib=-4), "window_cap_mib must be > 0"),
    (dict(comm_overlap_window_scale=0), "comm_overlap_window_scale must be > 0"),
    (dict(shm_prefix="a/b"), "shm_prefix must be"),
    (dict(shm_prefix=""), "shm_prefix must be"),
    (dict(bogus_option=1), "unknown config option"),
    (dict(transport="copy_engine", symm_min_shard_mib=-1), "symm_min_shard_mib"),
])
def test_bad_config_raises_and_changes_nothing(kw, msg):
    import dataclasses

    import torch_ce
    from torch_ce.passes import install

    before_cfg = dataclasses.asdict(torch_ce.config)
    before_ic = _ic_snapshot()
    with pytest.raises(ValueError, match=msg):
        torch_ce.enable(**kw)
    with pytest.raises(ValueError, match=msg):
        torch_ce.config.update(**kw)
    with pytest.raises(ValueError, match=msg):
        with torch_ce.config.patch(**kw):
            pass
    assert dataclasses.asdict(torch_ce.config) == before_cfg  # all or nothing
    assert not install.is_enabled()
    assert _diff(before_ic, _ic_snapshot()) == {}


@pytest.mark.parametrize("env,msg", [
    ({"TORCH_CE_TRANSPORT": "bogus"}, "transport must be one of"),
    ({"TORCH_CE_HOST_TRANSPORT": "maybe"}, "TORCH_CE_HOST_TRANSPORT='maybe' is not a boolean"),
    ({"TORCH_CE_REORDER": "2"}, "TORCH_CE_REORDER='2' is not a boolean"),
    ({"TORCH_CE_SYMM_MIN_SHARD_MIB": "abc"}, "TORCH_CE_SYMM_MIN_SHARD_MIB='abc' is not a number"),
    ({"TORCH_CE_WINDOW_CAP_MIB": "-5"}, "window_cap_mib must be > 0"),
    ({"TORCH_CE_BUCKET_SIZE_MIB": "-1"}, "bucket_size_mib must be >= 0"),
    ({"TORCH_CE_COST_MODE": "none"}, "cost_mode must be one of"),
    ({"TORCH_CE_SHM_PREFIX": "job 1"}, "shm_prefix must be"),
])
def test_bad_env_values_raise(env, msg):
    from torch_ce.config import from_env

    with pytest.raises(ValueError, match=msg):
        from_env(env)


def test_good_env_values_parse():
    from torch_ce.config import from_env

    c = from_env({"TORCH_CE_TRANSPORT": "copy_engine", "TORCH_CE_HOST_TRANSPORT": "off",
                  "TORCH_CE_REORDER": "TRUE", "TORCH_CE_SYMM_MIN_SHARD_MIB": " 2.5 ",
                  "TORCH_CE_WINDOW_CAP_MIB": "64", "TORCH_CE_COST_MODE": "default",
                  "TORCH_CE_BUCKET_SIZE_MIB": "", "TORCH_CE_SHM_PREFIX": "job7_", "UNRELATED": "x"})
    assert (c.transport, c.host_transport, c.reorder, c.symm_min_shard_mib, c.window_cap_mib,
            c.cost_mode, c.bucket_size_mib, c.shm_prefix) == ("copy_engine", False, True, 2.5, 64.0, "default", 0.0, "job7_")
    assert c.window_cap_bytes == 64 * 2**20 and c.min_shard_bytes == int(2.5 * 2**20)


# ---------------------------------------------------------------------------------------
# enable()/disable() restore torch._inductor.config exactly
# ---------------------------------------------------------------------------------------


def _norm(v):
    """A comparable form of a config value (deep copies of pass objects differ by id)."""
    if isinstance(v, (set, frozenset)):
        return (type(v).__name__, tuple(sorted(map(repr, v))))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_norm(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((repr(k), _norm(x)) for k, x in v.items()))
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return v
    if callable(v) and hasattr(v, "__qualname__"):
        return ("fn", getattr(v, "__module__", ""), v.__qualname__)
    return ("obj", type(v).__module__, type(v).__qualname__)


def _ic_snapshot():
    import torch._inductor.config as ic

    return {k: _norm(v) for k, v in ic.get_config_copy().items()}


def _diff(a, b):
    return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


def _tiny_graph():
    import torch.fx as fx

    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.relu.default, (x,)))
    return g


@pytest.fixture
def clean_ic():
    """Undo anything a failing test left in torch._inductor.config."""
    import torch._inductor.config as ic
    import torch_ce

    keys = ("post_grad_custom_post_pass", "reorder_for_compute_comm_overlap",
            "reorder_for_compute_comm_overlap_passes", "estimate_op_runtime", "reorder_for_locality")
    saved = {k: getattr(ic, k) for k in keys}
    yield
    torch_ce.disable()
    for k, v in saved.items():
        setattr(ic, k, v)


def test_enable_disable_restores_inductor_config_exactly(clean_ic):
    import torch._inductor.config as ic
    import torch_ce
    from torch_ce.passes import install, manager

    before = _ic_snapshot()
    torch_ce.enable(transport="copy_engine")
    on = _ic_snapshot()
    changed = _diff(before, on)
    assert "post_grad_custom_post_pass" in changed and isinstance(ic.post_grad_custom_post_pass, manager.TorchCEPass)
    assert ic.reorder_for_compute_comm_overlap is True
    assert ic.reorder_for_locality is False
    torch_ce.enable(transport="copy_engine")  # idempotent: nothing chained twice
    assert _diff(on, _ic_snapshot()) == {}
    torch_ce.disable()
    assert _diff(before, _ic_snapshot()) == {}
    torch_ce.disable()  # a second disable changes nothing
    assert _diff(before, _ic_snapshot()) == {}
    assert not install.is_enabled()


def test_enable_disable_around_a_user_callable_pass(clean_ic):
    import torch._inductor.config as ic
    import torch_ce
    from torch_ce.passes import manager

    calls = []

    def user_pass(graph):
        calls.append("user")

    seen = []
    with manager.observing(lambda g: seen.append("ours")):
        ic.post_grad_custom_post_pass = user_pass
        before = _ic_snapshot()
        torch_ce.enable(transport="copy_engine")
        chained = ic.post_grad_custom_post_pass
        assert chained is not user_pass
        chained(_tiny_graph())
        assert calls == ["user"] and seen == ["ours"], (calls, seen)  # both run, user's first
        assert chained.uuid() is None  # a bare function bypasses the caches, as before us
        torch_ce.disable()
        assert ic.post_grad_custom_post_pass is user_pass
        assert _diff(before, _ic_snapshot()) == {}


def test_enable_disable_around_a_user_custom_graph_pass(clean_ic):
    import torch._inductor.config as ic
    import torch_ce
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class UserPass(CustomGraphPass):
        calls = 0

        def __call__(self, graph):
            UserPass.calls += 1

        def uuid(self):
            return "user-pass-v1"

    up = UserPass()
    ic.post_grad_custom_post_pass = up
    before = _ic_snapshot()
    torch_ce.enable(transport="copy_engine")
    chained = ic.post_grad_custom_post_pass
    chained(_tiny_graph())
    assert UserPass.calls == 1
    u1 = chained.uuid()
    assert isinstance(u1, str) and u1 != "user-pass-v1"  # cacheable, and keyed on both
    with torch_ce.config.patch(symm_min_shard_mib=1.0):
        assert chained.uuid() != u1  # our config is part of the key
    torch_ce.disable()
    assert ic.post_grad_custom_post_pass is up
    assert _diff(before, _ic_snapshot()) == {}


def test_enable_disable_around_a_user_pass_list(clean_ic):
    import torch._inductor.config as ic
    import torch_ce
    from torch_ce.passes import manager

    def user_pass(graph):
        pass

    lst = [user_pass]
    ic.post_grad_custom_post_pass = lst
    before = _ic_snapshot()
    torch_ce.enable(transport="copy_engine")
    now = ic.post_grad_custom_post_pass
    assert isinstance(now, list) and now[0] is user_pass and isinstance(now[1], manager.TorchCEPass)
    assert lst == [user_pass]  # the user's list is not mutated
    torch_ce.disable()
    assert ic.post_grad_custom_post_pass is lst and lst == [user_pass]
    assert _diff(before, _ic_snapshot()) == {}


# Exactly what each enable() installs (README, the transport and reorder rows).
_REORDER_KEYS = {"reorder_for_compute_comm_overlap", "reorder_for_compute_comm_overlap_passes",
                 "estimate_op_runtime"}
_OFF_KEYS = {"reorder_for_locality", "bucket_all_gathers_fx",
             "aten_distributed_optimizations.enable_overlap_scheduling",
             "aten_distributed_optimizations.enable_low_contention_collectives",
             "aten_distributed_optimizations.enable_simple_overlap"}


def _installed(ic):
    from torch_ce.passes import manager, reorder

    ours = ic.post_grad_custom_post_pass
    return (isinstance(ours, manager.TorchCEPass),
            [type(p) for p in ic.reorder_for_compute_comm_overlap_passes] == [reorder.LatestSafeLaunch])


def test_enable_again_reconfigures(clean_ic):
    """A second enable() applies the config anew (it used to keep the first reorder)."""
    import torch._inductor.config as ic
    import torch_ce

    before = _ic_snapshot()
    torch_ce.enable(transport="copy_engine")
    on = _ic_snapshot()
    assert _installed(ic) == (True, True)
    torch_ce.enable(reorder=False)
    assert _installed(ic) == (True, False)
    changed = set(_diff(before, _ic_snapshot()))
    assert "post_grad_custom_post_pass" in changed and not changed & _REORDER_KEYS, changed
    torch_ce.enable(reorder=True)
    assert _diff(on, _ic_snapshot()) == {}
    torch_ce.disable()
    assert _diff(before, _ic_snapshot()) == {}


def test_nccl_transport_installs_only_the_reorder(clean_ic):
    """transport="nccl": our pass only as the carrier of the cache identity (it leaves
    graphs as they are; NOTE [a cache shared by ranks]); with reorder on, also the reorder,
    its cost estimate and the settings that would fight it; with reorder off, nothing else."""
    import torch._inductor.config as ic
    import torch_ce

    before = _ic_snapshot()
    torch_ce.enable(transport="nccl", reorder=False)
    assert set(_diff(before, _ic_snapshot())) == {"post_grad_custom_post_pass"}
    assert _installed(ic) == (True, False)
    torch_ce.enable(transport="nccl", reorder=True)  # the e2e benchmark's NCCL baseline
    assert _installed(ic) == (True, True)
    changed = set(_diff(before, _ic_snapshot())) - {"post_grad_custom_post_pass"}
    assert _REORDER_KEYS - {"reorder_for_compute_comm_overlap"} <= changed <= _REORDER_KEYS | _OFF_KEYS, changed
    assert ic.reorder_for_locality is False
    torch_ce.disable()
    assert _diff(before, _ic_snapshot()) == {}


def test_disable_after_many_enables_restores_the_first_state(clean_ic):
    import torch._inductor.config as ic
    import torch_ce
    from torch_ce.passes import install

    def user_pass(graph):
        pass

    ic.post_grad_custom_post_pass = user_pass
    before = _ic_snapshot()
    for kw in (dict(transport="copy_engine"), dict(transport="nccl"), dict(reorder=False),
               dict(transport="copy_engine", reorder=True), dict(transport="copy_engine")):
        torch_ce.enable(**kw)
    assert isinstance(ic.post_grad_custom_post_pass, install._Chained)
    assert ic.post_grad_custom_post_pass.first is user_pass  # chained once, not onto ourselves
    torch_ce.disable()
    assert ic.post_grad_custom_post_pass is user_pass
    assert _diff(before, _ic_snapshot()) == {}
    assert not install.is_enabled()
