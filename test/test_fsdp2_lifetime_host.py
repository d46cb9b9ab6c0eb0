"""What an FSDP2 model enabled with torch_ce.fsdp2 leaves behind (gloo, 2 ranks, host
transport): nothing once it is disabled and dropped, or dropped without disable().

One run: a model that stays enabled throughout (its outputs must stay exact while others
come and go), then 20 enable/disable cycles (inference models in place and as bf16 cast
slots, training models with the copy-engine reduce-scatter: a step each), then 5 models
dropped while enabled. At the end: every one of them is gone (weak references), the
window bytes ``explain()`` shows are what the kept model alone had, explain() lists the
kept model only, the process's RSS grew by less than a bound, and every output compared
bit for bit with FSDP2's own (torch_ce not enabled). NOTE [windows of one owner] in
torch_ce/runtime/window_pools.py, NOTE [what an enabled model holds] in torch_ce/fsdp2.
Also: the comms are classes of torch_ce.fsdp2 with a readable repr; and explain()'s FSDP2
totals count every call a training step makes (forward, backward, prefetch: each
all-gather's output bytes, each reduce-scatter's input bytes), on the copy engines and on
the collective by reason, equal to what a meter around every comm FSDP2 calls measured
(NOTE [FSDP2 bytes as run] in torch_ce/fsdp2/report.py).
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from mp_harness import quiet_warnings, run_ranks, seed_base

WORLD = 2
CYCLES = 20
DROPPED = 5
RSS_SLACK_MB = 40


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _rss_mb() -> float:
    """This process's RSS, after glibc handed back what it could (its arenas keep freed
    blocks otherwise: the RSS then follows the allocator, not what is alive)."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _window_bytes() -> int:
    import torch_ce

    return sum(w.nbytes for w in torch_ce.explain().windows)


def _comms(model) -> dict:
    """The all-gather and reduce-scatter comms FSDP2 calls on ``model``'s first block."""
    pg = model.blocks[0]._get_fsdp_state()._fsdp_param_group
    out = {}
    for kind, comm in (("all_gather", pg._all_gather_comm), ("reduce_scatter", pg._reduce_scatter_comm)):
        out[kind] = dict(module=type(comm).__module__, name=type(comm).__qualname__, repr=repr(comm))
    return out


class _OwnGather:
    """A user's custom all-gather: torch_ce refuses the group, FSDP2 runs this one."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        import torch.distributed as dist

        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _Meter:
    """Around whatever comm FSDP2 calls: the bytes of every call (the test's measure)."""

    def __init__(self, inner, box, key):
        self.inner, self.box, self.key = inner, box, key

    def allocate(self, *args, **kwargs):
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, **kw):
        t = kw["output_tensor"] if self.key == "ag" else kw["input_tensor"]
        self.box[self.key] += t.numel() * t.element_size()
        self.box[self.key + "_calls"] += 1
        return self.inner(**kw)


def _totals(rank, world, seed, reduce_scatter) -> dict:
    """Two training steps of a DiT whose first block keeps a custom all-gather: explain()'s
    FSDP2 totals against a meter around every comm FSDP2 calls."""
    import fsdp2_models as M
    import torch_ce

    gc.collect()  # the models of earlier runs gone: explain() holds this one's rows only
    mesh = _mesh(world)
    m = M.build("dit", mesh, seed, train=True)
    m.blocks[0].set_custom_all_gather(_OwnGather())
    torch_ce.fsdp2.enable(m, reduce_scatter=reduce_scatter)
    box = dict(ag=0, rs=0, ag_calls=0, rs_calls=0)
    for mod in m.modules():
        st = getattr(mod, "_get_fsdp_state", None)
        pg = st()._fsdp_param_group if st is not None and type(mod).__name__.startswith("FSDP") else None
        if pg is not None:
            pg._all_gather_comm = _Meter(pg._all_gather_comm, box, "ag")
            pg._reduce_scatter_comm = _Meter(pg._reduce_scatter_comm, box, "rs")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    before = torch_ce.explain().as_dict()["fsdp2_totals"]
    for step in range(2):
        inp = M.inputs("dit", seed + 50 * step + rank)
        loss = M.loss_of("dit", m(*inp), inp)
        loss.backward()
        opt.step()
        opt.zero_grad()
    e = torch_ce.explain()
    after = e.as_dict()["fsdp2_totals"]
    out = dict(before=before, after=after, measured=box, static=sum(r.gathered_bytes for r in e.fsdp2),
               table="\n".join(torch_ce.fsdp2.lines(e.fsdp2)))
    torch_ce.fsdp2.disable(m)
    return out


