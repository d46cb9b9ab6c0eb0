"""Weights that change (NOTE [updating bound weights] in torch_ce/runtime/updates.py), on
CPU ranks (gloo, host transport): one rank updates seconds after its peers, and every call
on every rank still equals eager on the current weights.

The models are torchtitan's SimpleFSDP (graph_trainer's ``data_parallel``, ``fully_shard``)
under plain ``torch.compile``, inference under ``no_grad``, as the issue's user ran them; the
reference is a plain module holding the full weights (bit-exact: the chains are matmuls and
ReLUs, which Inductor leaves to the same aten kernels). Rank 1 sleeps ``DELAY`` seconds inside
every update block before it writes: without the protocol its peer would read on.

- ``test_every_write_method_with_a_late_rank``: 2 ranks, an fp32 model (weights bound in
  place) and a bf16 ``param_dtype`` one (cast slots), updated together by
  ``load_state_dict``, ``copy_`` into the local shards, ``.data`` writes, a
  ``dist.broadcast`` from another group straight into the shards (the RL weight sync), and
  ``dcp.load`` + ``set_model_state_dict``; then the version net: an update outside the
  protocol (fp32 ``copy_``, bf16 ``load_state_dict``, no delay) raises
  ``StaleWeightError`` naming the weight on every rank, and the protocol recovers; a block
  that raises on one rank raises on every rank; a partial update (a rank that never enters)
  is an ``UpdateError`` naming it within ``timeout_s``, and the late rank's own attempt
  fails at once instead of hanging.
- ``test_uneven_world3_with_prefetch``: 3 ranks, uneven shards (one empty), fp32 and bf16,
  ``prefetch_next_call_mib`` on: parked weights are dropped by the update, never served.
- ``test_moe_experts_on_their_own_mesh``: 4 ranks, the zoo's Qwen3-MoE as graph_trainer
  wraps it with expert parallelism 2 (dense weights over fsdp, routed experts over efsdp);
  the reference is each phase's weights loaded into a fresh net and run through the
  collective graph (slow-marked for the default suite's time; CI's 2.11 leg runs it,
  .ci/legs.sh ``SLOW_2111``).
- ``test_rollback_trains_as_a_fresh_run``: training, a checkpoint, a loss spike's worth of
  steps, a rollback (model and optimizer state) inside the protocol with a late rank: the
  steps after it are bit-identical to a fresh run started from the checkpoint.
"""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("torchtitan")  # its modules then import, or the file fails loudly

from mp_harness import run_ranks, seed_base, setup_compile  # noqa: E402

DELAY = 2.0  # seconds rank 1 spends inside each update block before it writes
LATE = 1
ENV = {"TORCH_CE_COST_MODE": "default"}  # no calibration: seconds of timed gathers per rank
ENV_MANY = {**ENV, "TORCH_CE_BIND_ARRIVAL_TIMEOUT_S": "240"}  # 3-4 ranks compiling on 2 cores


def _compared(label, key, got, want) -> tuple:
    """One call's record: (label, key, bit-exact?, max abs difference)."""
    return label, key, bool(torch.equal(got, want)), float((got - want).abs().max())


class _Chain(torch.nn.Module):
    """Bias-free linears with ReLUs between: exact against eager in fp32 and bf16."""

    def __init__(self, dims):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=False)
                                          for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


def _fsdp_chain(dims, seed, mesh, param_dtype, train=False):
    """graph_trainer's SimpleFSDP over ``mesh`` of a ``_Chain``; (model, its full weights)."""
    from torchtitan.experiments.graph_trainer import simple_fsdp

    torch.manual_seed(seed)  # the same full weights on every rank
    net = _Chain(dims)
    full = [layer.weight.detach().clone() for layer in net.layers]
    simple_fsdp._wrap_class_cache.clear()
    policy = simple_fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    model = simple_fsdp.data_parallel(net, mesh, mode="fully_shard", mp_policy=policy)
    return model.requires_grad_(train), full


