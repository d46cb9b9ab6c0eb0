"""``torch-ce bench e2e --model``: torchtitan's own architectures (torch_ce/bench/zoo.py).

The model builder against the zoo's own 8B factory (shapes, on the meta device), and one
whole CPU run of the bench on 2 gloo ranks with tiny shapes: nccl, ce and bound variants,
the CE output checked against NCCL on every rank, and the per-gather account's names.
Skipped without torchtitan (README's install line).
"""
import json

import pytest
import torch

pytest.importorskip("torchtitan")  # its modules then import, or the file fails loudly

from torch_ce.bench import e2e, zoo  # noqa: E402


@pytest.mark.parametrize("model", list(zoo.MODELS))
def test_config_is_the_zoo_8b(model):
    fam = zoo.MODELS[model]["family"]
    factory = getattr(zoo.load(fam), f"{fam}_configs")["8B"](attn_backend="flex")
    factory.layers = factory.layers[:2]
    ours = zoo.model_config(model, 2)
    with torch.device("meta"):
        ref = {n: tuple(p.shape) for n, p in factory.build().named_parameters()}
        got = {n: tuple(p.shape) for n, p in ours.build().named_parameters()}
    assert got == ref
    att = ours.layers[0].attention
    assert att.n_kv_heads < att.n_heads  # GQA
    assert type(att.inner_attention).__qualname__ == "ScaledDotProductAttention.Config"
    assert got["tok_embeddings.weight"] == (zoo.MODELS[model]["vocab"], 4096) == got["lm_head.weight"]


def test_training_imports_are_stubbed_only_where_they_cannot_import(monkeypatch):
    """The bench stubs a training-only module only where it fails to import: a trainer
    imported later in the same process (graph_trainer's) must get the real optimizers."""
    import sys

    missing = "torch_ce_test_absent_training_module"
    monkeypatch.setattr(zoo, "_TRAINING_ONLY", zoo._TRAINING_ONLY + (missing,))
    monkeypatch.delitem(sys.modules, missing, raising=False)
    zoo.load("llama3")
    from torchtitan.components.optimizer import OptimizersContainer

    assert not isinstance(sys.modules["torchtitan.components.optimizer"], zoo._Stub)
    assert OptimizersContainer.__module__.startswith("torchtitan.components.optimizer")
    stub = sys.modules[missing]
    assert isinstance(stub, zoo._Stub)
    assert stub.Anything | None is not None  # annotations of a stubbed name still evaluate
    with pytest.raises(RuntimeError, match="training-only"):
        stub.Anything()


@pytest.mark.slow  # default suite under 15 min on 2 cores: the zoo models' gathers run in test_zoo_matrix's default case
def test_e2e_zoo_model_on_cpu(tmp_path):
    rc = e2e.main(["--device", "cpu", "--model", "llama3_8b", "--layers", "1", "--dim", "128", "--vocab", "256",
                   "--tokens", "16", "--variants", "nccl,ce,bound", "--iters", "1", "--warmup", "0", "--trace",
                   "--out", str(tmp_path), "--timeout", "240"])
    assert rc == 0
    d = json.loads((tmp_path / "e2e_llama3_8b_cpu_w2.json").read_text())
    per = d["results"]["16"]
    assert per["checks_within_bf16_tol_all_ranks"]["ce_vs_nccl"] is True
    assert per["ce"]["magi_in_code"] and per["ce"]["bound_gathers"] > 0 and "refused" not in per["ce"]
    assert per["nccl"]["code_nccl_all_gather_calls"] > 0
    acct = json.loads((tmp_path / "account_llama3_8b_2.json").read_text())
    for v in ("ce", "nccl"):  # named by the CE variant's placeholder -> parameter map
        labels = [g["label"] for g in acct["tokens"]["16"][v]["gathers"][0]]
        assert "L0 wqkv" in " ".join(labels) and "lm_head" in " ".join(labels), labels
