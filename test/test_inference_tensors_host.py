"""Weights made under ``torch.inference_mode()`` (inference tensors: no version counter) are
bound in place and said so once per bind (NOTE [inference tensors at bind] in
torch_ce/runtime/inference_tensors.py), on CPU ranks (gloo, host transport), fresh random
weights and inputs per run, one rank late.

- ``test_compiled_simple_fsdp_inference_weights``: a SimpleFSDP-style model
  (``torch_ce.simple_fsdp.shard_param``) of 10 weights made and sharded under
  ``inference_mode``, compiled; its first call runs under ``no_grad`` (outside
  ``inference_mode``: the bind re-points the shards from ordinary code), with rank 1 late.
  The bind warns once (a UserWarning and a log line) naming 8 weights "and 2 more"; the
  weights stay inference tensors, in their slots; every call equals the full-weight
  reference on every rank; an update inside ``torch_ce.updating_weights`` (rank 1 late) is
  read exactly by every rank; ``explain()``'s bind row notes the weights. Beside it, a
  model of ordinary weights bound under ``inference_mode`` keeps its version counters
  (the net still catches an unprotected write) and warns nothing.
- ``test_fsdp2_inference_weights``: an FSDP2 DiT made and ``fully_shard``ed under
  ``inference_mode`` (fp32 in place, and bf16 ``param_dtype``: cast slots), enabled with
  rank 1 late: one warning per enable naming its parameters; forwards equal FSDP2's own
  forward of the same weights made ordinarily; ``load_state_dict`` inside
  ``updating_weights`` (rank 1 late) is read exactly by every rank.
"""
from __future__ import annotations

import logging
import time
import warnings

import torch

from mp_harness import run_ranks, seed_base, setup_compile

LATE_S = 1.5
LAYERS = 5  # x 2 weights: more than the 8 names a warning lists
DIM = 16
ENV = {"TORCH_CE_COST_MODE": "default"}
MARK = "without a version counter"


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = torch.nn.Linear(DIM, DIM, bias=False)
        self.wo = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        return torch.relu(self.wo(torch.relu(self.wq(x))))


class _Net(torch.nn.Module):
    """Bias-free linears with ReLUs: exact against the full-weight reference in fp32."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _fulls(seed: int) -> list[torch.Tensor]:
    """The full weights (the same on every rank), scaled so the activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(DIM, DIM, generator=g) / DIM ** 0.5 for _ in range(2 * LAYERS)]


def _reference(fulls, x):
    for i, w in enumerate(fulls):
        x = torch.relu(torch.nn.functional.linear(x, w))
    return x


def _sharded(mesh, fulls, inference: bool) -> _Net:
    """``_Net`` holding ``fulls``, each weight a Shard(0) DTensor behind SimpleFSDP's
    parametrization; made and sharded under ``inference_mode`` when ``inference``."""
    from torch_ce.simple_fsdp import shard_param

    with torch.inference_mode(inference):
        net = _Net()
        ws = [m for layer in net.layers for m in (layer.wq, layer.wo)]
        with torch.no_grad():
            for m, f in zip(ws, fulls, strict=True):
                m.weight = torch.nn.Parameter(f.clone(), requires_grad=False)
                shard_param(m, "weight", mesh)
    return net


def _locals(net) -> list[torch.Tensor]:
    return [m.parametrizations.weight.original._local_tensor
            for layer in net.layers for m in (layer.wq, layer.wo)]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _watching(fn):
    """(fn's result, UserWarning texts it raised about unwatched weights, log lines)."""
    handler = _Lines()
    log = logging.getLogger("torch_ce")
    log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            out = fn()
    finally:
        log.removeHandler(handler)
    return (out, [str(w.message) for w in rec if issubclass(w.category, UserWarning) and MARK in str(w.message)],
            [m for m in handler.lines if MARK in m])


