"""torchtitan's main trainer (FSDP2 ``fully_shard``) with torch_ce: ``--module
torch_ce.integrations.torchtitan_fsdp2`` (torch_ce/integrations/torchtitan_fsdp2.py).

Two CPU gloo ranks train torchtitan's Llama3 debug config (``llama3_debugmodel``, its model
the zoo's CPU size, SDPA on the math backend) 3 steps with the main ``Trainer``'s own step
(``forward_backward_step``) and AdamW, twice from the same weights and batches: the config
as torchtitan's registry gives it, and as this module's ``--config`` of the same name gives
it. The model is built as the trainer builds it: on the meta device, ``parallelize_fn``
(torchtitan's ``apply_fsdp_to_decoder`` inside), ``to_empty``, ``init_weights``. Every
rank asserts every loss bit-identical to torchtitan's own run, and explain() shows the
FSDP2 groups' gathers (and, with ``TORCH_CE_REDUCE_SCATTER=copy_engine``, the gradient
reduce-scatters) on the copy engines: 100% of the bytes, none on the collective.
"""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from mp_harness import run_ranks, seed_base

SEQ, BATCH, STEPS = 16, 2, 3


def _parallel_dims(world, backend):
    """The trainer's ParallelDims for FSDP over every rank, with the config's SPMD backend,
    its meshes on CPU (gloo)."""
    import torchtitan.distributed.parallel_dims as pd_mod
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    pd_mod.device_type = "cpu"
    dist_utils.set_spmd_backend(backend)
    pdims = ParallelDims(dp_shard=-1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, world_size=world,
                         spmd_backend=backend)
    pdims.build_mesh()
    return pdims


def _run(rank, world, seed, with_ce):
    import graph_trainer_harness as H

    H.prepare(register=False)
    import zoo_models as zm
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed.utils import get_spmd_context
    from torchtitan.trainer import Trainer

    import torch_ce

    if with_ce:
        import torch_ce.integrations.torchtitan_fsdp2 as registry
    else:
        import torchtitan.models.llama3.config_registry as registry
    cfg = registry.llama3_debugmodel()
    small = zm.model_config("llama3", zm.Dims(layers=2))
    cfg.model_spec.model = type(cfg.model_spec.model)(
        **{f.name: getattr(small, f.name) for f in dataclasses.fields(small)})
    cfg.loss = CrossEntropyLoss.Config()
    cfg.training.seq_len, cfg.training.local_batch_size = SEQ, BATCH
    # partial_dtensor (--parallelism.spmd_backend): the zoo's CPU-sized configs carry no
    # sharding configs for the default spmd_types' full-mesh DTensors
    cfg.parallelism.spmd_backend = "partial_dtensor"
    pdims = _parallel_dims(world, cfg.parallelism.spmd_backend)
    mcfg = cfg.model_spec.model
    mcfg.update_from_config(config=cfg)
    with torch.device("meta"):
        net = mcfg.build()
    net = cfg.model_spec.parallelize_fn(
        net, parallel_dims=pdims, training=cfg.training, parallelism=cfg.parallelism,
        compile_config=cfg.compile, ac_config=cfg.activation_checkpoint, dump_folder=cfg.dump_folder)
    # torchtitan's gradient divide factor (1.0) makes FSDP2 ask for PREMUL_SUM, which gloo
    # has not: gloo's sum of the premultiplied gradients stands in for NCCL's (torch_ce's
    # copy-engine reduce-scatter, where enabled, replaces it and serves PREMUL_SUM itself)
    from torch.distributed.fsdp import FSDPModule
    from test_fsdp2_reduce_scatter_host import _PremulReference
    from torch_ce.fsdp2.reduce_scatter import _divide_factor

    for m in net.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(_PremulReference(_divide_factor(m) or 1.0))
    net.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        net.init_weights(buffer_device=torch.device("cpu"))
    net.train()
    H.cpu_math_sdpa(net)
    tr = object.__new__(Trainer)
    tr.model_parts, tr.model_config, tr.config = [net], mcfg, cfg
    tr.loss_fn, tr.parallel_dims = cfg.loss.build(), pdims
    tr.train_context, tr.device = get_spmd_context(), torch.device("cpu")
    tr.fwd_bwd_fn = tr._forward_backward_body
    tr.tokenizer, tr.ntokens_seen = None, 0
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    pos = torch.arange(SEQ).repeat(BATCH, 1)
    tokens = torch.tensor(float(BATCH * SEQ * world))
    losses = []
    for x, y in H.batches(mcfg.vocab_size, world, rank, seed, STEPS):
        opt.zero_grad()
        loss = tr.forward_backward_step(input_dict={"input": x, "positions": pos}, labels=y,
                                        global_valid_tokens=tokens)
        opt.step()
        losses.append(loss.detach().clone())
    e = torch_ce.explain()
    rows = [(r.module, r.status, r.reason, r.reduce_scatter, r.calls) for r in torch_ce.fsdp2.rows()] if with_ce else []
    from torch_ce.runtime import reduce_scatter as RS

    rs = {n: (s.ce_bytes, s.collective_bytes, s.reason) for n, s in RS.served.items()}
    print(e.table(), file=sys.stderr)
    return dict(losses=losses, rows=rows, rs=rs)


@pytest.mark.parametrize("reduce_scatter", ["collective", "copy_engine"])
def test_main_trainer_llama3_with_the_option(reduce_scatter):
    seed = seed_base()
    ref = run_ranks(_run, 2, seed, False, timeout=300)
    env = {"TORCH_CE_REDUCE_SCATTER": reduce_scatter}
    got = run_ranks(_run, 2, seed, True, timeout=300, env=env)
    for rank, (a, b) in enumerate(zip(ref, got)):
        assert len(b["losses"]) == STEPS
        for step, (x, y) in enumerate(zip(a["losses"], b["losses"])):
            assert torch.equal(x, y), (rank, step, x.item(), y.item())
        assert b["rows"], "the option served no FSDP2 group"
        for name, status, reason, rs_reason, calls in b["rows"]:
            assert status == "bound" and calls > 0, (rank, name, status, reason, calls)
            if reduce_scatter == "copy_engine":
                assert rs_reason == "copy engine", (rank, name, rs_reason)
        if reduce_scatter == "copy_engine":
            assert b["rs"] and all(ce > 0 and coll == 0 for ce, coll, _ in b["rs"].values()), b["rs"]
        else:
            assert not b["rs"], b["rs"]
    assert not torch.equal(ref[0]["losses"][0], ref[0]["losses"][-1])  # it trained