def _eager(full, x):
    """The reference: the chain on the full weights, in ``x``'s dtype."""
    for i, w in enumerate(full):
        x = torch.nn.functional.linear(x, w.to(x.dtype))
        if i + 1 < len(full):
            x = torch.relu(x)
    return x


def _rows(f, world, rank):
    """This rank's rows of ``f`` under ``Shard(0)`` (torch.chunk's split; empty past its end)."""
    chunks = f.chunk(world)
    return chunks[rank] if rank < len(chunks) else f[:0]


def _dtensors(model, full, mesh):
    """The state dict a checkpoint of ``full`` gives this rank: DTensors of its shards."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    names = [n for n, _ in model.named_parameters()]
    return {n: DTensor.from_local(_rows(f, world, rank).clone(), mesh, [Shard(0)], run_check=False,
                                  shape=f.shape, stride=f.stride())
            for n, f in zip(names, full, strict=True)}


def _write(method, model, full, mesh, side, ckpt):
    """This rank's shards of ``full`` into ``model``, the way ``method`` writes them."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    params = list(model.parameters())
    if method == "load_state_dict":
        model.load_state_dict(_dtensors(model, full, mesh))
    elif method == "copy_":
        for p, f in zip(params, full, strict=True):
            p._local_tensor.copy_(_rows(f, world, rank))
    elif method == ".data":  # moves no version counter: only the protocol covers it
        for p, new in zip(params, _dtensors(model, full, mesh).values(), strict=True):
            p.data.copy_(new)
    elif method == "broadcast":  # rank 0 (the "trainer") sends each peer its shard, in place
        for p, f in zip(params, full, strict=True):
            if rank == 0:
                p._local_tensor.copy_(_rows(f, world, 0))
            for r in range(1, world):
                if _rows(f, world, r).numel() == 0:
                    continue
                if rank == 0:
                    buf = _rows(f, world, r).contiguous()
                elif rank == r:
                    buf = p._local_tensor  # received straight into the bound shard
                else:
                    buf = torch.empty_like(_rows(f, world, r))
                dist.broadcast(buf, src=0, group=side)
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        sd = get_model_state_dict(model)
        dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
        set_model_state_dict(model, sd)
    else:
        raise AssertionError(method)


