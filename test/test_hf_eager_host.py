"""Gathers outside compiled graphs, as Hugging Face training runs them (issue 47), on 2 gloo
ranks with the host transport: a tiny random HF Llama with ``gradient_checkpointing_enable()``
under torchtitan's SimpleFSDP ``fully_shard``, plain ``torch.compile(model)``, AdamW.

Gradient checkpointing graph-breaks every decoder layer, and ``torch.utils.checkpoint``
re-runs each layer in backward under the autograd engine: the layers' weights are gathered
eagerly, forward and backward, never in a compiled graph (NOTE [eager gathers] in
torch_ce/runtime/eager.py). One run of 2 ranks trains the model with plain compile (the
reference), then with ``torch_ce.enable(transport="copy_engine")``; a counting dispatch
profile (``count_gathers``: every gather op that ran, compiled graphs' and eager ones',
its bytes from its input shapes: magi's reads, the collective's all_gather) is the run
time's count, independent of ``explain()``.

- ``test_checkpointed_llama_trains_on_the_copy_engines``: losses bit-identical to plain
  compile over 3 steps; in each step >= 99% of the gathered bytes on the copy engines by
  the run-time count, and ``explain().coverage().total`` (``torch_ce.reset_counts()``
  before each step) equal to it within 1%; the eager gathers listed by the names
  ``named_parameters()`` gives, where they ran ("eager": ``torch.utils.checkpoint`` runs
  with Dynamo off; "backward": its re-run).
- ``test_unserved_eager_gathers_show_share_and_reason``: a 4th step with
  ``eager_gathers=False`` (the eager segments stay on the collective): the loss still
  equal to the reference's, the share below 100% and equal to the run-time count's within
  1%, the reason in the coverage and the table, and one warning.

transformers is a test-only dependency (pinned in the README's install line); without it
this file skips.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("transformers")

from mp_harness import run_ranks, seed_base, setup_compile  # noqa: E402

VOCAB, HIDDEN = 128, 32
IDS_SHAPE = (2, 8)
STEPS = 3  # served; then one step with eager_gathers=False
TIMEOUT = 300


# Gather ops and what each writes, from its input shapes (profiler, record_shapes): the
# run time's count, independent of explain(). A gather nested in another (a refused CE
# gather's collective) or in a bind / stage step (calibration) is not counted again, nor
# one traced on fake tensors while the first step compiles.
_GATHERS = {"magi::ce_all_gather": "ce", "magi::ce_all_gather_coalesced": "ce", "magi::ce_gather_rows": "ce",
            "magi::ce_all_gather_dim": "ce", "magi::ce_all_gather_padded": "ce",
            "_c10d_functional::all_gather_into_tensor": "collective",
            "_c10d_functional::all_gather_into_tensor_coalesced": "collective"}
_STEPS = ("magi::ce_bind", "magi::ce_stage")


def _elem(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _gathered_bytes(ev, world: int) -> int:
    shapes, size = ev.input_shapes, 4  # fp32 weights (the profile keeps shapes, not dtypes)
    if ev.name == "magi::ce_gather_rows":  # rows looked up x row bytes
        return _elem(shapes[1]) * _elem(shapes[0][1:]) * size
    first = shapes[0]
    if first and isinstance(first[0], list):  # a tensor list: coalesced
        return sum(_elem(s) for s in first) * world * size
    return _elem(first) * world * size


def count_gathers(prof, world: int) -> tuple[int, int]:
    """(ce bytes, collective bytes) of the top-level gathers a profile recorded."""
    out = {"ce": 0, "collective": 0}
    for ev in prof.events():
        kind = _GATHERS.get(ev.name)
        if kind is None:
            continue
        p, nested = ev.cpu_parent, False
        while p is not None:
            # ("compile": Dynamo's and AOTAutograd's compile regions, not a compiled graph's run)
            if p.name in _GATHERS or p.name in _STEPS or p.name == "dynamo" or "compile" in p.name:
                nested = True
                break
            p = p.cpu_parent
        if not nested:
            out[kind] += _gathered_bytes(ev, world)
    return out["ce"], out["collective"]


def _model(mesh):
    import transformers
    from torchtitan.experiments.graph_trainer import simple_fsdp

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2,
                                   use_cache=False)
    net = transformers.LlamaForCausalLM(cfg)
    net.gradient_checkpointing_enable()
    net.train()
    names = [n for n, _ in net.named_parameters()]
    simple_fsdp._wrap_class_cache.clear()
    return simple_fsdp.data_parallel(net, mesh, mode="fully_shard"), names


def _train(mesh, batches, ce: bool, log) -> dict:
    import torch_ce

    torch._dynamo.reset()
    model, names = _model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if ce:  # cost_mode="default": no calibration gathers in the first step
        torch_ce.enable(transport="copy_engine", cost_mode="default")
    step = torch.compile(model)
    losses, steps = [], []
    try:
        for i, ids in enumerate(batches):
            if ce and i == STEPS:
                torch_ce.config.update(eager_gathers=False)
            torch_ce.reset_counts()
            prof = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
                    if ce else contextlib.nullcontext())
            with prof:
                loss = step(ids, labels=ids).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
            if ce:
                e = torch_ce.explain()
                cov = e.coverage()
                ce_b, coll_b = count_gathers(prof, 2)
                steps.append(dict(run=(ce_b, coll_b, ce_b / (ce_b + coll_b) if ce_b + coll_b else None),
                                  total=cov.total.as_dict(),
                                  eager=cov.eager, table=e.table()))
    finally:
        if ce:
            torch_ce.disable()
    return dict(losses=losses, steps=steps, names=names,
                warnings=[r for r in log if "outside compiled graphs stay on the collective" in r])


def _rank(rank, world, seed, cache):
    import logging

    from torch.distributed.device_mesh import init_device_mesh

    setup_compile(cache, rank)
    log: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            log.append(record.getMessage())

    logging.getLogger("torch_ce").addHandler(Keep(logging.WARNING))
    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(seed + rank)  # other ids on every rank
    batches = [torch.randint(0, VOCAB, IDS_SHAPE, generator=gen) for _ in range(STEPS + 1)]
    ref = _train(mesh, batches, ce=False, log=[])
    out = _train(mesh, batches, ce=True, log=log)
    out["exact"] = [torch.equal(a, b) for a, b in zip(out["losses"], ref["losses"], strict=True)]
    out["losses"] = [float(x) for x in out["losses"]]
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    seed = seed_base()
    return seed, run_ranks(_rank, 2, seed, str(tmp_path_factory.mktemp("hf_eager").resolve()), timeout=TIMEOUT)


def _close(a: float, b: float, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_checkpointed_llama_trains_on_the_copy_engines(ranks):
    seed, res = ranks
    for rank, r in enumerate(res):
        ctx = f"rank {rank} (seed {seed})"
        assert r["exact"][:STEPS] == [True] * STEPS, f"{ctx}: losses differ from plain compile: {r['losses']}"
        for i, s in enumerate(r["steps"][:STEPS]):
            ce, coll, share = s["run"]
            tot = s["total"]
            assert share is not None and share >= 0.99, (ctx, i, s["run"], s["table"])
            assert tot["counted"] and tot["share"] is not None, (ctx, i, s["table"])
            assert abs(tot["share"] - share) <= 0.01, (ctx, i, tot, s["run"], s["table"])
            assert _close(tot["ce_bytes"] + tot["collective_bytes"], ce + coll), (ctx, i, tot, s["run"])
            assert tot["eager_ce_bytes"] > 0 and tot["eager_collective_bytes"] == 0, (ctx, i, tot)
            # forward: torch.utils.checkpoint runs with Dynamo off ("eager"); backward: the re-run
            wheres = {e["where"] for e in s["eager"]}
            assert wheres == {"eager", "backward"}, (ctx, i, wheres)
            layer = {e["weight"] for e in s["eager"]}
            assert layer and layer <= set(r["names"]), (ctx, sorted(layer - set(r["names"])))
            assert "model.layers.0.self_attn.q_proj.weight" in layer, (ctx, sorted(layer))
            assert "eager    backward:" in s["table"] and "on the copy engines" in s["table"], s["table"]


def test_unserved_eager_gathers_show_share_and_reason(ranks):
    seed, res = ranks
    for rank, r in enumerate(res):
        ctx = f"rank {rank} (seed {seed})"
        assert r["exact"][STEPS], f"{ctx}: loss differs from plain compile: {r['losses']}"
        s = r["steps"][STEPS]
        ce, coll, share = s["run"]
        tot = s["total"]
        assert coll > 0 and share < 0.99, (ctx, s["run"])
        assert tot["share"] < 1.0 and abs(tot["share"] - share) <= 0.01, (ctx, tot, s["run"], s["table"])
        assert _close(tot["ce_bytes"] + tot["collective_bytes"], ce + coll), (ctx, tot, s["run"])
        assert tot["eager_collective_bytes"] > 0 and tot["eager_ce_bytes"] == 0, (ctx, tot)
        reasons = [k for k in tot["by_reason"] if "eager_gathers=False" in k]
        assert reasons and any("outside compiled graphs: backward" in k for k in reasons), (ctx, tot["by_reason"])
        assert "on the collective: eager_gathers=False" in s["table"], s["table"]
        assert "100.0%" not in next(ln for ln in s["table"].splitlines() if ln.startswith("coverage total")), s["table"]
        assert len(r["warnings"]) == 1, (ctx, r["warnings"])
