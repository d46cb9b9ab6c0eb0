"""torch_ce.fsdp2 on CPU ranks (gloo, host transport): FSDP2 ``fully_shard`` models'
all-gathers read from the windows, compared bit for bit with FSDP2's own path.

One run of 2 ranks holds every scenario (the imports and the process group are paid once);
each test asserts one scenario on every rank. Models (test/fsdp2_models.py): torchtitan's
Llama3 and Qwen3 (2 blocks, CPU dims, sharded by torchtitan's ``apply_fsdp_to_decoder``) and
a DiT (self-attn, cross-attn, MLP, adaLN). Fresh data per run (``seed_base``); one rank is
several seconds late in each protocol (the bind, a training step, the update, the
reduce-scatter). Training runs twice over: torch_ce's gathers with FSDP2's reduce-scatter,
and (``/ce_rs``: torchtitan's Llama3 and Qwen3, fp32 and bf16 ``param_dtype``) with the
copy-engine reduce-scatter too, on torchtitan's own op, ``PREMUL_SUM(1.0)``; explain()
must show every gathered and reduced byte of those runs on the copy engines.
World 3 (uneven shards: 64 rows over 3 ranks) is test_fsdp2_uneven_host.py; HSDP (2 x 2,
slow) is ``test_hsdp_2x2_serves_the_shard_dim`` below; a rank killed between training
steps (its peer's next gather an error within the bound, no /dev/shm segment left) is
``test_a_killed_rank_mid_training_is_an_error_and_leaves_no_segment``.
"""
from __future__ import annotations

import time

import pytest
import torch

from mp_harness import quiet_warnings, run_ranks, seed_base

WORLD = 2
LATE_S = 3.0
FAMILIES = ("llama3", "qwen3", "dit")
# torchtitan's models trained with torch_ce's gathers and reduce-scatter (world 2 here,
# world 3 in test_fsdp2_uneven_host.py): fp32 and bf16 param_dtype
TRAIN_CE_RS = [(f, dt) for f in ("llama3", "qwen3") for dt in (None, torch.bfloat16)]