def _new_full(full, seed):
    """Other weights of the same shapes and scale, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(f.shape, generator=g) * f.std() for f in full]


METHODS = ("load_state_dict", "copy_", ".data", "broadcast", "dcp")


def _rank_methods(rank, world, seed, root):
    setup_compile(root, rank)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import torch_ce

    mesh = init_device_mesh("cpu", (world,))
    side = dist.new_group(list(range(world)), backend="gloo")  # the weight-sync group
    models, fulls = {}, {}
    models["fp32"], fulls["fp32"] = _fsdp_chain([16, 32, 24, 8], seed, mesh, None)
    models["bf16"], fulls["bf16"] = _fsdp_chain([8, 24, 16, 4], seed + 1, mesh, torch.bfloat16)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    params = [p for m in models.values() for p in m.parameters()]
    gen = torch.Generator().manual_seed(seed + 1000 + rank)  # different inputs per rank
    res = dict(calls=[], errors={}, times={})
    torch_ce.enable(transport="copy_engine")
    try:
        compiled = {k: torch.compile(m, fullgraph=True) for k, m in models.items()}

        def calls(label, n=2):
            """``n`` calls of each model, each against eager on the current weights."""
            for k, c in compiled.items():
                for _ in range(n):
                    x = torch.randn(3, models[k].layers[0].in_features, generator=gen).to(dtypes[k])
                    y, ref = c(x), _eager(fulls[k], x)
                    res["calls"].append(_compared(label, k, y, ref))

        def raised(label, fn, *exc):
            try:
                fn()
            except exc as e:
                res["errors"][label] = f"{type(e).__name__}: {e}"
            else:
                res["errors"][label] = None

        with torch.no_grad():
            calls("bound")
            res["cast_slots"] = _cast_slots(models["bf16"])
            res["in_place"] = _in_place(models["fp32"])
            for i, method in enumerate(METHODS):
                new = {k: _new_full(f, seed + 10 * i + j) for j, (k, f) in enumerate(fulls.items())}
                # One checkpoint per rank, saved and loaded without dcp's collectives: its
                # planner exchanges plans by object collectives, which need numpy (absent
                # from CI's venv); the load into the bound shards is the same.
                ckpts = {k: f"{root}/ckpt_{method}_{k}_rank{rank}" for k in models}
                if method == "dcp":  # the checkpoints exist before the update
                    for k, m in models.items():
                        dcp.save(_dtensors(m, new[k], mesh), checkpoint_id=ckpts[k], no_dist=True)
                with torch_ce.updating_weights(params):
                    if rank == LATE:
                        time.sleep(DELAY)
                    for k, m in models.items():
                        _write(method, m, new[k], mesh, side, ckpts[k])
                fulls = new
                calls(method)

            # The version net: an update outside the protocol, no delay, on every rank.
            # Every rank's reads of the last calls are over first (the test's barrier).
            for k, method in (("fp32", "copy_"), ("bf16", "load_state_dict")):
                dist.barrier()
                fulls[k] = _new_full(fulls[k], seed + 77)
                _write(method, models[k], fulls[k], mesh, side, None)
                x = torch.randn(3, models[k].layers[0].in_features, generator=gen).to(dtypes[k])
                raised(f"unprotected {k} {method}", lambda: compiled[k](x), torch_ce.StaleWeightError)
            with torch_ce.updating_weights(params):  # the recovery: nothing more to write
                pass
            calls("after the net")

            # A block that raises on one rank raises on every rank; the weights stay
            # unreadable until an update completes.
            def failing_update():
                with torch_ce.updating_weights(params):
                    if rank == LATE:
                        time.sleep(DELAY)
                        raise ValueError("disk full")

            raised("block raised", failing_update, torch_ce.UpdateError, ValueError)
            x = torch.randn(3, 16, generator=gen)
            raised("call after the failed update", lambda: compiled["fp32"](x), torch_ce.StaleWeightError)
            with torch_ce.updating_weights(params):
                if rank == LATE:
                    time.sleep(DELAY)
                for k, m in models.items():
                    fulls[k] = _new_full(fulls[k], seed + 99)
                    _write("copy_", m, fulls[k], mesh, side, None)
            calls("after the failed update")

            # A partial update: rank 0 enters, its peer does not (timeout_s=3), then the
            # late rank's own attempt fails at once (the round was aborted), no hang.
            def partial():
                with torch_ce.updating_weights(params, timeout_s=3):
                    pass

            if rank != LATE:
                t0 = time.monotonic()
                raised("partial", partial, torch_ce.UpdateError)
                res["times"]["partial"] = time.monotonic() - t0
            dist.barrier()
            if rank == LATE:
                t0 = time.monotonic()
                raised("partial", partial, torch_ce.UpdateError)
                res["times"]["partial"] = time.monotonic() - t0
            dist.barrier()
    finally:
        torch_ce.disable()
    return res


def _cast_slots(model) -> int:
    """How many of ``model``'s shards have a cast slot (NOTE [cast slots])."""
    from torch_ce.runtime import windows as W

    locals_ = {id(p._local_tensor) for p in model.parameters()}
    return sum(1 for ref, entry, view, _ in list(W._cast.values())
               if isinstance(entry, W.Slot) and view is not None and id(ref()) in locals_)


def _in_place(model) -> int:
    from torch_ce.runtime import windows as W

    return sum(isinstance(W.lookup(p._local_tensor), W.Slot) for p in model.parameters())


