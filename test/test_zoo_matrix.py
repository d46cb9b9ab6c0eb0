"""torchtitan's model zoo under graph_trainer's own ``apply_simple_fsdp``, on CPU gloo
ranks: every case bit-identical to the plain compiled run, and >= 99% of its gathered
weight bytes on the copy engines (test/zoo_matrix.py says what one case runs and checks;
test/zoo_models.py how the models are built and wrapped).

Default: ``zoo_matrix.DEFAULT``, the case that used to hang (zoo_matrix.py says why one
case is enough there); ~100 s on 2 cores, so the default suite leaves it to CI's 2.14.1
and 2.11 legs (.ci/legs.sh), which run it. The full matrix (dense Llama3 and
Qwen3, MoE Qwen3-MoE and DeepSeek-V3; fully_shard, HSDP 2 x 2, EP 2 on 4 ranks with
Shard(0) and Shard(1) experts; inference and training; fp32 and bf16 ``param_dtype``;
world 2, 3 and 4) is ``slow`` (TORCH_CE_SLOW=1). ``test/zoo_matrix_report.py`` runs the
same cases one by one and prints a table.

Each case is asserted in full (``Case.exercises`` says what it takes beyond an even model).

Each case has a timeout (``Case.timeout``); on a hang the harness prints every rank's
Python stacks before killing them (test/mp_harness.py).

Cost: compiling dominates (two compiled runs per case, Dynamo and Inductor's C++ kernels;
the kernels are shared by the cases of a session): on the 2 cores of the development
machine ~60 s for a 3-rank inference case and ~100 s for the 3-rank training default; the
whole matrix takes about 1.5 hours there, or ~15 minutes on 16 cores, 8 cases at a time
(bench/results/zoo_matrix_cpu.txt).
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("torchtitan")  # its modules then import, or the file fails loudly

import testenv  # noqa: E402
import zoo_matrix as M  # noqa: E402
from mp_harness import run_ranks, seed_base  # noqa: E402

SLOW = testenv.SLOW


def _param(cid: str, slow: bool, leg: bool = False):
    """``leg``: slow in the default suite (its 15 minutes), run by a CI leg all the same
    (TORCH_CE_RUN_SLOW, .ci/legs.sh)."""
    c = M.CASES[cid]
    marks = [pytest.mark.slow] if leg else []
    if slow:
        marks += [pytest.mark.slow, pytest.mark.skipif(not SLOW, reason="set TORCH_CE_SLOW=1 for the full matrix")]
    return pytest.param(cid, marks=marks, id=cid)


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """One Inductor cache root for the module's cases (zoo_matrix.run_case)."""
    return str(tmp_path_factory.mktemp("zoo_matrix_inductor"))


def _check(cid: str, cache: str) -> None:
    c = M.CASES[cid]
    seed = seed_base()
    print(f"{cid}: seed {seed}")  # shown with a failure's captured output
    res = run_ranks(M.run_case, c.world, vars(c), seed, cache, timeout=c.timeout,
                    env={"TORCH_CE_BIND_ARRIVAL_TIMEOUT_S": str(c.timeout // 2)})
    bad = M.shape_checks(c, res[0]["placements"]) + M.failures(c, res)
    if bad:
        print(res[0]["table"])  # rank 0's explain() table
    assert not bad, f"{cid}:\n" + "\n".join(bad)


@pytest.mark.parametrize("cid", [_param(i, slow=False, leg=True) for i in M.DEFAULT])
def test_zoo_case(cid, kernel_cache):
    _check(cid, kernel_cache)


@pytest.mark.parametrize("cid", [_param(i, slow=True) for i in M.CASES if i not in M.DEFAULT])
def test_zoo_case_full_matrix(cid, kernel_cache):
    _check(cid, kernel_cache)


def test_matrix_covers_the_gaps():
    """Every gap the matrix was built for has cases, in inference and training: uneven
    shards (world 3), cast slots (bf16 inference), the empty router gate, MoE training on
    the dense mesh (a mutated input), Shard(1) experts (efsdp * ep > num_experts)."""
    ex = {cid: c.exercises for cid, c in M.CASES.items()}
    assert ex["llama3-fully_shard-w2-train-bf16"] == frozenset()
    assert ex["qwen3_moe-ep-w4-infer-fp32-e4"] == frozenset()
    assert ex["llama3-fully_shard-w3-train-bf16"] == {"uneven"}
    assert ex["qwen3-hsdp-w4-infer-bf16"] == {"cast slots"}
    assert ex["deepseek_v3-fully_shard-w2-train-fp32-e4"] == {"mutation"}
    assert ex["qwen3_moe-ep-w4-infer-fp32-e2"] == {"empty shard", "dim1"}
    assert M.CASES["qwen3_moe-ep-w4-infer-fp32-e2"].experts_dim1
    assert not M.CASES["qwen3_moe-ep-w4-infer-fp32-e4"].experts_dim1
    both = {"infer", "train"}
    for gap, want in (("uneven", both), ("cast slots", {"infer"}), ("empty shard", both),
                      ("mutation", {"train"}), ("dim1", both)):
        phases = {M.CASES[cid].phase for cid, e in ex.items() if gap in e}
        assert phases == want, (gap, phases)
    assert len(M.DEFAULT) <= 6 and len(M.CASES) >= 40


def test_coverage_adapter_counts_refused_bytes():
    """The stopgap coverage (until explain().coverage() exists) counts a refused weight's
    gathers as collective bytes under its refusal reason, bound ones as CE bytes, and a
    run-time fallback under its reason."""
    import torch_ce
    from torch_ce import explanation

    class Census:
        graphs = [dict(graph_id=0, left=[("primals_2", 300), (None, 5)])]

    rows = [explanation.WeightRow(0, "a.weight", "primals_1", "bound", gathers=2, bytes=100),
            explanation.WeightRow(0, "b.weight", "primals_2", "refused", reason="cast before gather"),
            explanation.WeightRow(0, "c.weight", "primals_3", "fallback", bytes=50, reason="rank disagreement")]
    real = torch_ce.explain
    torch_ce.explain = lambda print_table=False: explanation.Explanation({}, [], [], [], rows, {})
    try:
        cov = M.coverage(Census())
    finally:
        torch_ce.explain = real
    if cov["source"] != "explain().coverage()":  # once coverage() lands, it is the one tested
        tot = cov["total"]
        assert tot["ce_bytes"] == 200 and tot["collective_bytes"] == 355, tot
        assert tot["by_reason"] == {"cast before gather": 300, "rank disagreement": 50,
                                    "collective gather beside bound ones": 5}, tot
        assert abs(tot["share"] - 200 / 555) < 1e-12
