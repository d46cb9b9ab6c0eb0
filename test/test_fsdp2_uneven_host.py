"""torch_ce.fsdp2 at world 3 (gloo, host transport): every weight of these models is
sharded unevenly (64 rows over 3 ranks: 22, 22, 20; FSDP2 pads each shard to 22 rows), so
every chunk carries padding, and the gathers must still equal FSDP2's own, bit for bit.
Training losses: bit-identical with FSDP2's reduce-scatter (the gathers move the same
bytes); within fp32 rounding with torch_ce's copy-engine reduce-scatter too (torchtitan's
Llama3 and Qwen3, fp32 and bf16 ``param_dtype``), which sums in another order.
"""
from __future__ import annotations

import pytest
import torch

from mp_harness import quiet_warnings, run_ranks, seed_base
from test_fsdp2_host import CE_RS_CASES, TRAIN_CE_RS, _dt, check_explained, infer, train

WORLD = 3


def _rank_all(rank, world, seed):
    quiet_warnings()
    torch.set_num_threads(1)
    return {
        "infer/llama3": infer(rank, world, seed, "llama3", late=True),
        "infer/dit/bf16": infer(rank, world, seed, "dit", torch.bfloat16),
        "train/llama3/bf16": train(rank, world, seed, "llama3", torch.bfloat16, late=True),
        "train/dit/fp32": train(rank, world, seed, "dit"),
        **{f"train/{fam}/{_dt(dt)}/ce_rs": train(rank, world, seed, fam, dt, reduce_scatter="copy_engine",
                                                 late=fam == "qwen3" and dt is None)
           for fam, dt in TRAIN_CE_RS},
    }


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank_all, WORLD, seed_base(), timeout=300)


@pytest.mark.parametrize("case", ["infer/llama3", "infer/dit/bf16"])
def test_uneven_inference_equals_fsdp2(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["equal"] == [True, True], (rank, r)
        assert r["statuses"] == ["bound"] and r["share"] == 1.0, (rank, r)


@pytest.mark.parametrize("case", ["train/llama3/bf16", "train/dit/fp32", *CE_RS_CASES])
def test_uneven_training_losses(results, case):
    for rank, res in enumerate(results):
        got, want = res[case]["losses"]["torch_ce"], res[case]["losses"]["fsdp2"]
        # the copy-engine reduce-scatter sums the 3 padded chunks in group index order, gloo
        # in its own: fp32 rounding, carried through 5 AdamW steps
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
        if not case.endswith("/ce_rs"):
            assert got == want, (rank, got, want)  # FSDP2's own reduce-scatter: the same sums
        assert res[case]["how"] == ["staged (training)"], (rank, res[case])
        assert res[case]["statuses"] == ["bound"] and res[case]["share"] == 1.0, (rank, res[case])
        check_explained(res[case], case.endswith("/ce_rs"), rank)
    assert results[0][case]["losses"]["fsdp2"] != results[1][case]["losses"]["fsdp2"]  # each rank its data
