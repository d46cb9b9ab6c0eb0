"""torch_ce.fsdp2 at world 3 (gloo, host transport): every weight of these models is
sharded unevenly (64 rows over 3 ranks: 22, 22, 20; FSDP2 pads each shard to 22 rows), so
every chunk carries padding, and the gathers must still equal FSDP2's own, bit for bit.
Training losses: bit-identical with FSDP2's reduce-scatter (the gathers move the same
bytes); within fp32 rounding is the bound for a reduce-scatter that sums in another order.
"""
from __future__ import annotations

import pytest
import torch

from mp_harness import quiet_warnings, run_ranks, seed_base
from test_fsdp2_host import infer, train

WORLD = 3


def _rank_all(rank, world, seed):
    quiet_warnings()
    torch.set_num_threads(1)
    return {
        "infer/llama3": infer(rank, world, seed, "llama3", late=True),
        "infer/dit/bf16": infer(rank, world, seed, "dit", torch.bfloat16),
        "train/llama3/bf16": train(rank, world, seed, "llama3", torch.bfloat16, late=True),
        "train/dit/fp32": train(rank, world, seed, "dit"),
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


@pytest.mark.parametrize("case", ["train/llama3/bf16", "train/dit/fp32"])
def test_uneven_training_losses(results, case):
    for rank, res in enumerate(results):
        got, want = res[case]["losses"]["torch_ce"], res[case]["losses"]["fsdp2"]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0)
        assert got == want, (rank, got, want)  # FSDP2's own reduce-scatter: the same sums
        assert res[case]["how"] == ["staged (training)"], (rank, res[case])