def _assert_exact(rank, calls):
    bad = [c for c in calls if not c[2]]
    assert not bad, f"rank {rank}: calls that differ from eager on the current weights: {bad}"


def test_every_write_method_with_a_late_rank(tmp_path):
    res = run_ranks(_rank_methods, 2, seed_base(), str(tmp_path.resolve()), timeout=300, env=ENV)
    for rank, r in enumerate(res):
        _assert_exact(rank, r["calls"])
        labels = {c[0] for c in r["calls"]}
        assert set(METHODS) <= labels, labels
        assert r["in_place"] == 3 and r["cast_slots"] == 3, r  # every weight on the copy engines
        e = r["errors"]
        for k, name in (("fp32 copy_", "layers.0.weight"), ("bf16 load_state_dict", "layers.0.weight")):
            msg = e[f"unprotected {k}"]
            assert msg and msg.startswith("StaleWeightError") and "updating_weights" in msg and name in msg, (rank, msg)
        own = "ValueError: disk full" if rank == LATE else "UpdateError"
        assert e["block raised"] and e["block raised"].startswith(own), (rank, e["block raised"])
        if rank != LATE:
            assert "rank 1" in e["block raised"] and "disk full" in e["block raised"], e["block raised"]
        assert e["call after the failed update"] and "StaleWeightError" in e["call after the failed update"], e
        assert e["partial"] and e["partial"].startswith("UpdateError"), (rank, e["partial"])
        if rank != LATE:  # names the missing rank, after the timeout and not much later
            assert "[1]" in e["partial"], e["partial"]
            assert 3 <= r["times"]["partial"] < 20, r["times"]
        else:  # the late rank's attempt meets the aborted round at once
            assert r["times"]["partial"] < 3, r["times"]


# ---------------------------------------------------------------------------------------
# World 3, uneven shards, prefetch on
# ---------------------------------------------------------------------------------------

# Over 3 ranks: fp32 (6, 12) 2/2/2 rows, (5, 6) 2/2/1, (7, 5) 3/3/1, (2, 7) 1/1/0 (empty on
# rank 2); bf16 (10, 9) 4/4/2, (4, 10) 2/2/0, (3, 4) 1/1/1.
UNEVEN = {"fp32": [12, 6, 5, 7, 2], "bf16": [9, 10, 4, 3]}


def _rank_uneven(rank, world, seed, root):
    setup_compile(root, rank)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch_ce
    from torch_ce.runtime import prefetch

    mesh = init_device_mesh("cpu", (world,))
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    models, fulls = {}, {}
    for j, (k, dims) in enumerate(UNEVEN.items()):
        models[k], fulls[k] = _fsdp_chain(dims, seed + j, mesh, None if k == "fp32" else torch.bfloat16)
    params = [p for m in models.values() for p in m.parameters()]
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    res = dict(calls=[], stats=[])
    torch_ce.enable(transport="copy_engine", prefetch_next_call_mib=1.0)
    prefetch.reset_stats()
    try:
        compiled = {k: torch.compile(m, fullgraph=True) for k, m in models.items()}

        def calls(label, n=3):  # one model's calls in a row: each takes what the last parked
            for k, c in compiled.items():
                for _ in range(n):
                    x = torch.randn(2, UNEVEN[k][0], generator=gen).to(dtypes[k])
                    y, ref = c(x), _eager(fulls[k], x)
                    res["calls"].append(_compared(label, k, y, ref))
            res["stats"].append((label, dict(prefetch.stats)))

        with torch.no_grad():
            calls("bound")
            res["prefetch_members"] = {k: len(g.prefetch["members"]) for k, g in
                                       zip(UNEVEN, torch_ce.report.graphs, strict=True)}
            res["bound"] = sorted(w.status for w in torch_ce.explain().weights)
            for i, method in enumerate(("load_state_dict", ".data")):
                new = {k: _new_full(f, seed + 10 * i + j) for j, (k, f) in enumerate(fulls.items())}
                with torch_ce.updating_weights(params):
                    if rank == LATE:
                        time.sleep(DELAY)
                    for k, m in models.items():
                        _write(method, m, new[k], mesh, None, None)
                fulls = new
                calls(method)
            dist.barrier()
    finally:
        torch_ce.disable()
    return res


