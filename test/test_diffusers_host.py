"""A diffusers transformer in inference, as users run it (issue 47), on 2 gloo ranks with
the host transport: a tiny random ``FluxTransformer2DModel`` (built on CPU, no weights
downloaded) under torchtitan's SimpleFSDP ``fully_shard``, plain ``torch.compile(model)``
under ``no_grad``, compared exactly with the same model compiled without torch_ce.

- ``test_flux_inference_matches_plain_compile``: the output bit-identical to the plain
  compile on both ranks, every gather of the compiled call on the copy engines by
  ``explain().coverage()``, and every weight named as ``named_parameters()`` does.

Slow (``TORCH_CE_SLOW=1``): two compiles of the Flux blocks take ~80 s on 2 cores.
diffusers is a test-only dependency (``diffusers==0.42.1``, beside transformers in the
README's install line); without it this file skips.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from mp_harness import run_ranks, seed_base, setup_compile  # noqa: E402

TIMEOUT = 240


def _model(mesh):
    import diffusers
    from torchtitan.experiments.graph_trainer import simple_fsdp

    torch.manual_seed(0)
    net = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                           attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                           pooled_projection_dim=16, axes_dims_rope=(2, 2, 4)).eval()
    names = [n for n, _ in net.named_parameters()]
    simple_fsdp._wrap_class_cache.clear()
    model = simple_fsdp.data_parallel(net, mesh, mode="fully_shard")
    return model.requires_grad_(False), names


def _inputs(gen):
    tokens, text = 16, 4
    return dict(hidden_states=torch.randn(1, tokens, 8, generator=gen),
                encoder_hidden_states=torch.randn(1, text, 16, generator=gen),
                pooled_projections=torch.randn(1, 16, generator=gen),
                timestep=torch.rand(1, generator=gen),
                img_ids=torch.randint(0, 4, (tokens, 3), generator=gen).float(),
                txt_ids=torch.zeros(text, 3), return_dict=False)


def _rank(rank, world, seed, cache):
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh

    setup_compile(cache, rank)
    mesh = init_device_mesh("cpu", (2,))
    model, names = _model(mesh)
    kw = _inputs(torch.Generator().manual_seed(seed + rank))
    with torch.no_grad():
        ref = torch.compile(model)(**kw)[0]
    torch._dynamo.reset()
    torch_ce.enable(transport="copy_engine", cost_mode="default")
    try:
        torch_ce.reset_counts()
        with torch.no_grad():
            out = torch.compile(model)(**kw)[0]
        e = torch_ce.explain()
        cov = e.coverage()
        return dict(exact=torch.equal(out, ref), names=names, explained=sorted({w.param for w in e.weights}),
                    statuses=sorted({w.status for w in e.weights}), total=cov.total.as_dict(), table=e.table())
    finally:
        torch_ce.disable()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    seed = seed_base()
    return seed, run_ranks(_rank, 2, seed, str(tmp_path_factory.mktemp("diffusers").resolve()), timeout=TIMEOUT)


@pytest.mark.slow  # ~80 s on 2 cores (two compiles of the Flux blocks)
def test_flux_inference_matches_plain_compile(ranks):
    seed, res = ranks
    for rank, r in enumerate(res):
        ctx = f"rank {rank} (seed {seed})"
        assert r["exact"], f"{ctx}: output differs from the plain compile\n{r['table']}"
        assert r["statuses"] == ["bound"], (ctx, r["table"])
        assert r["explained"] == sorted(r["names"]), (ctx, sorted(set(r["explained"]) ^ set(r["names"])))
        tot = r["total"]
        assert tot["counted"] and tot["share"] == 1.0 and tot["eager_collective_bytes"] == 0, (ctx, r["table"])