def _lifetimes(rank, world, seed) -> dict:
    import fsdp2_models as M
    import torch_ce
    from torch_ce.fsdp2 import reduce_scatter as fsdp2_rs
    from torch_ce.runtime import window_pools as WP

    quiet_warnings()
    torch.set_num_threads(1)
    totals = {rs: _totals(rank, world, seed, rs) for rs in ("copy_engine", "collective")}
    gc.collect()
    mesh = _mesh(world)
    inp = M.inputs("dit", seed + 10 + rank)
    kept = M.build("dit", mesh, seed + 1, train=False)
    kept_ref = M.build("dit", mesh, seed + 1, train=False)
    with torch.no_grad():
        kept_want = kept_ref(*inp)
    torch_ce.fsdp2.enable(kept)
    kept_rows = len(torch_ce.fsdp2.rows())
    gc.collect()
    base = _window_bytes()
    out = dict(totals=totals, base=base, base_windows=WP.open_count(), kept_rows=kept_rows, during=[],
               after=[], kept_exact=[], exact=[], comms=None)
    refs = []
    rss = []
    for i in range(CYCLES):
        kind = ("infer", "infer/bf16", "train")[i % 3]
        dt = torch.bfloat16 if kind == "infer/bf16" else None
        m = M.build("dit", mesh, seed + 100 + i, param_dtype=dt, train=kind == "train")
        torch_ce.fsdp2.enable(m, reduce_scatter="copy_engine" if kind == "train" else "collective")
        if kind == "train":
            if out["comms"] is None:
                out["comms"] = _comms(m)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            loss = M.loss_of("dit", m(*inp), inp)
            loss.backward()
            opt.step()
            del opt, loss
        else:
            ref = M.build("dit", mesh, seed + 100 + i, param_dtype=dt, train=False)
            with torch.no_grad():
                out["exact"].append(torch.equal(m(*inp), ref(*inp)))
        out["during"].append(_window_bytes())
        torch_ce.fsdp2.disable(m)
        if kind != "train":  # disabled: FSDP2's own gathers of weights that left the window
            with torch.no_grad():
                out["exact"].append(torch.equal(m(*inp), ref(*inp)))
            del ref
        refs.append(weakref.ref(m))
        del m
        gc.collect()
        out["after"].append(_window_bytes())
        with torch.no_grad():  # the kept model reads on, exactly, while others go
            out["kept_exact"].append(torch.equal(kept(*inp), kept_want))
        rss.append(_rss_mb())
    for i in range(DROPPED):  # enabled, used, dropped without disable()
        m = M.build("dit", mesh, seed + 200 + i, train=False)
        torch_ce.fsdp2.enable(m)
        with torch.no_grad():
            m(*inp)
        out["during"].append(_window_bytes())
        refs.append(weakref.ref(m))
        del m
        gc.collect()
        out["after"].append(_window_bytes())
        with torch.no_grad():
            out["kept_exact"].append(torch.equal(kept(*inp), kept_want))
    gc.collect()
    out["alive"] = sum(r() is not None for r in refs)
    out["rows"] = len(torch_ce.fsdp2.rows())
    out["explain_rows"] = len(torch_ce.explain().fsdp2)
    out["rs_installed"] = sum(isinstance(o, fsdp2_rs.CopyEngineReduceScatter) for o in gc.get_objects())
    out["open_windows"] = WP.open_count()
    out["rss"] = [max(rss[:3]), _rss_mb()]  # the first cycles of each kind, and the end
    out["rss_all"] = [round(x) for x in rss]
    out["end"] = _window_bytes()
    torch_ce.fsdp2.disable(kept)
    kept_ref_gone = weakref.ref(kept)
    del kept
    gc.collect()
    out["kept_gone"] = kept_ref_gone() is None
    out["final"] = _window_bytes()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_lifetimes, WORLD, seed_base(), timeout=600)


