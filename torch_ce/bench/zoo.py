"""``torch-ce bench e2e --model``: torchtitan's own architectures (its model zoo), built for
inference on torch >= 2.11 and wrapped with torchtitan's SimpleFSDP.

Why not ``import torchtitan.models.llama3``: the zoo's packages import their training
stack. ``llama3/__init__`` imports its ``parallelize`` (-> ``torchtitan.distributed.fsdp``,
which needs ``torch.distributed.fsdp.DataParallelMeshDims``: newer than torch 2.11) and
``torchtitan.distributed.pipeline_parallel``; ``qwen3/__init__`` also the optimizer
components; ``models/common`` reaches ``torchtitan.distributed.minimal_async_ep`` (the MoE
expert-parallel kernels; needs triton, absent on CPU CI) through ``moe.py``. ``load``
puts a stub module for each of those in ``sys.modules`` before the first import (every
name in a stub raises when called, so a training path that reaches one fails loudly; none
is on the inference path of a dense model) and then imports the family package as usual:
its config factories and layer builders are the zoo's own. Checked on torch 2.13 (CPU)
and 2.11+cu130 (``import`` and a forward on CPU; triton present there).

Attention: the zoo's language models use flex attention with a per-document BlockMask
(whose builder needs torch 2.13); a benchmark forward of one sequence needs a plain causal
mask, so every layer's ``inner_attention`` becomes the zoo's ``ScaledDotProductAttention``
(SDPA, ``is_causal=True``; GQA through ``enable_gqa``), called with no masks.

Shapes: each family's 8B flavour (the numbers below are the zoo factory's;
``test_bench_zoo.py`` checks that the parameter shapes match the factory's) with the first
``--layers`` blocks, the full-vocabulary embedding and LM head, and ``--dim`` / ``--vocab``
overrides for CPU smoke runs (heads scale with ``dim // head_dim``, GQA ratio kept).
"""
from __future__ import annotations

import importlib
import sys
import types

# name -> family package, its 8B numbers (from the zoo's factory) and its layer builder.
MODELS = {
    "llama3_8b": dict(family="llama3", flavor="8B", dim=4096, head_dim=128, kv_ratio=4,
                      ffn=14336, vocab=128256),
    "qwen3_8b": dict(family="qwen3", flavor="8B", dim=4096, head_dim=128, kv_ratio=4,
                     ffn=12288, vocab=151936),
}

# Imported by the zoo's packages, used only for training (parallelisms, pipelining,
# optimizers, expert-parallel MoE kernels).
_TRAINING_ONLY = (
    "torchtitan.distributed.pipeline_parallel",
    "torchtitan.distributed.minimal_async_ep.kernels",  # Triton's: stubbed alone where absent
    "torchtitan.distributed.minimal_async_ep",
    "torchtitan.components.optimizer",
    "torchtitan.models.llama3.parallelize",
    "torchtitan.models.qwen3.parallelize",
)


