"""No hang, ever, from a refusal pattern (3 gloo ranks, host transport).

- ``test_uneven_training_reshards_alike``: a SimpleFSDP model whose dims are not divisible
  by 3, trained with AdamW on 3 ranks with reshard after forward. The rank whose shards are
  padded (``constant_pad_nd`` before its gathers) used to tag no backward re-gathers while
  its peers did: ranks 0-1 waited in an all_gather, rank 2 in a reduce_scatter. The reshard
  pass now decides from rank-independent facts (NOTE [reshard after forward] in
  passes/reshard.py): every rank has the same backward collectives, and the losses are
  bit-identical to the plain compiled run's.
- ``test_empty_shard_binds_like_its_peers``: ``Linear(64 -> 2)`` on 3 ranks (one rank's
  shard is empty): inference and training, several calls, exact; the empty rank takes the
  same bind path as its peers (runtime/bind_step.py, NOTE [empty shards]).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan.experiments.graph_trainer.simple_fsdp")

from mp_harness import run_ranks, seed_base, setup_compile  # noqa: E402


class Uneven(torch.nn.Module):
    """Dims not divisible by 3 (32, 40, 2): uneven Shard(0) on 3 ranks; ``tiny`` has fewer
    rows than ranks (one rank's shard is empty)."""

    def __init__(self, dim: int = 32, hidden: int = 40, out: int = 2):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=True)
        self.down = torch.nn.Linear(hidden, dim, bias=False)
        self.tiny = torch.nn.Linear(dim, out, bias=True)

    def forward(self, x):
        x = x + self.down(torch.relu(self.up(x)))
        return self.tiny(x)


def build(seed, model_cls=Uneven, param_dtype=None, **kw):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.experiments.graph_trainer import simple_fsdp

    torch.manual_seed(seed)
    simple_fsdp._wrap_class_cache.clear()
    policy = simple_fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return simple_fsdp.data_parallel(model_cls(**kw), mesh, mode="fully_shard", mp_policy=policy)


def train(transport, seed, xs, steps=3, **cfg):
    """Losses of ``steps`` AdamW steps of the compiled model (reshard after forward)."""
    import torch_ce

    torch._dynamo.reset()
    model = build(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch_ce.enable(transport=transport, reshard_after_forward=True, **cfg)
    try:
        compiled = torch.compile(model)
        losses = []
        for i in range(steps):
            loss = compiled(xs[i % len(xs)]).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses
    finally:
        torch_ce.disable()


def infer(transport, seed, xs, **cfg):
    import torch_ce

    torch._dynamo.reset()
    model = build(seed)
    torch_ce.enable(transport=transport, **cfg)
    try:
        compiled = torch.compile(model)
        with torch.no_grad():
            return [compiled(x) for x in xs]
    finally:
        torch_ce.disable()


def _rank_uneven_training(rank, world, seed, cache):
    setup_compile(cache, rank)
    gen = torch.Generator().manual_seed(seed + rank)
    xs = [torch.randn(3, 5, 32, generator=gen) for _ in range(2)]
    ref = train("nccl", seed, xs)
    ce = train("copy_engine", seed, xs)
    return ref, ce


def test_uneven_training_reshards_alike(tmp_path):
    res = run_ranks(_rank_uneven_training, 3, seed_base(), str(tmp_path), timeout=240,
                    env={"TORCH_CE_BIND_ARRIVAL_TIMEOUT_S": "120"})
    for rank, (ref, ce) in enumerate(res):
        assert ce == ref, f"rank {rank}: losses differ\nref {ref}\nce  {ce}"
        assert len(set(ref)) > 1, f"rank {rank}: nothing trains"


def _rank_empty_inference(rank, world, seed, cache):
    setup_compile(cache, rank)
    gen = torch.Generator().manual_seed(seed + rank)
    xs = [torch.randn(3, 5, 32, generator=gen) for _ in range(3)]
    ref = infer("nccl", seed, xs)
    ce = infer("copy_engine", seed, xs)
    return [torch.equal(a, b) for a, b in zip(ref, ce)]


def test_empty_shard_binds_like_its_peers(tmp_path):
    res = run_ranks(_rank_empty_inference, 3, seed_base(), str(tmp_path), timeout=240,
                    env={"TORCH_CE_BIND_ARRIVAL_TIMEOUT_S": "120", "TORCH_CE_BIND_TIMEOUT_S": "20"})
    for rank, exact in enumerate(res):
        assert all(exact), f"rank {rank}: outputs differ from the plain compiled run: {exact}"
