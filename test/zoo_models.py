"""torchtitan's model zoo, small, wrapped the way graph_trainer wraps it: the test side of
the zoo matrix (test/test_zoo_matrix.py, test/zoo_matrix_report.py).

Four families, each built from the zoo's own layer builders (the same ones its factories
call), with CPU-sized dims:

- ``llama3``, ``qwen3``: dense decoders (GQA, fused QKV).
- ``qwen3_moe``: Qwen3's MoE layers (softmax router, no shared experts).
- ``deepseek_v3``: MLA attention, MoE with a shared expert (dense-FFN blocks first when
  there is more than one block).

Every layer's ``inner_attention`` is the zoo's ``ScaledDotProductAttention`` (causal,
no masks), as graph_trainer's own tests do (``build_decoder_config_for_backend``,
"sdpa"): the flex BlockMask builder needs torch 2.13 and is not what these tests are about.

Parallelism is graph_trainer's, unchanged: a ``ParallelDims`` (graph_trainer's
``partial_dtensor`` SPMD backend) builds the meshes; with expert parallelism the model's
own ``parallelize`` (its MoE sharding configs: experts ``Shard(0)`` over ``ep``, the
all-to-all token dispatcher wired to the ep mesh) runs first, exactly as
``graph_trainer/<family>/parallelize.py`` does; then
``graph_trainer.common_utils.apply_simple_fsdp`` wraps the dense weights on the fsdp mesh
(or ``dp_replicate x fsdp`` for HSDP) and the routed experts on the edp mesh, on dim 1 when
``efsdp * ep > num_experts``. What graph_trainer adds around that is left out: its
``apply_compile`` (the tests compile with plain ``torch.compile``, the point of torch_ce)
and its FX annotations (node metadata for its own passes).

The zoo's packages import their training stack (torchtitan's trainer needs torchdata, the
expert-parallel kernels triton): ``torch_ce.bench.zoo.load`` stubs those modules, and the
graph_trainer model subclasses (``GraphTrainer<X>Model``: the same model, initialised
with the parametrization off) are not importable without the trainer, so the zoo's base
classes are built and initialised before any wrapping (where the two agree).

On CPU, ``torchtitan.tools.utils.device_type`` is "cuda" whenever no accelerator is
found; ``parallel_dims`` points ParallelDims' mesh at "cpu" (gloo).
"""
from __future__ import annotations

import dataclasses

import torch

FAMILIES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3")
MOE = ("qwen3_moe", "deepseek_v3")


@dataclasses.dataclass(frozen=True)
class Dims:
    """CPU-sized shapes. ``dim`` 64 and ``vocab`` 256 are even on 2 and 4 ranks and
    uneven on 3 (64 = 22 + 21 + 21 rows: the shard torch.chunk makes short is the last).
    One block by default: it holds every kind of weight its family has (a second block
    only repeats them, and doubles Dynamo's tracing, the largest cost of a case on CPU);
    DeepSeek-V3's first ``layers - 1`` blocks are its dense-FFN ones, the last an MoE."""

    layers: int = 1
    dim: int = 64
    vocab: int = 256
    ffn: int = 128
    heads: int = 4
    kv_heads: int = 2
    experts: int = 4
    top_k: int = 2
    moe_ffn: int = 32


def _stub_training_imports() -> None:
    """torch_ce.bench.zoo's stubs of the zoo's training-only modules, before any torchtitan
    import that reaches them (module docstring)."""
    from torch_ce.bench import zoo

    zoo.load("llama3")