def _dt(dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def _mesh(world, hsdp=False):
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:  # HSDP: shard within pairs, replicate across them
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _late(rank: int, late: bool = True) -> None:
    if rank == 1 and late:
        time.sleep(LATE_S)


def _rows_ok(rows) -> dict:
    import torch_ce

    cov = torch_ce.fsdp2.coverage(rows)
    return dict(share=cov["share"], statuses=sorted({r.status for r in rows}),
                reasons=sorted({r.reason for r in rows if r.reason}), calls=min(r.calls for r in rows),
                modules=[r.module for r in rows])


def infer(rank, world, seed, fam, param_dtype=None, compile_blocks=False, late=False, hsdp=False) -> dict:
    """FSDP2's own forward vs torch_ce's on the same weights, twice (the root keeps its
    unsharded parameters after the first no_grad forward)."""
    import fsdp2_models as M
    import torch_ce

    mesh = _mesh(world, hsdp)
    inp = M.inputs(fam, seed + 100 + rank)
    ref = M.build(fam, mesh, seed, param_dtype=param_dtype, train=False, compile_blocks=compile_blocks)
    with torch.no_grad():
        want = ref(*inp)
    m = M.build(fam, mesh, seed, param_dtype=param_dtype, train=False, compile_blocks=compile_blocks)
    _late(rank, late)  # the bind round waits for the late rank
    rows = torch_ce.fsdp2.enable(m)
    _late(rank, late)  # static reads wait for nothing: the peer's chunk is bound already
    with torch.no_grad():
        got = [m(*inp) for _ in range(2)]
    rows = torch_ce.fsdp2.rows()[-len(rows):]
    out = dict(equal=[torch.equal(want, g) for g in got], **_rows_ok(rows),
               how=sorted({r.how for r in rows}))
    torch_ce.fsdp2.disable(m)
    return out


def train(rank, world, seed, fam, param_dtype=None, steps=5, late=False, reduce_scatter="collective",
          hsdp=False, param_groups=False) -> dict:
    """5 AdamW steps of FSDP2's own path and of torch_ce's, from the same weights.

    ``reduce_scatter="copy_engine"``: torch_ce's run reduce-scatters the gradients on the
    copy-engine protocol too, with torchtitan's own op for the Llama3 / Qwen3 models
    (``PREMUL_SUM(1.0)``; the reference: gloo's sum of the premultiplied gradients, as NCCL
    runs it), and a late rank also waits inside a backward (the protocol's pushes). Beside
    the losses: what explain() says of the run (its rows and the reduce-scatter bytes).
    ``param_groups``: the DiT with two param groups per module (its biases on another
    process group: ``fsdp2_models.per_param_mesh``) and a gradient divide factor of 2
    under ``force_sum_reduction_for_comms`` (FSDP2 divides; the comm sums)."""
    import fsdp2_models as M
    import torch_ce
    from torch_ce.runtime import reduce_scatter as RS

    ce_rs = reduce_scatter == "copy_engine"
    premul = ce_rs and fam != "dit"
    mesh = _mesh(world, hsdp)
    losses = {}
    for which in ("fsdp2", "torch_ce"):
        kw = dict(shard_kw=dict(shard_placement_fn=M.per_param_mesh(world))) if param_groups else {}
        m = M.build(fam, mesh, seed, param_dtype=param_dtype, train=True, force_sum=not premul, **kw)
        if param_groups:
            from torch.distributed.fsdp import FSDPModule

            for mod in m.modules():
                if isinstance(mod, FSDPModule):
                    mod.set_gradient_divide_factor(2.0)
                    mod.set_force_sum_reduction_for_comms(True)
        if premul and which == "fsdp2":
            M.premul_reference(m)
        if which == "torch_ce":
            before = {k: (v.ce_bytes, v.collective_bytes) for k, v in RS.served.items()}
            rows = torch_ce.fsdp2.enable(m, reduce_scatter=reduce_scatter)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        out = []
        for step in range(steps):
            inp = M.inputs(fam, seed + 1000 * step + rank)
            if which == "torch_ce" and step == 2:
                _late(rank, late)  # its peer waits at the step words, then reads the new chunk
            loss = M.loss_of(fam, m(*inp), inp)
            if which == "torch_ce" and step == 3 and ce_rs:
                _late(rank, late)  # its peer waits in the reduce-scatter protocol
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[which] = out
    e = torch_ce.explain()
    rows = e.fsdp2[-len(rows):]  # this model's rows, as explain() holds them
    served = {}  # this run's reduce-scatter bytes, per FSDP2 group: (copy engine, collective)
    for k, v in e.reduce_scatter_coverage()["served"].items():
        ce0, coll0 = before.get(k, (0, 0))
        if v["ce_bytes"] - ce0 or v["collective_bytes"] - coll0:
            served[k] = (v["ce_bytes"] - ce0, v["collective_bytes"] - coll0, v["reason"])
    table = "\n".join(torch_ce.fsdp2.lines(rows))
    torch_ce.fsdp2.disable(m)
    return dict(losses=losses, **_rows_ok(rows), how=sorted({r.how for r in rows}),
                rs=sorted({r.reduce_scatter for r in rows}), served=served, table=table,
                ranks=[list(torch.distributed.get_process_group_ranks(g.process_group))
                       for g in torch_ce.fsdp2._entry(m).groups][:1])


def update(rank, world, seed, fam, param_dtype=None, path="load_state_dict", late=True) -> dict:
    """New weights through ``updating_weights`` with rank 1 late: the next forward equals
    FSDP2's own forward of a model built with them."""
    import fsdp2_models as M
    import torch_ce

    mesh = _mesh(world)
    inp = M.inputs(fam, seed + 200 + rank)
    m = M.build(fam, mesh, seed, param_dtype=param_dtype, train=False)
    torch_ce.fsdp2.enable(m)
    sharded = dict(m.named_parameters())  # the sharded DTensors (enable() resharded)
    with torch.no_grad():
        before = m(*inp)
    new = M.build(fam, mesh, seed + 7, param_dtype=param_dtype, train=False)
    sd = new.state_dict()
    _late(rank, late)
    with torch_ce.updating_weights(m):
        if path == "load_state_dict":
            m.load_state_dict(sd)
        else:  # copy_ into the local shards (the root's unsharded copy is then stale on FSDP2's path)
            for name, p in sharded.items():
                p.to_local().copy_(sd[name].to_local())
    with torch.no_grad():
        got, want = m(*inp), new(*inp)
    torch_ce.fsdp2.disable(m)
    return dict(equal=torch.equal(got, want), changed=not torch.equal(before, got))


def stale(rank, world, seed) -> dict:
    """A write outside the protocol (rank 0 writes, rank 1 does not) is a StaleWeightError
    at rank 0's next forward, whichever way it wrote; writing again inside the protocol
    makes every rank exact."""
    import fsdp2_models as M
    import torch_ce

    mesh = _mesh(world)
    inp = M.inputs("dit", seed + 300 + rank)
    m = M.build("dit", mesh, seed, train=False)
    torch_ce.fsdp2.enable(m)
    with torch.no_grad():
        m(*inp)
    new = M.build("dit", mesh, seed + 9, train=False)
    sd = new.state_dict()
    key = "blocks.1.mlp_in.weight"
    raised = {}
    for path in ("state_dict().to_local().copy_", "load_state_dict", "to_local().copy_"):
        if rank == 0:
            with torch.no_grad():
                if path == "load_state_dict":
                    m.load_state_dict(sd)
                elif path == "to_local().copy_":
                    m.get_parameter("blocks.0.qkv.weight").to_local().add_(1.0)
                else:
                    m.state_dict()[key].to_local().copy_(sd[key].to_local())
            try:
                with torch.no_grad():
                    m(*inp)
                raised[path] = ""
            except torch_ce.StaleWeightError as e:
                raised[path] = str(e)
        with torch_ce.updating_weights(m):
            m.load_state_dict(sd)
        with torch.no_grad():
            raised[path + "/exact after"] = torch.equal(m(*inp), new(*inp))
    torch_ce.fsdp2.disable(m)
    return raised


def timeout(rank, world, seed) -> dict:
    """A peer that never runs the gather: a StepWordTimeout within the bound, naming it; the
    group refuses every later call (no hang, no stale read); after disable() and enable()
    on every rank the next forward is exact."""
    import fsdp2_models as M
    import torch_ce

    mesh = _mesh(world)
    m = M.build("dit", mesh, seed, train=True)
    torch_ce.fsdp2.enable(m, timeout_s=1.5)
    inp = M.dit_inputs(seed + rank)
    errors = []
    if rank == 0:  # rank 1 never arrives
        for _ in range(2):
            t0 = time.monotonic()
            try:
                m(*inp)
            except Exception as e:  # noqa: BLE001 (reported to the test)
                errors.append((type(e).__name__, str(e), time.monotonic() - t0))
    # Recovery: every rank disables and enables again; the next forward is exact.
    import torch.distributed as dist

    dist.barrier()
    torch_ce.fsdp2.disable(m)
    torch_ce.fsdp2.enable(m, timeout_s=30.0)
    ref = M.build("dit", mesh, seed, train=True)
    with torch.no_grad():
        got, want = m(*inp), ref(*inp)
    return dict(errors=errors, recovered=bool(torch.equal(got, want)))


class _OwnGather:
    """A user's custom all-gather (FSDP2's AllGather protocol)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        import torch.distributed as dist

        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def refusals(rank, world, seed) -> dict:
    """What keeps FSDP2's own all-gather, with the reason, and still gives its results; and
    a module with several param groups, which is served."""
    import fsdp2_models as M
    import torch_ce
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    try:  # per-parameter meshes (several param groups on one module): torch >= 2.12
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    except ImportError:
        ShardPlacementResult = None
    from torch.distributed.tensor import Shard

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    mesh = _mesh(world)
    # The same ranks over another process group: a second param group per block.
    other = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu")
    other_info = _get_mesh_info(other, None) if ShardPlacementResult is not None else None
    inp = M.dit_inputs(seed + 400 + rank)
    out = {}

    def per_param_mesh(p):
        return ShardPlacementResult(placement=Shard(0), mesh_info=other_info) if p.dim() == 1 else None

    cases = {
        "cpu offload": dict(offload_policy=CPUOffloadPolicy(pin_memory=False)),
        "param groups": dict(shard_placement_fn=per_param_mesh),
        "custom comm": {},
    }
    if ShardPlacementResult is None:
        del cases["param groups"]
    for case, kw in cases.items():
        models = []
        for _ in range(2):
            torch.manual_seed(seed)
            net = M.DiT().requires_grad_(False)
            for b in net.blocks:
                fully_shard(b, mesh=mesh, **kw)
            fully_shard(net, mesh=mesh, **({} if case == "param groups" else kw))
            models.append(net)
        ref, m = models
        if case == "custom comm":
            m.blocks[0].set_custom_all_gather(_OwnGather())
        try:
            rows = torch_ce.fsdp2.enable(m)
        except Exception as e:  # noqa: BLE001 (reported to the test)
            out[case] = dict(error=f"{type(e).__name__}: {e}")
            continue
        with torch.no_grad():
            equal = torch.equal(ref(*inp), m(*inp))
        out[case] = dict(equal=equal, rows=[(r.module, r.status, r.reason) for r in rows],
                         table="\n".join(torch_ce.fsdp2.lines(rows)))
        torch_ce.fsdp2.disable(m)
    return out


def hsdp(rank, world, seed) -> dict:
    """HSDP (a 2-D mesh, ``replicate`` x ``shard``): FSDP2 gathers over the shard dim, so
    torch_ce binds each group over its shard pair and serves it there; the reduce-scatter
    within the pair runs on the protocol, the all-reduce across pairs stays FSDP2's."""
    quiet_warnings()
    torch.set_num_threads(1)
    return {
        "infer/llama3": infer(rank, world, seed, "llama3", late=True, hsdp=True),
        "infer/dit/bf16": infer(rank, world, seed, "dit", torch.bfloat16, hsdp=True),
        "train/llama3/fp32/ce_rs": train(rank, world, seed, "llama3", reduce_scatter="copy_engine",
                                         late=True, hsdp=True),
        "train/qwen3/bf16/ce_rs": train(rank, world, seed, "qwen3", torch.bfloat16,
                                        reduce_scatter="copy_engine", hsdp=True),
    }


def _rank_all(rank, world, seed, cache_dir):
    from mp_harness import setup_compile

    setup_compile(cache_dir, rank, fx_cache=True)
    quiet_warnings()
    res, times = {}, {}

    def run(name, fn, *args, **kw):
        t0 = time.monotonic()
        res[name] = fn(rank, world, seed, *args, **kw)
        times[name] = round(time.monotonic() - t0, 1)

    # One rank late in each protocol: the bind, the step words, the update.
    run("infer/llama3", infer, "llama3", late=True)
    run("infer/qwen3", infer, "qwen3")
    run("infer/dit", infer, "dit")
    run("infer/llama3/bf16", infer, "llama3", torch.bfloat16)
    run("infer/dit/bf16", infer, "dit", torch.bfloat16)
    run("infer/dit/compiled", infer, "dit", compile_blocks=True)
    run("train/llama3/fp32", train, "llama3", late=True)
    run("train/qwen3/bf16", train, "qwen3", torch.bfloat16)
    run("train/dit/fp32", train, "dit")
    run("train/dit/bf16", train, "dit", torch.bfloat16)
    for fam, dt in TRAIN_CE_RS:  # gathers and reduce-scatters on the copy engines
        run(f"train/{fam}/{_dt(dt)}/ce_rs", train, fam, dt, reduce_scatter="copy_engine",
            late=fam == "llama3" and dt is None)
    if has_per_param_meshes():  # torch >= 2.12
        run("train/dit/param_groups/ce_rs", train, "dit", reduce_scatter="copy_engine", param_groups=True,
            late=True)
    run("update/llama3/load_state_dict", update, "llama3")
    run("update/dit/bf16/copy_", update, "dit", torch.bfloat16, path="copy_", late=False)
    run("timeout", timeout)
    run("stale", stale)
    run("refusals", refusals)
    res["times"] = times
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("fsdp2_inductor"))
    return run_ranks(_rank_all, WORLD, seed_base(), cache, timeout=600)