class _Stub(types.ModuleType):
    """A training-only module the bench cannot load here: any name is a class whose
    construction raises (a class, so annotations such as ``X | None`` still evaluate)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        mod = self.__name__

        def training_only(*a, **k):
            raise RuntimeError(f"{mod}.{name} is training-only; torch_ce's bench stubbed it")

        cls = type(name, (), {"__init__": training_only, "__module__": mod})
        setattr(self, name, cls)
        return cls


def load(family: str):
    """The zoo's ``torchtitan.models.<family>`` package. Each training-only module is the real
    one where it imports here; only one that cannot (Triton absent, a torch too old for it)
    is stubbed, so a trainer imported later in the same process (graph_trainer's) still
    gets the real optimizers and parallelisms."""
    for name in _TRAINING_ONLY:  # leaves first: a stubbed leaf lets the next one import
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = _Stub(name)
    return importlib.import_module(f"torchtitan.models.{family}")


def model_config(model: str, layers: int, dim: int = 0, vocab: int = 0):
    """The zoo config of ``model`` (a MODELS key) with ``layers`` blocks, SDPA attention and
    optional ``dim`` / ``vocab`` overrides (0: the flavour's)."""
    m = MODELS[model]
    pkg = load(m["family"])
    from torchtitan.models.common import Embedding, Linear, ScaledDotProductAttention

    d, V = dim or m["dim"], vocab or m["vocab"]
    scale = d / m["dim"]
    heads = max(d // m["head_dim"], m["kv_ratio"])
    head_dim = d // heads
    kv = heads // m["kv_ratio"]
    ffn = m["ffn"] if d == m["dim"] else max(64, int(m["ffn"] * scale) // 64 * 64)
    if m["family"] == "llama3":
        from torchtitan.models.common import ComplexRoPE, RMSNorm

        cfg_cls = pkg.Llama3Model.Config
        blocks = pkg._build_llama3_layers(
            n_layers=layers, dim=d, n_heads=heads, n_kv_heads=kv, hidden_dim=ffn, fuse_qkv=True,
            rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend="flex")
        norm = RMSNorm.Config(normalized_shape=d, param_init=pkg._NORM_INIT)
        head_init, emb_init = pkg._output_linear_init(d), pkg._EMBEDDING_INIT
    else:
        from torchtitan.models.common import CosSinRoPE

        cfg_cls = pkg.Qwen3Model.Config
        blocks = pkg._build_qwen3_layers(
            n_layers=layers, dim=d, n_heads=heads, n_kv_heads=kv, head_dim=head_dim, hidden_dim=ffn,
            fuse_qkv=True, attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=40960, theta=1000000.0))
        norm = pkg._qwen3_norm(d)
        head_init, emb_init = pkg._LINEAR_INIT, pkg._EMBEDDING_INIT
    for b in blocks:
        b.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg_cls(dim=d, vocab_size=V, norm=norm, layers=blocks,
                   tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=d, param_init=emb_init),
                   lm_head=Linear.Config(in_features=d, out_features=V, param_init=head_init))


def _initialised(a: dict, dev, seed: int):
    """The fp32 zoo model on ``dev``, initialised by the zoo's ``init_states`` from ``seed``
    (the same weights on every rank and in every variant)."""
    import torch

    cfg = model_config(a["model"], a["layers"], a.get("dim", 0), a.get("vocab", 0))
    torch.manual_seed(seed)
    if dev.type == "cuda":
        torch.cuda.manual_seed(seed)
    with torch.device(dev):
        net = cfg.build()
        net.init_states(buffer_device=dev)
    return net


def build_full(a: dict, dev, seed: int):
    """The bf16 zoo model (``_initialised``), no grads, eval mode."""
    import torch

    net = _initialised(a, dev, seed)
    for p in net.parameters():  # stored in the compute dtype: no cast before the gather
        p.data = p.data.to(torch.bfloat16)  # (not net.to(): Llama's RoPE buffer is complex)
        p.requires_grad_(False)
    return net.eval()


def build_sharded(a: dict, dev, seed: int, mesh):
    """The same model under torchtitan's SimpleFSDP ``data_parallel(mode="fully_shard")``
    (as test/test_torchtitan.py): every parameter a Shard(0) DTensor gathered in the forward."""
    from torchtitan.experiments.graph_trainer import simple_fsdp

    # Its wrapper classes are cached per module class and close over the first mesh.
    simple_fsdp._wrap_class_cache.clear()
    net = simple_fsdp.data_parallel(build_full(a, dev, seed), mesh, mode="fully_shard")
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def tokens(a: dict, T: int, dev, seed: int):
    """``[1, T]`` token ids, the same on every rank."""
    import torch

    V = a["vocab"] or MODELS[a["model"]]["vocab"]
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randint(0, V, (1, T), device=dev, generator=g)


def build_for_training(a: dict, dev, seed: int, mesh, param_dtype=None, reduce_dtype=None):
    """The fp32 zoo model for training (``_initialised``) under SimpleFSDP ``fully_shard``
    with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` (None: fp32 compute; fp32
    reduce-scatters), in train mode."""
    import torch
    from torchtitan.experiments.graph_trainer import simple_fsdp

    net = _initialised(a, dev, seed)
    simple_fsdp._wrap_class_cache.clear()  # its wrapper classes close over the first mesh
    policy = simple_fsdp.MixedPrecisionPolicy(param_dtype=param_dtype,
                                              reduce_dtype=reduce_dtype or torch.float32)
    return simple_fsdp.data_parallel(net.train(), mesh, mode="fully_shard", mp_policy=policy)


def next_token_loss(logits, tokens):
    """Cross entropy of ``logits`` (of ``tokens[:, :-1]``) against ``tokens[:, 1:]``, in fp32."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
