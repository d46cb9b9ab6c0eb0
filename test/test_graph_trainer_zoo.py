"""The zoo through graph_trainer's traced step and the ``"torch_ce"`` pass pipeline (slow):
every family of test/zoo_models.py (Llama3, Qwen3, Qwen3-MoE, DeepSeek-V3), built by
graph_trainer's own model classes and ``parallelize_fn`` (``apply_simple_fsdp``; with
expert parallelism the experts on the edp mesh, ``Shard(1)`` when ``efsdp * ep >
num_experts``), trained 3 AdamW steps (bf16 ``param_dtype``, regional Inductor) by
graph_trainer's default pipeline and by torch_ce's: the losses bit-identical, >= 99% of the
gathered weight bytes on the copy engines, the placements what the case says
(``zoo_matrix.shape_checks``). test/graph_trainer_harness.py says how a step runs on CPU.

The default suite's test/test_graph_trainer.py runs Llama3 and Qwen3-MoE (EP off) in both
Inductor modes; this file adds the other families and expert parallelism on 4 ranks
(``TORCH_CE_SLOW=1``; each case several minutes on 2 cores).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")
import graph_trainer_harness as H  # noqa: E402

if H.importable():  # a torch feature torchtitan's graph_trainer imports is absent (named)
    pytest.skip(H.importable(), allow_module_level=True)

import zoo_matrix as M  # noqa: E402
from mp_harness import run_ranks, seed_base  # noqa: E402

CASES = [M.Case(f, "fully_shard", "train", "bf16", 2) for f in ("llama3", "qwen3", "qwen3_moe", "deepseek_v3")]
CASES += [M.Case(f, "ep", "train", "bf16", 4, experts=e) for f in M.MOE_FAMILIES for e in (4, 2)]


def _rank(rank, world, case, seed, cache):
    H.prepare()
    from mp_harness import setup_compile

    setup_compile(cache, rank)
    import zoo_models as zm

    c = M.Case(**case)
    pdims = zm.parallel_dims(world, c.mode, c.ep)
    out = {}
    for pipeline in ("default", "torch_ce"):
        r = H.one_run(c.family, pdims, world, rank, seed, mode="regional", pipeline=pipeline,
                      experts=c.experts, param_dtype="bfloat16")
        out[pipeline] = r
    return out


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("graph_trainer_zoo_inductor"))


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_zoo_through_the_torch_ce_pipeline(case, kernel_cache):
    seed = seed_base()
    print(f"{case.id}: seed {seed}")
    res = run_ranks(_rank, case.world, vars(case), seed, kernel_cache, timeout=case.timeout + 600)
    bad = M.shape_checks(case, res[0]["torch_ce"]["placements"])
    for rank, r in enumerate(res):
        ref, ce = r["default"], r["torch_ce"]
        for i, (a, b) in enumerate(zip(ref["losses"], ce["losses"], strict=True)):
            if not torch.equal(a, b):
                bad.append(f"rank {rank} step {i}: loss {float(b)!r} != default pipeline's {float(a)!r}")
        if ce["share"] < M.MIN_SHARE:
            bad.append(f"rank {rank}: {100 * ce['share']:.1f}% on the copy engines: {ce['by_reason']}")
        if ce["left"]:
            bad.append(f"rank {rank}: weight gathers left in the final graph: {ce['left']}")
    if bad:
        print(res[0]["torch_ce"]["table"])
    assert not bad, "\n".join(bad)