@pytest.mark.parametrize("case", [*(f"infer/{f}" for f in FAMILIES), "infer/llama3/bf16",
                                  "infer/dit/bf16", "infer/dit/compiled"])
def test_inference_equals_fsdp2(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["equal"] == [True, True], (rank, r)
        assert r["statuses"] == ["bound"] and r["share"] == 1.0, (rank, r)  # 100% on the copy engines
        assert r["calls"] >= 1, (rank, r)
        assert r["how"] == (["cast slot (bfloat16)"] if "bf16" in case else ["in place"]), (rank, r)


CE_RS_CASES = [f"train/{f}/{_dt(dt)}/ce_rs" for f, dt in TRAIN_CE_RS]


@pytest.mark.parametrize("case", ["train/llama3/fp32", "train/qwen3/bf16", "train/dit/fp32", "train/dit/bf16",
                                  *CE_RS_CASES, "train/dit/param_groups/ce_rs"])
def test_training_losses_bit_identical(results, case):
    if case not in results[0]:
        assert not has_per_param_meshes()  # torch 2.11: no way to make two groups
        pytest.skip("torch < 2.12: no per-parameter meshes")
    if "param_groups" in case:  # two param groups per module (the root and 2 blocks), each its own row
        assert all(sum(m.endswith("[1]") for m in res[case]["modules"]) == 3 for res in results), \
            results[0][case]["modules"]
    for rank, res in enumerate(results):
        r = res[case]
        assert r["losses"]["torch_ce"] == r["losses"]["fsdp2"], (rank, r["losses"])
        assert r["statuses"] == ["bound"] and r["share"] == 1.0, (rank, r)
        assert r["how"] == ["staged (training)"] and r["calls"] >= 5, (rank, r)
        check_explained(r, case.endswith("/ce_rs"), rank)
    assert results[0][case]["losses"]["fsdp2"] != results[1][case]["losses"]["fsdp2"]  # each rank its data


def check_explained(r: dict, ce_rs: bool, rank: int) -> None:
    """explain() of a training run: 100% of the gathered bytes on the copy engines and,
    with the copy-engine reduce-scatter, every group's row saying so and every reduced
    byte of the run on it (none on the collective); without it, none on the protocol."""
    assert "fsdp2 coverage: 100.0% of" in r["table"], (rank, r["table"])
    if not ce_rs:
        assert r["rs"] == [""] and not r["served"], (rank, r["rs"], r["served"])
        return
    assert r["rs"] == ["copy engine"], (rank, r["rs"], r["table"])
    assert "reduce-scatter: copy engine" in r["table"], (rank, r["table"])
    assert len(r["served"]) == r["table"].count("reduce-scatter: copy engine"), (rank, r["served"])
    for name, (ce, coll, why) in r["served"].items():
        assert ce > 0 and coll == 0, (rank, name, ce, coll, why)


@pytest.mark.parametrize("case", ["update/llama3/load_state_dict", "update/dit/bf16/copy_"])
def test_update_with_a_late_rank_is_exact(results, case):
    for rank, res in enumerate(results):
        assert res[case] == dict(equal=True, changed=True), (rank, res[case])


def test_unprotected_write_is_a_stale_weight_error(results):
    r0, r1 = results[0]["stale"], results[1]["stale"]
    for path in ("state_dict().to_local().copy_", "load_state_dict", "to_local().copy_"):
        assert "outside torch_ce.updating_weights" in r0[path], (path, r0[path])
        assert r0[path + "/exact after"] is True and r1[path + "/exact after"] is True, (path, r0, r1)


def test_a_peer_that_never_arrives_is_an_error_not_a_hang(results):
    (first, why, waited), (second, why2, _) = results[0]["timeout"]["errors"]
    assert first == "StepWordTimeout" and "rank 1 did not stage the chunk of gather 1" in why, why
    assert 1.5 <= waited < 10, waited
    assert "an earlier gather failed on this rank" in why2, why2
    assert all(r["timeout"]["recovered"] for r in results), [r["timeout"] for r in results]


def _killed_mid_training(rank, world, seed, out_dir):
    """Rank 1 dies (``os._exit``) after a training step; rank 0's next forward waits at
    its step words: an error within the bound naming rank 1, never a hang. Rank 0 reports
    in a file (the harness fails the run: a rank died) and exits too."""
    import json
    import os

    import fsdp2_models as M
    import torch_ce

    torch_ce.config.update(shm_prefix=f"tcef{seed}_")
    m = M.build("dit", _mesh(world), seed, train=True)
    torch_ce.fsdp2.enable(m, timeout_s=2.0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    inp = M.dit_inputs(seed + rank)
    loss = M.loss_of("dit", m(*inp), inp)
    loss.backward()
    opt.step()
    first = loss.item()
    if rank == 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        m(*inp)
        err = "no error"
    except Exception as e:  # noqa: BLE001 (reported to the test)
        err = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, "survivor"), "w") as f:
        json.dump({"error": err, "took": time.monotonic() - t0, "first": first}, f)
    os._exit(0)


