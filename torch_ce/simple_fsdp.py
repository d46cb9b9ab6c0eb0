"""A small SimpleFSDP-style client: the model the demo and benchmarks compile.

Weights are DTensors sharded Shard(0) over a 1-D mesh; a parametrization turns each into
the full weight in the forward with ``redistribute(Replicate()).to_local()``, the way
torchtitan's SimpleFSDP does. Under plain torch.compile every weight access becomes
``all_gather_into_tensor`` + ``wait_tensor`` in the post-grad graph.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as P
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


class Layer(nn.Module):
    """A decoder layer: RMSNorm, causal attention, RMSNorm, SwiGLU MLP (no biases)."""

    def __init__(self, dim: int, ffn: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)
        self.n1 = nn.RMSNorm(dim)
        self.n2 = nn.RMSNorm(dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.n1(x)).chunk(3, -1)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.o(a)
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Decoder(nn.Module):
    def __init__(self, layers: int = 2, dim: int = 256, ffn: int = 512, heads: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim, ffn, heads) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def gathered(w, dtype: torch.dtype | None = None):
    """The full weight a forward sees: ``redistribute(Replicate()).to_local()`` of a
    DTensor (cast to ``dtype`` first, as SimpleFSDP's ``param_dtype`` does); a plain tensor
    as it is."""
    if not isinstance(w, DTensor):
        return w
    from .runtime import eager

    if not eager.tracing(w):  # NOTE [eager gathers] in torch_ce/runtime/eager.py
        out = eager.gather_param(w, dtype)
        if out is not None:
            return out
    if dtype is None:
        return w.redistribute(placements=[Replicate()]).to_local()
    return w.redistribute(placements=[Replicate()], forward_dtype=dtype).to_local()


class GatherWeight(nn.Module):
    """The forward's view of a sharded weight: the full tensor, gathered (the
    parametrization; ``dtype``: gather the cast)."""

    def __init__(self, dtype: torch.dtype | None = None):
        super().__init__()
        self.dtype = dtype

    def forward(self, w):
        return gathered(w, self.dtype)


def shard_param(mod: nn.Module, name: str, mesh, *, cast: torch.dtype | None = None,
                requires_grad: bool = False) -> None:
    """Make ``mod.<name>`` a Shard(0) DTensor parameter over ``mesh`` that the forward
    gathers (SimpleFSDP's parametrization); the one helper the demo, the benches and the
    tests share."""
    w = getattr(mod, name).detach()
    setattr(mod, name, nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]), requires_grad=requires_grad))
    P.register_parametrization(mod, name, GatherWeight(cast), unsafe=True)


def shard_linears(model: nn.Module, mesh) -> nn.Module:
    """Shard every nn.Linear weight Shard(0) over ``mesh`` (inference: no grads)."""
    for m in list(model.modules()):
        if isinstance(m, nn.Linear):
            shard_param(m, "weight", mesh)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def build(seed: int, device, dtype, mesh=None, **dims) -> nn.Module:
    """The same Decoder on every rank (seeded), sharded over ``mesh`` if given."""
    torch.manual_seed(seed)
    model = Decoder(**dims).to(device=device, dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return shard_linears(model, mesh) if mesh is not None else model