def _rank_compiled(rank: int, world: int, seed: int, root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch_ce
    from torch_ce.runtime import windows as W

    setup_compile(root, rank)
    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = init_device_mesh("cpu", (world,))
    fulls = _fulls(seed)
    net = _sharded(mesh, fulls, inference=True)
    out: dict = {"inference": all(t.is_inference() for t in _locals(net))}
    torch_ce.enable(transport="copy_engine", bind_timeout_s=20.0)
    compiled = torch.compile(net, fullgraph=True)
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    calls = []

    def call(label, n=2, inference=False):
        for _ in range(n):
            x = torch.randn(3, DIM, generator=gen)
            with torch.inference_mode(inference), torch.no_grad():
                y = compiled(x)
            calls.append((label, bool(torch.equal(y, _reference(fulls, x)))))

    try:
        if rank == 1:
            time.sleep(LATE_S)  # the bind round waits for the late rank
        _, out["warnings"], out["log"] = _watching(lambda: call("bound", n=1))
        _, out["later_warnings"], _ = _watching(lambda: call("bound again", inference=True))
        locs = _locals(net)
        out["after_bind_inference"] = all(t.is_inference() for t in locs)
        out["in_place"] = sum(isinstance(W.lookup(t), W.Slot) for t in locs)
        out["explained"] = [line for line in torch_ce.explain().table().splitlines() if MARK in line]
        # An update through the protocol, rank 1 late inside it: every rank reads it.
        params = [m.parametrizations.weight.original for layer in net.layers for m in (layer.wq, layer.wo)]
        new = _fulls(seed + 7)
        with torch.inference_mode():  # writes to inference tensors need it (torch's rule)
            with torch_ce.updating_weights(params):
                if rank == 1:
                    time.sleep(LATE_S)
                for t, f in zip(_locals(net), new, strict=True):
                    t.copy_(f.chunk(world)[rank])
        fulls[:] = new
        call("updated")
        call("updated, inference_mode", inference=True)
        out["calls"] = calls

        # Ordinary weights bound inside inference_mode keep their counters: no warning,
        # and an unprotected write is caught on the writing rank.
        plain = _sharded(mesh, _fulls(seed + 11), inference=False)
        fulls[:] = _fulls(seed + 11)
        compiled = torch.compile(plain, fullgraph=True)
        dist.barrier()
        _, out["plain_warnings"], _ = _watching(lambda: call("plain", n=1, inference=True))
        out["plain_inference"] = any(t.is_inference() for t in _locals(plain))
        dist.barrier()  # no peer still reads the weight written next
        with torch.no_grad():
            _locals(plain)[0].add_(1.0)
        try:
            call("plain, written outside", n=1, inference=True)
            out["plain_stale"] = ""
        except torch_ce.StaleWeightError as e:
            out["plain_stale"] = str(e)
        dist.barrier()
    finally:
        torch_ce.disable()
    return out


def test_compiled_simple_fsdp_inference_weights(tmp_path):
    res = run_ranks(_rank_compiled, 2, seed_base(), str(tmp_path.resolve()), timeout=400, env=ENV)
    for rank, r in enumerate(res):
        assert r["inference"], "the weights were meant to be inference tensors"
        assert len(r["warnings"]) == 1 and len(r["log"]) == 1, (rank, r["warnings"], r["log"])
        msg = r["warnings"][0]
        assert msg == r["log"][0], (msg, r["log"])
        assert "10 weight(s)" in msg and "and 2 more" in msg and "updating_weights" in msg, msg
        assert "layers.0.wq" in msg and "layers.0.wo" in msg, msg
        assert r["later_warnings"] == [], r["later_warnings"]  # once per bind, not per call
        assert r["after_bind_inference"] and r["in_place"] == 2 * LAYERS, r
        assert r["explained"] and "updating_weights" in r["explained"][0], r["explained"]
        bad = [c for c in r["calls"] if not c[1]]
        assert not bad, (rank, bad)
        assert {c[0] for c in r["calls"]} >= {"bound", "updated", "updated, inference_mode"}, r["calls"]
        assert r["plain_warnings"] == [] and not r["plain_inference"], r
        assert "outside torch_ce.updating_weights" in r["plain_stale"], r["plain_stale"]


# ---------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------


def _dit(mesh, seed: int, param_dtype, inference: bool):
    import fsdp2_models as M

    torch.manual_seed(seed)  # the same weights on every rank
    with torch.inference_mode(inference):
        net = M.DiT()
        M.shard_dit(net, mesh, param_dtype)
    return net


def _rank_fsdp2(rank: int, world: int, seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2_models as M
    import torch_ce

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch_ce.config.update(cost_mode="default", bind_timeout_s=20.0)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for label, pdt in (("fp32", None), ("bf16", torch.bfloat16)):
        inp = M.dit_inputs(seed + 100 + rank)
        ref = _dit(mesh, seed, pdt, inference=False)
        ref.requires_grad_(False)
        m = _dit(mesh, seed, pdt, inference=True)
        r = {"inference": all(p.to_local().is_inference() for p in m.parameters())}
        if rank == 1:
            time.sleep(LATE_S)  # the bind round waits for the late rank
        rows, r["warnings"], r["log"] = _watching(lambda: torch_ce.fsdp2.enable(m, weights="static"))
        r["statuses"] = sorted({row.status for row in rows})
        with torch.no_grad():
            want = ref(*inp)
            r["equal"] = [bool(torch.equal(m(*inp), want)) for _ in range(2)]
        new = _dit(mesh, seed + 7, pdt, inference=False)
        new.requires_grad_(False)
        sd = new.state_dict()
        with torch.inference_mode():
            with torch_ce.updating_weights(m):
                if rank == 1:
                    time.sleep(LATE_S)
                m.load_state_dict(sd)
        with torch.no_grad():
            r["updated"] = bool(torch.equal(m(*inp), new(*inp)))
        torch_ce.fsdp2.disable(m)
        out[label] = r
    return out


def test_fsdp2_inference_weights():
    res = run_ranks(_rank_fsdp2, 2, seed_base(), timeout=400, env=ENV)
    for rank, out in enumerate(res):
        for label, r in out.items():
            assert r["inference"], (rank, label, "the weights were meant to be inference tensors")
            assert r["statuses"] == ["bound"], (rank, label, r)
            assert len(r["warnings"]) == 1 and r["log"] == r["warnings"], (rank, label, r["warnings"], r["log"])
            msg = r["warnings"][0]
            assert "embed.weight" in msg and "more" in msg and "updating_weights" in msg, msg
            assert all(r["equal"]) and r["updated"], (rank, label, r)