def test_a_killed_rank_mid_training_is_an_error_and_leaves_no_segment(tmp_path):
    import glob
    import json

    seed = seed_base()
    with pytest.raises(pytest.fail.Exception, match="exited with code 0 without reporting"):
        run_ranks(_killed_mid_training, WORLD, seed, str(tmp_path), timeout=120)
    survivor = json.loads((tmp_path / "survivor").read_text())
    assert survivor["error"].startswith("StepWordTimeout"), survivor
    assert "rank 1 did not stage the chunk of gather" in survivor["error"], survivor
    assert survivor["took"] < 2.0 + 3.0, survivor
    assert not glob.glob(f"/dev/shm/tcef{seed}_*"), glob.glob(f"/dev/shm/tcef{seed}_*")


def has_per_param_meshes() -> bool:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult  # noqa: F401
    except ImportError:
        return False
    return True


def test_refusals_keep_fsdp2_and_say_why(results):
    want = {"cpu offload": "CPU offload", "custom comm": "a custom all-gather is set"}
    for rank, res in enumerate(results):
        if "param groups" not in res["refusals"]:
            assert not has_per_param_meshes()  # torch 2.11: no way to make two groups
        else:  # a module with several param groups: each group served (its own comm)
            r = res["refusals"]["param groups"]
            assert "error" not in r and r["equal"] is True, (rank, r)
            assert {row[1] for row in r["rows"]} == {"bound"}, (rank, r["rows"])
            assert sum(row[0].endswith("[1]") for row in r["rows"]) == 2, (rank, r["rows"])  # 2 blocks' biases
        for case, text in want.items():
            r = res["refusals"][case]
            assert "error" not in r, (rank, case, r)
            assert r["equal"] is True, (rank, case, r)
            refused = [row for row in r["rows"] if row[1] == "refused"]
            assert refused and all(text in row[2] for row in refused), (rank, case, r["rows"])
            assert text in r["table"], r["table"]


