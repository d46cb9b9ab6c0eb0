"""torch_ce.fsdp2 under what FSDP2 and its users do to a model's parameters (gloo, 2 ranks,
host transport): paths that give FSDP2's sharded parameters new tensors
(``load_state_dict(assign=True)``, ``to_empty()`` + ``reset_parameters()``,
``.half().float()``, ``.to(torch.float64).to(torch.float32)``, ``.to("cpu")``), each inside
``torch_ce.updating_weights`` and outside it, on every rank.

Every output is compared bit for bit with FSDP2's own (a model built the same way, the same
path applied, torch_ce not enabled on it), on fresh random weights and inputs each run.
Inside the protocol the next forward equals FSDP2's; outside it the writing rank raises
``StaleWeightError`` before it reads anything (a path that leaves the data where it was,
``.to("cpu")`` on a CPU model, is no error and stays exact), and an ``updating_weights``
block, even empty, adopts the new tensors (NOTE [FSDP2 parameters that move] in
torch_ce/fsdp2/chunks.py). Static groups in place (fp32) and cast slots (bf16
``param_dtype``); one training group (staged: it reads FSDP2's input of each call).
"""
from __future__ import annotations

import pytest
import torch

from mp_harness import quiet_warnings, run_ranks, seed_base

WORLD = 2
PATHS = ("assign", "to_empty", "half_float", "f64_f32", "to_cpu")


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _apply(model, path: str, seed: int, new_sd=None) -> None:
    """The user's path on ``model`` (the same on torch_ce's model and the reference)."""
    with torch.no_grad():
        if path == "assign":
            model.load_state_dict(new_sd, assign=True)
        elif path == "to_empty":
            model.to_empty(device="cpu")
            torch.manual_seed(seed)  # the same draws on both models
            for mod in model.modules():
                if mod is not model and hasattr(mod, "reset_parameters"):
                    mod.reset_parameters()
        elif path == "half_float":
            model.half().float()
        elif path == "f64_f32":
            model.to(torch.float64).to(torch.float32)
        elif path == "to_cpu":
            model.to("cpu")
        else:
            raise ValueError(path)


def _case(rank, world, seed, path, inside, param_dtype=None) -> dict:
    """One path on torch_ce's model and on FSDP2's: the forwards after it, compared."""
    import fsdp2_models as M
    import torch_ce

    mesh = _mesh(world)
    inp = M.inputs("dit", seed + 10 + rank)
    m = M.build("dit", mesh, seed, param_dtype=param_dtype, train=False)
    ref = M.build("dit", mesh, seed, param_dtype=param_dtype, train=False)
    torch_ce.fsdp2.enable(m)
    with torch.no_grad():
        first = torch.equal(m(*inp), ref(*inp))  # the root keeps its unsharded copy after it
    sd_m = sd_ref = None
    if path == "assign":  # each model its own new tensors (assign aliases them)
        sd_m = M.build("dit", mesh, seed + 7, param_dtype=param_dtype, train=False).state_dict()
        sd_ref = M.build("dit", mesh, seed + 7, param_dtype=param_dtype, train=False).state_dict()
    _apply(ref, path, seed + 3, sd_ref)
    out = dict(first=first, error="")
    if inside:
        with torch_ce.updating_weights(m):
            _apply(m, path, seed + 3, sd_m)
    else:
        _apply(m, path, seed + 3, sd_m)
        try:
            with torch.no_grad():
                m(*inp)
        except torch_ce.StaleWeightError as e:
            out["error"] = str(e)
        with torch_ce.updating_weights(m):  # every rank: adopts what was given outside
            pass
    with torch.no_grad():
        want = ref(*inp)
        out["equal"] = [torch.equal(m(*inp), want) for _ in range(2)]
    # The net watches the new tensors: a write outside the protocol is an error again
    # (after the peer's reads: an in-place write races with them, which is why it raises).
    torch.distributed.barrier()
    with torch.no_grad():
        m.get_parameter("blocks.1.mlp_in.weight").to_local().add_(1.0)
    try:
        with torch.no_grad():
            m(*inp)
        out["later_write"] = ""
    except torch_ce.StaleWeightError as e:
        out["later_write"] = str(e)
    with torch_ce.updating_weights(m):
        m.load_state_dict(ref.state_dict())
    with torch.no_grad():
        out["equal_after"] = torch.equal(m(*inp), ref(*inp))
    out["bound"] = sorted({r.status for r in torch_ce.fsdp2.rows()[-len(torch_ce.fsdp2._entry(m).groups):]})
    torch_ce.fsdp2.disable(m)
    return out


