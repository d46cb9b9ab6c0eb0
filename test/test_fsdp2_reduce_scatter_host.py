"""FSDP2's gradient reduce-scatter through ``set_custom_reduce_scatter`` on the copy-engine
protocol (torch_ce/fsdp2/reduce_scatter.py), host transport, gloo ranks.

Each rank trains two copies of the same ``fully_shard``ed model from the same weights and
batches, 5 AdamW steps: FSDP2's default reduce-scatter (gloo) and the protocol's. Every
rank asserts every step's loss and, at the end, its every parameter shard against the
default: bit-identical at world 2 (a sum of two is order-free), within fp32 rounding at
world 3 (uneven shards: padded chunks; the protocol sums in group index order, gloo in
its own). One rank is seconds late before the first backward and a random rank a little
late at the others (the protocol has no barrier to hide behind).

Cases: fp32 (and, slow, HSDP 2 x 2 at world 4: the reduce-scatter within each shard pair
on the protocol, the all-reduce across pairs on gloo); bf16 ``param_dtype`` with fp32 gradients reduced; bf16 gradients reduced
(``reduce_dtype`` bf16); ``set_gradient_divide_factor(1.0)`` (torchtitan's: FSDP2 asks
for ``PREMUL_SUM(1.0)``, which gloo has not, so the default run's reference is gloo's sum
of the premultiplied gradients, what NCCL does); a factor of 3 (``PREMUL_SUM(1/3)``).
"""
from __future__ import annotations

import time

import pytest
import torch

from mp_harness import run_ranks, seed_base

STEPS = 5


class _Block(torch.nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d, bias=False)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Model(torch.nn.Module):
    def __init__(self, d, h, n):
        super().__init__()
        self.emb = torch.nn.Linear(5, d)
        self.blocks = torch.nn.ModuleList(_Block(d, h) for _ in range(n))
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


class _PremulReference:
    """FSDP2's ReduceScatter for the reference run where it asks for PREMUL_SUM: gloo's
    sum of the input premultiplied by 1 / the divide factor (NCCL's premul_sum; torch
    2.11's op does not expose its factor), AVG and SUM as gloo does them."""

    def __init__(self, divide_factor):
        self.factor = 1 / divide_factor

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch.distributed as dist

        if getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM:
            return dist.reduce_scatter_tensor(output_tensor, input_tensor * self.factor,
                                              op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)


def _mesh(world, hsdp):
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:  # HSDP: shard within pairs, replicate across them (the all-reduce stays gloo's)
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _build(seed, dims, mesh, case):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = _Model(*dims)
    mp = None
    if case == "bf16_param":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif case == "bf16_reduce":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    kw = dict(mesh=mesh, mp_policy=mp) if mp is not None else dict(mesh=mesh)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    modules = [*model.blocks, model]
    if case.startswith("premul"):
        for m in modules:
            m.set_gradient_divide_factor(1.0 if case == "premul_1" else 3.0)
    return model, modules


def _train(model, seed, rank, world, late, log):
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed + 7 + rank)  # each rank its own batch
    pick = torch.Generator().manual_seed(seed + 3)  # the same on every rank
    losses = []
    for step in range(STEPS):
        x = torch.randn(6, 5, generator=gen)
        loss = model(x)
        late_rank = late if step == 0 else int(torch.randint(world, (1,), generator=pick))
        delay = 2.0 if step == 0 else 0.3 * float(torch.rand(1, generator=pick))
        if log and rank == late_rank:
            time.sleep(delay)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    dist.barrier()
    return losses, [p.to_local().detach().clone() for p in model.parameters()]


def _rank(rank, world, seed, case, dims, hsdp=False):
    import torch.distributed as dist

    import torch_ce
    from torch_ce.fsdp2 import reduce_scatter as ce_rs
    from torch_ce.runtime import reduce_scatter as RS

    torch_ce.config.update(rs_timeout_s=60.0)
    mesh = _mesh(world, hsdp)
    ref, ref_modules = _build(seed, dims, mesh, case)
    if case.startswith("premul"):
        for m in ref_modules:
            m.set_custom_reduce_scatter(_PremulReference(1.0 if case == "premul_1" else 3.0))
    ref_losses, ref_params = _train(ref, seed, rank, world, late=1, log=False)

    model, modules = _build(seed, dims, mesh, case)
    reasons = []
    for k, m in enumerate(modules):
        assert ce_rs.install(m, None, reasons.append, name=f"m{k}"), reasons
    losses, params = _train(model, seed, rank, world, late=world - 1, log=True)
    served = {n: (s.ce_bytes, s.collective_bytes, s.reason) for n, s in RS.served.items()}
    for m in modules:
        ce_rs.uninstall(m)
    dist.barrier()
    return dict(ref_losses=ref_losses, losses=losses, ref_params=ref_params, params=params,
                served=served)


CASES = [
    ("fp32", 2), ("bf16_param", 2), ("bf16_reduce", 2), ("premul_1", 2), ("premul_3", 2),
    ("fp32", 3),
    pytest.param("fp32", 4, marks=pytest.mark.slow),  # HSDP 2 x 2
]


def _id(c):
    case, world = c.values if hasattr(c, "values") else c
    return f"{case}-w{world}" + ("-hsdp" if world == 4 else "")


@pytest.mark.parametrize("case,world", CASES, ids=[_id(c) for c in CASES])
def test_fsdp2_trains_on_the_copy_engine_reduce_scatter(case, world):
    # world 3: dims not divisible by 3, so FSDP2 pads the shards (uneven chunks)
    dims = (17, 41, 2) if world == 3 else (16, 40, 2)
    out = run_ranks(_rank, world, seed_base(), case, dims, world == 4, timeout=300)
    for rank, r in enumerate(out):
        assert r["served"], "no reduce-scatter went through the protocol"
        for name, (ce, coll, why) in r["served"].items():
            assert ce > 0 and coll == 0, (rank, name, ce, coll, why)
        assert len(r["losses"]) == STEPS
        for step, (a, b) in enumerate(zip(r["losses"], r["ref_losses"])):
            if world != 3:  # HSDP: sums of two within each shard group
                assert torch.equal(a, b), (rank, step, a.item(), b.item())
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for k, (a, b) in enumerate(zip(r["params"], r["ref_params"])):
            if world != 3:
                assert torch.equal(a, b), (rank, k, (a - b).abs().max().item())
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        # the training moved the weights (a test that compared two untrained copies would pass)
    assert not torch.equal(out[0]["losses"][0], out[0]["losses"][-1])