class _Stub:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_integer_reshard_after_forward_is_refused():
    """An integer reshard_after_forward (a post-forward mesh: 2 of 4 ranks, say) keeps FSDP2's
    all-gather: its backward gathers over another group. One process: the verdict only
    reads the param group's facts (a real one needs 4 ranks)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
    from torch_ce.fsdp2 import groups

    fp = _Stub(offload_to_cpu=False, _sharded_local_tensor=torch.zeros(2))
    pg = _Stub(fsdp_params=[fp], _all_gather_process_group=_Stub(size=lambda: 4),
               offload_policy=None, _use_post_forward_mesh=True, _all_gather_comm=DefaultAllGather())
    g = groups.judge("layers.0", None, None, pg, "auto")
    assert "integer reshard_after_forward" in g.reason and not g.mode


@pytest.mark.slow  # world 4 on 2 cores
def test_hsdp_2x2_serves_the_shard_dim():
    out = run_ranks(hsdp, 4, seed_base(), timeout=300)
    for rank, res in enumerate(out):
        for case in ("infer/llama3", "infer/dit/bf16"):
            r = res[case]
            assert r["equal"] == [True, True], (rank, case, r)
            assert r["statuses"] == ["bound"] and r["share"] == 1.0, (rank, case, r)
        for case in ("train/llama3/fp32/ce_rs", "train/qwen3/bf16/ce_rs"):
            r = res[case]
            assert r["losses"]["torch_ce"] == r["losses"]["fsdp2"], (rank, case, r["losses"])
            assert r["statuses"] == ["bound"] and r["calls"] >= 5, (rank, case, r)
            assert r["ranks"] == [[0, 1] if rank < 2 else [2, 3]], (rank, r["ranks"])  # the shard pair
            check_explained(r, True, rank)
    # each replica its data: the all-reduce across pairs had something to do
    assert out[0]["train/llama3/fp32/ce_rs"]["losses"]["fsdp2"] != out[2]["train/llama3/fp32/ce_rs"]["losses"]["fsdp2"]