def _sdpa(layers):
    from torchtitan.models.common import ScaledDotProductAttention

    for b in layers:
        b.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def model_config(family: str, d: Dims = Dims()):
    """The zoo config of ``family`` with ``d``'s shapes (no sharding configs yet)."""
    from torch_ce.bench import zoo

    pkg = zoo.load("qwen3" if family == "qwen3_moe" else family)
    from torchtitan.models.common import Embedding, Linear

    head_dim = d.dim // d.heads
    emb = Embedding.Config(num_embeddings=d.vocab, embedding_dim=d.dim, param_init=pkg._EMBEDDING_INIT)
    if family == "llama3":
        from torchtitan.models.common import ComplexRoPE, RMSNorm

        layers = pkg._build_llama3_layers(
            n_layers=d.layers, dim=d.dim, n_heads=d.heads, n_kv_heads=d.kv_heads, hidden_dim=d.ffn,
            fuse_qkv=True, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=4096, theta=500000, scaling="llama"))
        return pkg.Llama3Model.Config(
            dim=d.dim, vocab_size=d.vocab, layers=_sdpa(layers), tok_embeddings=emb,
            norm=RMSNorm.Config(normalized_shape=d.dim, param_init=pkg._NORM_INIT),
            lm_head=Linear.Config(in_features=d.dim, out_features=d.vocab,
                                  param_init=pkg._output_linear_init(d.dim)))
    if family in ("qwen3", "qwen3_moe"):
        from torchtitan.models.common import CosSinRoPE

        rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1000000.0)
        common = dict(n_layers=d.layers, dim=d.dim, n_heads=d.heads, n_kv_heads=d.kv_heads,
                      head_dim=head_dim, fuse_qkv=True, attn_backend="flex", rope=rope)
        if family == "qwen3":
            layers = pkg._build_qwen3_layers(hidden_dim=d.ffn, **common)
        else:
            layers = pkg._build_qwen3_moe_layers(moe_hidden_dim=d.moe_ffn, num_experts=d.experts,
                                                 top_k=d.top_k, moe_comm_backend="standard", **common)
        return pkg.Qwen3Model.Config(
            dim=d.dim, vocab_size=d.vocab, layers=_sdpa(layers), tok_embeddings=emb,
            norm=pkg._qwen3_norm(d.dim),
            lm_head=Linear.Config(in_features=d.dim, out_features=d.vocab, param_init=pkg._LINEAR_INIT))
    if family == "deepseek_v3":
        from torchtitan.models.common import ComplexRoPE, RMSNorm

        rope_dim = 8
        layers = pkg._build_dsv3_layers(
            n_layers=d.layers, n_dense_layers=d.layers - 1, dim=d.dim, n_heads=d.heads, q_lora_rank=0,
            kv_lora_rank=32, qk_nope_head_dim=head_dim, qk_rope_head_dim=rope_dim, v_head_dim=head_dim,
            mscale=0.70, dense_hidden_dim=d.ffn, moe_hidden_dim=d.moe_ffn, num_experts=d.experts,
            num_shared_experts=1, router_top_k=d.top_k, router_score_func="softmax",
            attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=4096, theta=10000.0, scaling="yarn",
                                    rope_factor=40.0, beta_fast=32.0, beta_slow=1.0,
                                    original_seq_len=4096))
        return pkg.DeepSeekV3Model.Config(
            dim=d.dim, vocab_size=d.vocab, layers=_sdpa(layers), tok_embeddings=emb,
            norm=RMSNorm.Config(normalized_shape=d.dim, param_init=pkg._NORM_INIT),
            lm_head=Linear.Config(in_features=d.dim, out_features=d.vocab,
                                  param_init=pkg._output_linear_init(d.dim)))
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def _set_sharding(family: str, cfg, enable_ep: bool) -> None:
    """What the model config's ``update_from_config`` does for a job without SP."""
    if family in ("qwen3", "qwen3_moe"):
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=enable_ep)
    elif family == "deepseek_v3":
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

        set_deepseek_v3_sharding_config(cfg, enable_sp=False, enable_ep=enable_ep)
    else:
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(cfg, enable_sp=False)


def parallel_dims(world: int, mode: str, ep: int = 1, device: str = "cpu"):
    """graph_trainer's ``ParallelDims`` for ``mode`` ("fully_shard", "hsdp": dp_replicate 2
    x fsdp, "ep": fully_shard with expert parallelism ``ep``), its meshes built on
    ``device`` (CPU: gloo)."""
    _stub_training_imports()
    import torchtitan.distributed.parallel_dims as pd_mod
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    pd_mod.device_type = device  # NOTE in the module docstring
    dist_utils.set_spmd_backend("partial_dtensor")
    replicate = 2 if mode == "hsdp" else 1
    pdims = ParallelDims(dp_shard=-1, dp_replicate=replicate, cp=1, tp=1, pp=1,
                         ep=ep if mode == "ep" else 1, world_size=world, spmd_backend="partial_dtensor")
    pdims.build_mesh()
    return pdims


def training_config(param_dtype: torch.dtype | None):
    """graph_trainer's ``TrainingConfig`` for ``apply_simple_fsdp``: ``param_dtype`` (None:
    fp32) as ``mixed_precision_param``, fp32 reduce."""
    from torchtitan.config import TrainingConfig

    name = {None: "float32", torch.float32: "float32", torch.bfloat16: "bfloat16"}[param_dtype]
    return TrainingConfig(mixed_precision_param=name, mixed_precision_reduce="float32")


def build(family: str, pdims, param_dtype, *, train: bool, seed: int, d: Dims = Dims()):
    """The fp32 zoo model of ``family`` (weights from ``seed``, the same on every rank and in
    every build), parallelized as graph_trainer does (module docstring), in train or eval
    mode. Inference builds have no grads."""
    _stub_training_imports()
    from torchtitan.experiments.graph_trainer import common_utils, simple_fsdp

    cfg = model_config(family, d)
    _set_sharding(family, cfg, pdims.ep_enabled)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        net = cfg.build()
        net.init_states(buffer_device=torch.device("cpu"))
    if pdims.tp_enabled or pdims.ep_enabled:
        net.parallelize(pdims)
    # simple_fsdp caches one wrapper class per module class; its properties close over the
    # first wrapped module's mesh and policy: a second build in one process needs a clean one.
    simple_fsdp._wrap_class_cache.clear()
    net = common_utils.apply_simple_fsdp(net, parallel_dims=pdims, training=training_config(param_dtype))
    net.train(train)
    if not train:
        for p in net.parameters():
            p.requires_grad_(False)
    return net


def placements(net) -> dict:
    """Parameter name -> (mesh dim names, placements) of every DTensor parameter."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in net.named_parameters():
        if isinstance(p, DTensor):
            out[n] = (tuple(p.device_mesh.mesh_dim_names or ()), tuple(str(x) for x in p.placements))
    return out


def tokens(vocab: int, batch: int, seq: int, seed: int):
    """``[batch, seq]`` token ids from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def next_token_loss(logits, toks):
    """Cross entropy of ``logits`` (of ``toks[:, :-1]``) against ``toks[:, 1:]``, in fp32."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().flatten(0, 1), toks[:, 1:].flatten())