def test_no_model_stays_alive(results):
    for rank, r in enumerate(results):
        assert r["alive"] == 0, (rank, r["alive"])
        assert r["kept_gone"] is True, rank


def test_window_bytes_stay_flat(results):
    for rank, r in enumerate(results):
        assert r["base"] > 0, (rank, r["base"])
        assert all(b > r["base"] for b in r["during"]), (rank, r["during"])  # each model bound its own
        assert r["after"] == [r["base"]] * (CYCLES + DROPPED), (rank, r["base"], r["after"])
        assert r["end"] == r["base"] and r["final"] == 0, (rank, r)
        assert r["open_windows"] == r["base_windows"] >= 1, (rank, r["open_windows"], r["base_windows"])


def test_explain_lists_live_models_only(results):
    for rank, r in enumerate(results):
        assert r["rows"] == r["kept_rows"] == r["explain_rows"], (rank, r)
        assert r["rs_installed"] == 0, (rank, r["rs_installed"])


def test_rss_roughly_flat(results):
    for rank, r in enumerate(results):
        first, last = r["rss"]
        assert last - first < RSS_SLACK_MB, (rank, r["rss"], str(r["rss_all"]))


def test_outputs_exact(results):
    for rank, r in enumerate(results):
        assert r["exact"] and all(r["exact"]), (rank, r["exact"])
        assert len(r["kept_exact"]) == CYCLES + DROPPED and all(r["kept_exact"]), (rank, r["kept_exact"])


def test_comms_are_classes_of_torch_ce_fsdp2(results):
    for rank, r in enumerate(results):
        ag, rs = r["comms"]["all_gather"], r["comms"]["reduce_scatter"]
        assert ag["module"].startswith("torch_ce.fsdp2") and ag["name"] == "CopyEngineAllGather", (rank, ag)
        assert rs["module"].startswith("torch_ce.fsdp2") and rs["name"] == "CopyEngineReduceScatter", (rank, rs)
        assert ag["repr"].startswith("CopyEngineAllGather(group='blocks.0', mode='staged'"), (rank, ag)
        assert rs["repr"] == "CopyEngineReduceScatter(name='fsdp2 blocks.0')", (rank, rs)


@pytest.mark.parametrize("rs", ["copy_engine", "collective"])
def test_fsdp2_totals_count_every_call_of_a_step(results, rs):
    own = "a custom all-gather is set already"
    for rank, r in enumerate(results):
        t = r["totals"][rs]
        ag, rsc, meas = t["after"]["all_gather"], t["after"]["reduce_scatter"], t["measured"]
        for kind in ("all_gather", "reduce_scatter"):  # nothing ran before the steps
            assert t["before"][kind]["calls"] == 0 and t["before"][kind]["ce_bytes"] == 0, (rank, t["before"])
        assert ag["calls"] == meas["ag_calls"] and rsc["calls"] == meas["rs_calls"], (rank, ag, rsc, meas)
        assert ag["ce_bytes"] + ag["collective_bytes"] == meas["ag"], (rank, ag, meas)
        (why, nb), = ag["by_reason"].items()  # the one refused group, on the user's comm
        assert own in why and nb == ag["collective_bytes"] > 0 and ag["ce_bytes"] > 0, (rank, ag)
        assert rsc["ce_bytes"] + rsc["collective_bytes"] == meas["rs"] > 0, (rank, rsc, meas)
        if rs == "copy_engine":
            assert rsc["collective_bytes"] == 0 and rsc["ce_bytes"] == meas["rs"], (rank, rsc)
        else:
            assert rsc["ce_bytes"] == 0 and list(rsc["by_reason"]) == [
                "FSDP2's reduce-scatter (enable(reduce_scatter='collective'))"], (rank, rsc)
        # two steps gather more than twice each group's bytes: the backward gathers again
        assert meas["ag"] > 2 * t["static"], (rank, meas["ag"], t["static"])
        assert "fsdp2 as run:" in t["table"], (rank, t["table"])