def _one_rank_writes(rank, world, seed) -> dict:
    """Rank 0 alone loads new tensors with assign=True outside the protocol: it raises;
    rank 1, which changed nothing, reads rank 0's old chunk and computes the old model's
    output exactly. Then both load them inside updating_weights: exact."""
    import fsdp2_models as M
    import torch_ce

    mesh = _mesh(world)
    inp = M.inputs("dit", seed + 20 + rank)
    m = M.build("dit", mesh, seed, train=False)
    with torch.no_grad():  # FSDP2's own outputs first: its gathers are collectives
        want_old = M.build("dit", mesh, seed, train=False)(*inp)
        want_new = M.build("dit", mesh, seed + 5, train=False)(*inp)
    sd = M.build("dit", mesh, seed + 5, train=False).state_dict()
    torch_ce.fsdp2.enable(m)
    out = dict(error="")
    if rank == 0:
        m.load_state_dict(sd, assign=True)
    try:
        with torch.no_grad():
            out["equal_old"] = torch.equal(m(*inp), want_old)
    except torch_ce.StaleWeightError as e:
        out["error"] = str(e)
    with torch_ce.updating_weights(m):
        m.load_state_dict(sd, assign=True)
    with torch.no_grad():
        out["equal_new"] = torch.equal(m(*inp), want_new)
    torch_ce.fsdp2.disable(m)
    return out


def _training(rank, world, seed) -> dict:
    """A training group stages FSDP2's own input at every call: new tensors given outside
    the protocol are gathered as they are, no error, losses equal FSDP2's."""
    import fsdp2_models as M
    import torch_ce

    mesh = _mesh(world)
    losses = {}
    for which in ("fsdp2", "torch_ce"):
        m = M.build("dit", mesh, seed, train=True)
        if which == "torch_ce":
            torch_ce.fsdp2.enable(m)
        out = []
        for step, path in enumerate(("assign", "f64_f32", "to_cpu")):
            sd = M.build("dit", mesh, seed + 11 + step, train=True).state_dict() if path == "assign" else None
            _apply(m, path, seed, sd)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)  # the parameters may be new objects
            inp = M.inputs("dit", seed + 100 * step + rank)
            loss = M.loss_of("dit", m(*inp), inp)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[which] = out
        if which == "torch_ce":
            torch_ce.fsdp2.disable(m)
    return losses


def _rank_all(rank, world, seed) -> dict:
    quiet_warnings()
    torch.set_num_threads(1)
    res = {}
    for path in PATHS:
        for inside in (True, False):
            res[f"{path}/{'inside' if inside else 'outside'}"] = _case(rank, world, seed, path, inside)
    for path in ("assign", "to_empty"):
        for inside in (True, False):
            res[f"{path}/bf16/{'inside' if inside else 'outside'}"] = _case(
                rank, world, seed, path, inside, torch.bfloat16)
    res["one rank writes"] = _one_rank_writes(rank, world, seed)
    res["training"] = _training(rank, world, seed)
    return res


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank_all, WORLD, seed_base(), timeout=600)


CASES = [f"{p}/{w}" for p in PATHS for w in ("inside", "outside")] + \
        [f"{p}/bf16/{w}" for p in ("assign", "to_empty") for w in ("inside", "outside")]


@pytest.mark.parametrize("case", CASES)
def test_every_rank_equals_fsdp2_after_the_path(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["first"] is True, (rank, case, r)
        assert r["equal"] == [True, True], (rank, case, r)
        assert r["equal_after"] is True, (rank, case, r)
        assert r["bound"] == ["bound"], (rank, case, r)


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("/outside")])
def test_outside_the_protocol_the_writing_rank_raises_before_reading(results, case):
    for rank, res in enumerate(results):
        err = res[case]["error"]
        if case.startswith("to_cpu/"):  # the data stayed where it was: nothing to refuse
            assert err == "", (rank, case, err)
            continue
        assert "were given new tensors outside torch_ce.updating_weights" in err, (rank, case, err)
        assert "<root>" in err or "blocks." in err, (rank, case, err)


@pytest.mark.parametrize("case", CASES)
def test_the_net_watches_the_new_tensors(results, case):
    for rank, res in enumerate(results):
        assert "outside torch_ce.updating_weights" in res[case]["later_write"], (rank, case, res[case])


def test_one_rank_writing_outside_raises_there_and_the_peer_reads_the_old_weights(results):
    r0, r1 = results[0]["one rank writes"], results[1]["one rank writes"]
    assert "were given new tensors outside" in r0["error"], r0
    assert r1["error"] == "" and r1["equal_old"] is True, r1
    assert r0["equal_new"] is True and r1["equal_new"] is True, (r0, r1)


def test_training_groups_gather_what_fsdp2_holds(results):
    for rank, res in enumerate(results):
        assert res["training"]["torch_ce"] == res["training"]["fsdp2"], (rank, res["training"])
