"""graph_trainer's traced step (``aot_fx_trace``, the ``torch_ce`` pass pipeline) with every
gradient reduce-scatter on the copy-engine path (``reduce_scatter="copy_engine"``; host
transport, 2 CPU gloo ranks; NOTE [copy-engine reduce-scatter] in
torch_ce/runtime/reduce_scatter/__init__.py).

One spawn trains graph_trainer's Llama3 debug config (bf16 ``param_dtype``, fp32 reduce)
for 3 AdamW steps under regional Inductor (2 blocks) and, slow (CI's 2.14.1 leg runs it),
full Inductor (1 block), each twice: the torch_ce pipeline with the reduce-scatters on gloo (the reference: the
gathers' copy-engine path is test/test_graph_trainer.py's) and with them on the copy
engines, retargeted after graph_trainer's own reduce-scatter bucketing
(``_pre_bucket_reduce_scatter``) and scheduling. On every rank: the losses bit-identical
(a sum of two is order-free), every reduce-scatter of the record on the copy engines and
served there at every step, and (regional, whose final graph is FX) no collective
reduce-scatter left in the final graph.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")
import graph_trainer_harness as H  # noqa: E402

if H.importable():
    pytest.skip(H.importable(), allow_module_level=True)

from mp_harness import run_ranks, seed_base  # noqa: E402

CASES = (("llama3", "regional", 2),)
SLOW_CASES = (("llama3", "full", 1),)  # CI's 2.14.1 leg runs it (.ci/legs.sh)


def _ranks(rank, world, seed, cache, cases):
    H.prepare()
    from mp_harness import setup_compile

    setup_compile(cache, rank)
    import torch_ce
    import zoo_models as zm

    pdims = zm.parallel_dims(world, "fully_shard")
    out = {}
    for fam, mode, layers in cases:
        for rs in ("collective", "copy_engine"):
            with torch_ce.config.patch(reduce_scatter=rs):
                out[(fam, mode, rs)] = H.one_run(fam, pdims, world, rank, seed, mode=mode, pipeline="torch_ce",
                                                 layers=layers)
    return out


def _check(res, cases):
    for rank, r in enumerate(res):
        for fam, mode, _ in cases:
            ref, ce = r[(fam, mode, "collective")], r[(fam, mode, "copy_engine")]
            assert len(ce["losses"]) == H.STEPS and len({float(x) for x in ref["losses"]}) > 1
            for i, (a, b) in enumerate(zip(ref["losses"], ce["losses"], strict=True)):
                assert torch.equal(a, b), (rank, mode, i, float(a), float(b))
            assert ref["rs"]["share"] == 0.0 and not ref["rs"]["served"], ref["rs"]
            cov = ce["rs"]
            assert cov["share"] == 1.0 and cov["ce_bytes"] > 0, (rank, mode, cov)
            served = cov["served"]
            assert served and all(s["calls"] and s["calls"] % H.STEPS == 0 and not s["collective_bytes"] for s in served.values()), served
            if mode == "regional":
                assert ref["rs_left"] and not ce["rs_left"], (rank, ref["rs_left"], ce["rs_left"])


def test_every_gradient_reduce_scatter_on_ce(tmp_path):
    _check(run_ranks(_ranks, 2, seed_base(), str(tmp_path), CASES, timeout=1200), CASES)


@pytest.mark.slow
def test_every_gradient_reduce_scatter_on_ce_full_inductor(tmp_path):
    _check(run_ranks(_ranks, 2, seed_base(), str(tmp_path), SLOW_CASES, timeout=1200), SLOW_CASES)
