"""Models the FSDP2 tests shard with ``fully_shard``: torchtitan's Llama3 and Qwen3 (the zoo's
layer builders, CPU-sized: test/zoo_models.py) under torchtitan's own
``apply_fsdp_to_decoder``, and a small DiT (self-attention, cross-attention to a text
context, an MLP, each with adaLN modulation from a timestep embedding), one FSDP unit per
block plus the root."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import zoo_models


class DiTBlock(nn.Module):
    """A DiT block: adaLN-zero modulation (6 x dim from the conditioning) of a self-attn,
    a cross-attn to the context and a GELU MLP."""

    def __init__(self, dim: int, heads: int, ctx_dim: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(ctx_dim, 2 * dim)
        self.cross_proj = nn.Linear(dim, dim)
        self.mlp_in = nn.Linear(dim, 4 * dim)
        self.mlp_out = nn.Linear(4 * dim, dim)
        self.ada = nn.Linear(dim, 9 * dim)  # shift, scale, gate per sub-layer

    def _attn(self, q, k, v):
        b, n, d = q.shape
        split = lambda t: t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        return F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).reshape(b, n, d)

    def forward(self, x, ctx, cond):
        mods = self.ada(F.silu(cond)).unsqueeze(1).chunk(9, dim=-1)
        norm = lambda t, i: F.layer_norm(t, t.shape[-1:]) * (1 + mods[i + 1]) + mods[i]  # noqa: E731
        h = norm(x, 0)
        x = x + mods[2] * self.proj(self._attn(*self.qkv(h).chunk(3, dim=-1)))
        h = norm(x, 3)
        x = x + mods[5] * self.cross_proj(self._attn(self.q(h), *self.kv(ctx).chunk(2, dim=-1)))
        h = norm(x, 6)
        return x + mods[8] * self.mlp_out(F.gelu(self.mlp_in(h)))


class DiT(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, ctx_dim: int = 24, blocks: int = 2, patch: int = 12):
        super().__init__()
        self.embed = nn.Linear(patch, dim)
        self.t_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(DiTBlock(dim, heads, ctx_dim) for _ in range(blocks))
        self.out = nn.Linear(dim, patch)

    def forward(self, x, ctx, t):
        cond = self.t_embed(t)
        h = self.embed(x)
        for b in self.blocks:
            h = b(h, ctx, cond)
        return self.out(h)


def dit_inputs(seed: int, batch: int = 2, tokens: int = 6, ctx: int = 5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, tokens, 12, generator=g), torch.randn(batch, ctx, 24, generator=g),
            torch.rand(batch, 1, generator=g))


def per_param_mesh(world: int):
    """A ``shard_placement_fn`` that shards every 1-D parameter (biases) over another
    process group of the same ranks: two FSDP param groups per module (torch >= 2.12's
    per-parameter meshes, as MoE experts on their own mesh), or None on a torch without."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    except ImportError:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    other = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu")
    info = _get_mesh_info(other, None)

    def fn(p):
        return ShardPlacementResult(placement=Shard(0), mesh_info=info) if p.dim() == 1 else None

    return fn


def shard_dit(model: DiT, mesh, param_dtype=None, **kw) -> DiT:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp, **kw)
    fully_shard(model, mesh=mesh, mp_policy=mp, **kw)
    return model


def build(family: str, mesh, seed: int, *, param_dtype=None, train: bool, compile_blocks: bool = False,
          force_sum: bool = True, shard_kw: dict | None = None):
    """``family`` ("llama3", "qwen3", "dit") from ``seed`` (the same weights on every rank),
    ``fully_shard``ed as torchtitan's trainer does (blocks compiled first when asked), in
    train mode with grads or in eval mode without. ``force_sum=False`` keeps torchtitan's
    ``PREMUL_SUM(1.0)`` (the caller then gives the reference run a comm gloo can run:
    ``premul_reference``). ``shard_kw``: more ``fully_shard`` arguments (the DiT's)."""
    torch.manual_seed(seed)
    if family == "dit":
        net = DiT()
        blocks = list(net.blocks)
    else:
        zoo_models._stub_training_imports()
        cfg = zoo_models.model_config(family, zoo_models.Dims(layers=2))
        with torch.device("cpu"):
            net = cfg.build()
            net.init_states(buffer_device=torch.device("cpu"))
        blocks = list(net.layers.values())
    if compile_blocks:
        for b in blocks:
            b.compile()
    net.train(train)
    if not train:
        net.requires_grad_(False)
    if family == "dit":
        return shard_dit(net, mesh, param_dtype, **(shard_kw or {}))
    # Blocks, embeddings, norm + head, and the root, as torchtitan's trainer shards them.
    _apply_fsdp_to_decoder(net, mesh, param_dtype or torch.float32, torch.float32)
    # Its gradient divide factor 1.0 reduces with PREMUL_SUM, which gloo lacks: SUM (the
    # same sums: no division either way).
    from torch.distributed.fsdp import FSDPModule

    for mod in net.modules() if force_sum else ():
        if isinstance(mod, FSDPModule):
            mod.set_force_sum_reduction_for_comms(True)
    return net


def _apply_fsdp_to_decoder(net, mesh, param_dtype, reduce_dtype) -> None:
    """torchtitan's ``apply_fsdp_to_decoder`` (dense decoders, no PP); where torchtitan's
    module does not import (torch 2.11 lacks the ``DataParallelMeshDims`` it imports), the
    same units by hand: the embeddings, norm + head (not resharded after forward), each
    block, the root; gradient division off (its divide factor 1.0)."""
    try:
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    except ImportError:
        apply_fsdp_to_decoder = None
    if apply_fsdp_to_decoder is not None:
        apply_fsdp_to_decoder(net, mesh, param_dtype, reduce_dtype, pp_enabled=False)
        return
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    kw = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                        cast_forward_inputs=False))
    assert not getattr(net, "enable_weight_tying", False)
    fully_shard(net.tok_embeddings, reshard_after_forward=True, **kw)
    fully_shard([net.norm, net.lm_head], reshard_after_forward=False, **kw)
    for block in net.layers.values():
        fully_shard(block, reshard_after_forward=True, **kw)
    fully_shard(net, **kw)
    for m in net.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)


def premul_reference(net) -> None:
    """FSDP2's reduce-scatter of ``net`` (built with ``force_sum=False``) as NCCL would run
    torchtitan's ``PREMUL_SUM(1 / divide factor)``: gloo's sum of the premultiplied
    gradients (test_fsdp2_reduce_scatter_host._PremulReference)."""
    from test_fsdp2_reduce_scatter_host import _PremulReference
    from torch.distributed.fsdp import FSDPModule

    from torch_ce.fsdp2.reduce_scatter import _divide_factor

    for m in net.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(_PremulReference(_divide_factor(m) or 1.0))


def inputs(family: str, seed: int):
    if family == "dit":
        return dit_inputs(seed)
    return (zoo_models.tokens(256, 2, 8, seed),)


def loss_of(family: str, out, inp):
    if family == "dit":
        return out.float().pow(2).mean()
    return zoo_models.next_token_loss(out[:, :-1], inp[0])