def test_uneven_world3_with_prefetch(tmp_path):
    res = run_ranks(_rank_uneven, 3, seed_base(), str(tmp_path.resolve()), timeout=600,
                    env=ENV_MANY)
    for rank, r in enumerate(res):
        _assert_exact(rank, r["calls"])
        assert r["bound"] == ["bound"] * 7, (rank, r["bound"])  # every weight on the copy engines
        assert all(n > 0 for n in r["prefetch_members"].values()), r["prefetch_members"]
        stats = dict(r["stats"])
        # Parked weights were taken between calls, every update dropped its parked set, and
        # no parked value was ever found stale (the protocol dropped them first).
        assert stats["bound"]["taken"] > 0, stats
        for before, after in (("bound", "load_state_dict"), ("load_state_dict", ".data")):
            assert stats[after]["dropped"] > stats[before]["dropped"], (before, after, stats)
            assert stats[after]["taken"] > stats[before]["taken"], (before, after, stats)
        assert stats[".data"]["stale"] == 0, stats


# ---------------------------------------------------------------------------------------
# MoE: routed experts on their own mesh
# ---------------------------------------------------------------------------------------


def _rank_moe(rank, world, seed, root):
    setup_compile(root, rank)
    import torch.distributed as dist

    import torch_ce
    import zoo_models as zm

    pdims = zm.parallel_dims(world, "ep", ep=2)  # dense weights over fsdp (4), experts over efsdp (2)
    # Three checkpoints of the same architecture: the weights of phase 0, 1 and 2.
    nets = [zm.build("qwen3_moe", pdims, None, train=False, seed=seed + i) for i in range(3)]
    net = nets[0]
    res = dict(meshes=sorted({v[0] for v in zm.placements(net).values()}))
    toks = [zm.tokens(zm.Dims().vocab, 2, 9, seed + 500 + 10 * rank + i) for i in range(2)]
    outs = []
    torch_ce.enable(transport="copy_engine")
    try:
        compiled = torch.compile(net)
        with torch.no_grad():
            outs.append([compiled(t[:, :-1]) for t in toks])
            res["bound"] = sorted({w.status for w in torch_ce.explain().weights})
            for phase, method in ((1, "load_state_dict"), (2, "copy_")):
                src = nets[phase]
                with torch_ce.updating_weights(net):
                    if rank == LATE:
                        time.sleep(DELAY)
                    if method == "load_state_dict":  # an eval of another checkpoint
                        net.load_state_dict(src.state_dict())
                    else:
                        for p, q in zip(net.parameters(), src.parameters(), strict=True):
                            p._local_tensor.copy_(q._local_tensor)
                outs.append([compiled(t[:, :-1]) for t in toks])
        dist.barrier()
    finally:
        torch_ce.disable()
    # The reference: each phase's weights loaded into one fresh (unbound) net, its calls
    # through the collective graph, compiled anew (one module: no recompiles).
    torch._dynamo.reset()
    ref_net = zm.build("qwen3_moe", pdims, None, train=False, seed=seed)  # phase 0's weights
    ref = torch.compile(ref_net)
    res["calls"] = []
    with torch.no_grad():
        for phase, got_phase in enumerate(outs):
            if phase:
                ref_net.load_state_dict(nets[phase].state_dict())
            for i, (t, got) in enumerate(zip(toks, got_phase, strict=True)):
                want = ref(t[:, :-1])
                res["calls"].append(_compared(f"phase {phase}", i, got, want))
    return res


