"""Hugging Face transformers models as users run them (issue 47), on 2 gloo ranks with the
host transport: tiny random configs built on CPU (no weights downloaded), wrapped by
torchtitan's SimpleFSDP ``fully_shard``, plain ``torch.compile(model)``, inference under
``no_grad``, compared exactly with the same model compiled without torch_ce.

One run of 2 ranks compiles a Llama-style causal LM (two layers) under a bf16
``param_dtype`` (fp32 weights: every gather reads a cast slot, NOTE [cast slots] in
torch_ce/runtime/staging.py), with and without torch_ce, then a Qwen3-MoE causal LM (one
layer, fp32) with torch_ce.

- ``test_names_follow_named_parameters``: ``explain()`` names every weight of both as
  ``model.named_parameters()`` does, although transformers 5 decorates its forwards (the
  module is ``args[0]`` in the compiled frame, NOTE [parameter names] in
  torch_ce/passes/param_names.py).
- ``test_llama_bf16_inference_rows_from_the_cast_slot``: logits bit-identical to the plain
  compile on both ranks, two calls; the embedding table looked up by rows from its cast
  slot (NOTE [row gathers] in torch_ce/passes/rows.py), with its row line in
  ``explain()``. Two layers: a row gather whose output the lookup's users read directly
  (before NOTE [row gathers fuse as lookups]) made these logits 1 bf16 ulp off the plain
  compile, Inductor storing the second layer's residual stream elsewhere.

transformers is a test-only dependency (pinned in the README's install line); without it
this file skips.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from mp_harness import run_ranks, seed_base, setup_compile  # noqa: E402

VOCAB, HIDDEN = 128, 32
IDS_SHAPE = (2, 8)
TIMEOUT = 240


def _model(kind: str, mesh, param_dtype):
    """A tiny random HF causal LM (the same weights on every rank) under SimpleFSDP, and
    its ``named_parameters()`` names before wrapping."""
    import transformers
    from torchtitan.experiments.graph_trainer import simple_fsdp

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=64, num_hidden_layers=2, **common)
        net = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                                          num_experts=4, num_experts_per_tok=2, head_dim=8, **common)
        net = transformers.Qwen3MoeForCausalLM(cfg)
    names = [n for n, _ in net.eval().named_parameters()]
    simple_fsdp._wrap_class_cache.clear()
    policy = simple_fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    model = simple_fsdp.data_parallel(net, mesh, mode="fully_shard", mp_policy=policy)
    return model.requires_grad_(False), names


def _run(kind, param_dtype, seed, rank, reference: bool) -> dict:
    """One model: compiled without torch_ce (``reference``), then with it; its logits and
    what explain() says of its graph (the last one compiled)."""
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    model, names = _model(kind, mesh, param_dtype)
    gen = torch.Generator().manual_seed(seed + rank)  # other ids on every rank
    batches = [torch.randint(0, VOCAB, IDS_SHAPE, generator=gen) for _ in range(2)]
    ref = None
    if reference:
        with torch.no_grad():
            plain = torch.compile(model)
            ref = [plain(ids).logits for ids in batches]
    torch._dynamo.reset()
    torch_ce.enable(transport="copy_engine")
    try:
        with torch.no_grad():
            ce = torch.compile(model)
            out = [ce(ids).logits for ids in batches]
        e = torch_ce.explain()
        d = e.as_dict()
        gid = d["graphs"][-1]["graph_id"]
        weights = [w for w in d["weights"] if w["graph_id"] == gid]
        embed = next((w for w in weights if w["param"] == "model.embed_tokens.weight"), None)
        return dict(names=names, explained=[w["param"] for w in weights],
                    statuses=sorted({w["status"] for w in weights}),
                    exact=None if ref is None else [torch.equal(a, b) for a, b in zip(out, ref, strict=True)],
                    dtype=str(out[0].dtype), embed=embed,
                    share=d["coverage"]["per_graph"][-1]["share"], table=e.table())
    finally:
        torch_ce.disable()


def _rank(rank, world, seed, cache):
    setup_compile(cache, rank)
    # Llama against the plain compile; Qwen3-MoE for its names only (a plain compile of it
    # would double its share of this file's time, < 60 s on 2 cores).
    return dict(llama=_run("llama", torch.bfloat16, seed, rank, reference=True),
                qwen3_moe=_run("qwen3_moe", None, seed, rank, reference=False))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    seed = seed_base()
    res = run_ranks(_rank, 2, seed, str(tmp_path_factory.mktemp("hf").resolve()), timeout=TIMEOUT)
    return seed, res


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_names_follow_named_parameters(ranks, kind):
    """NOTE [parameter names]: transformers 5's decorated forwards hold the module in
    ``args[0]``; explain() still names each weight as ``named_parameters()`` does."""
    seed, res = ranks
    for rank, per in enumerate(res):
        r, ctx = per[kind], f"rank {rank}, {kind} (seed {seed})"
        assert r["statuses"] == ["bound"], (ctx, r["table"])
        assert sorted(set(r["explained"])) == sorted(r["names"]), (
            f"{ctx}: explain() names differ from named_parameters(): "
            f"{sorted(set(r['explained']) ^ set(r['names']))}")


def test_llama_bf16_inference_rows_from_the_cast_slot(ranks):
    """bf16 ``param_dtype``: logits bit-identical to the plain compile on both ranks (two
    calls), the embedding looked up by rows from its cast slot, in bf16, and said so."""
    seed, res = ranks
    ids = IDS_SHAPE[0] * IDS_SHAPE[1]
    for rank, per in enumerate(res):
        r, ctx = per["llama"], f"rank {rank} (seed {seed})"
        assert r["exact"] == [True, True], f"{ctx}: logits differ from the plain compile\n{r['table']}"
        assert r["dtype"] == "torch.bfloat16", (ctx, r["dtype"])
        emb = r["embed"]
        assert emb is not None, (ctx, r["table"])
        assert emb["rows"] == dict(lookups=1, rows=ids, row_bytes=HIDDEN * 2, bytes_per_forward=ids * HIDDEN * 2,
                                   reason="", code=0), (ctx, emb["rows"])
        assert emb["ce_bytes"] == ids * HIDDEN * 2 and emb["collective_bytes"] == 0, (ctx, emb)
        want = f"row gather: 1 lookup(s), {ids} x {HIDDEN * 2} B = {ids * HIDDEN * 2:,d} B read per forward"
        assert want in r["table"], (ctx, r["table"])
        assert r["share"] == 1.0, (ctx, r["table"])
