"""A Hugging Face causal LM under FSDP2 as users load it for inference (2 gloo ranks, the
host transport): ``from_pretrained`` leaves every parameter requiring grad, so
``torch_ce.fsdp2.enable`` serves its groups as training groups (staged, with step words).

- ``generate()`` under ``no_grad`` (one rank seconds late) gives FSDP2's own tokens and
  logits on every rank, and ``explain()`` says in one line what to set (its
  ``fsdp2_hint``), naming ``requires_grad_(False)`` and ``weights="static"``.
- The same model loaded with ``requires_grad_(False)``: every group static (read in place,
  no per-call signal), the same tokens again, and no hint.

Host time per generated token against FSDP2's own: bench/compare/fsdp2_generate_cost.py.
transformers is a test-only dependency (pinned in the README's install line).
"""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("transformers")

from mp_harness import run_ranks, seed_base  # noqa: E402

VOCAB = 128


def tiny_llama(seed: int):
    """A tiny random Llama causal LM (the same weights on every rank), parameters requiring
    grad as ``from_pretrained`` leaves them, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def shard(net, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in net.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _rank(rank, world, seed):
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed + rank))
    ref, m = shard(tiny_llama(seed), mesh), shard(tiny_llama(seed), mesh)
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        want_logits = ref(ids).logits
    torch_ce.fsdp2.enable(m)
    if rank == 1:
        time.sleep(1.0)
    with torch.no_grad():
        got = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        logits = m(ids).logits
    d = torch_ce.explain().as_dict()
    first = dict(tokens=torch.equal(got, want), logits=torch.equal(logits, want_logits),
                 how=sorted({r["how"] for r in d["fsdp2"] if r["status"] == "bound"}),
                 hint=d["fsdp2_hint"], table=torch_ce.explain().table())
    torch_ce.fsdp2.disable(m)
    # As the hint says: requires_grad_(False) after loading, before sharding (FSDP2 keeps a
    # flag set on the unsharded parameters of a root left gathered only until it reshards).
    m = shard(tiny_llama(seed).requires_grad_(False), mesh)
    rows = torch_ce.fsdp2.enable(m)
    with torch.no_grad():
        again = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    d = torch_ce.explain().as_dict()
    second = dict(tokens=torch.equal(again, want), how=sorted({r.how for r in rows if r.status == "bound"}),
                  statuses=sorted({r.status for r in rows}), hint=d["fsdp2_hint"],
                  calls=sum(r["calls"] for r in d["fsdp2"] if r["status"] == "bound"))
    torch_ce.fsdp2.disable(m)
    return dict(first=first, second=second, new_tokens=int(want.shape[1] - ids.shape[1]))


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 2, seed_base(), timeout=180)


def test_generate_as_loaded_equals_fsdp2_and_explain_says_what_to_set(results):
    for rank, r in enumerate(results):
        f = r["first"]
        assert r["new_tokens"] == 5
        assert f["tokens"] and f["logits"], (rank, f)
        assert f["how"] == ["staged (training)"], (rank, f["how"])
        assert "gathered only under no_grad" in f["hint"], (rank, f["hint"])
        assert "requires_grad_(False)" in f["hint"] and 'weights="static"' in f["hint"], f["hint"]
        assert f["hint"] in f["table"], f["table"]


def test_after_requires_grad_false_the_groups_are_static(results):
    for rank, r in enumerate(results):
        s = r["second"]
        assert s["tokens"], (rank, s)
        assert s["statuses"] == ["bound"] and s["how"] == ["in place"], (rank, s)
        assert s["calls"] > 0 and s["hint"] == "", (rank, s)