@pytest.mark.slow  # ~2 minutes on 2 cores (4 ranks, two compiles each): CI's 2.11 leg runs it
def test_moe_experts_on_their_own_mesh(tmp_path):
    res = run_ranks(_rank_moe, 4, seed_base(), str(tmp_path.resolve()), timeout=600,
                    env=ENV_MANY)
    for rank, r in enumerate(res):
        _assert_exact(rank, r["calls"])
        assert len(r["calls"]) == 6, r["calls"]
        assert r["meshes"] == [("efsdp", "ep"), ("fsdp",)], r["meshes"]  # experts on their own mesh
        assert r["bound"] == ["bound"], r["bound"]


# ---------------------------------------------------------------------------------------
# Training: a rollback between steps
# ---------------------------------------------------------------------------------------

TRAIN_DIMS = [16, 32, 24, 8]


def _rank_rollback(rank, world, seed, root):
    setup_compile(root, rank)
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    import torch_ce

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(seed + 1000 + rank)  # different data per rank
    batches = [(torch.randn(4, TRAIN_DIMS[0], generator=gen).to(torch.bfloat16),
                torch.randn(4, TRAIN_DIMS[-1], generator=gen)) for _ in range(10)]

    def build():
        model, _ = _fsdp_chain(TRAIN_DIMS, seed, mesh, torch.bfloat16, train=True)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def steps(compiled, opt, chunk):
        losses = []
        for x, target in chunk:
            loss = (compiled(x).float() - target).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    torch_ce.enable(transport="copy_engine", reshard_after_forward=True)
    try:
        model, opt = build()
        compiled = torch.compile(model, fullgraph=True)
        steps(compiled, opt, batches[:3])
        ckpt = ({n: p._local_tensor.detach().clone() for n, p in model.named_parameters()},
                copy.deepcopy(opt.state_dict()))
        spike = steps(compiled, opt, batches[3:6])  # the steps a loss spike makes us undo
        with torch_ce.updating_weights(model):
            if rank == LATE:
                time.sleep(DELAY)
            for n, p in model.named_parameters():
                p._local_tensor.copy_(ckpt[0][n])
            opt.load_state_dict(copy.deepcopy(ckpt[1]))
        rolled = steps(compiled, opt, batches[6:])
        rolled_w = {n: p._local_tensor.detach().clone() for n, p in model.named_parameters()}

        # A fresh run from the same checkpoint: new model and optimizer, loaded before
        # their first call, compiled anew.
        torch._dynamo.reset()
        fresh_model, fresh_opt = build()
        with torch.no_grad():
            for n, p in fresh_model.named_parameters():
                p._local_tensor.copy_(ckpt[0][n])
        fresh_opt.load_state_dict(copy.deepcopy(ckpt[1]))
        fresh = steps(torch.compile(fresh_model, fullgraph=True), fresh_opt, batches[6:])
        fresh_w = {n: p._local_tensor for n, p in fresh_model.named_parameters()}
        staged = torch_ce.explain().weights
    finally:
        torch_ce.disable()
    return dict(spike=spike, rolled=rolled, fresh=fresh, staged=sorted({(w.status, bool(w.staged)) for w in staged}),
                same_weights=all(torch.equal(rolled_w[n], fresh_w[n]) for n in fresh_w))


def test_rollback_trains_as_a_fresh_run(tmp_path):
    res = run_ranks(_rank_rollback, 2, seed_base(), str(tmp_path.resolve()), timeout=300, env=ENV)
    for rank, r in enumerate(res):
        assert r["staged"] == [("bound", True)], (rank, r["staged"])  # the CE path, staging slots
        assert r["rolled"] == r["fresh"], f"rank {rank}: losses after the rollback\n{r['rolled']}\nfresh\n{r['fresh']}"
        assert r["same_weights"], f"rank {rank}: weights after the rollback differ from the fresh run's"
        assert len(set(r["rolled"])) == len(r["rolled"]), r  # it trains
