"""Every graph_trainer set-up in which torch_ce serves nothing says so, and none of them
prints the line the README tells users to look for (``torch_ce: graph_trainer trains
through the 'torch_ce' pass pipeline``): 2 CPU gloo ranks, graph_trainer's Llama3 debug
config at CPU size (test/graph_trainer_harness.py), one spawn:

- ``torch_ce.enable(transport="copy_engine")`` before graph_trainer is imported, then
  graph_trainer's default pipeline (integrations/import_hook.py): the observer is in place,
  every gathered byte is collective with the reason naming ``--compile.pass_pipeline
  torch_ce``, and the warning names what torch_ce changes in that pipeline;
- ``--compile.pass_pipeline torch_ce`` where graph_trainer runs no pass pipeline: with
  ``--compile.enable_passes false``, with ``--compile.mode jit`` and with pipeline
  parallelism (post-init only: torchtitan's PP step needs its schedule): a warning at
  trainer construction naming the setting and the route that works there;
- the torch_ce pipeline on a graph where it serves no byte (every shard below
  ``symm_min_shard_mib``): a warning with the top reasons, and the same loss as the default
  pipeline's.

test/test_graph_trainer.py checks the positive side: every torch_ce run prints the line.
"""
from __future__ import annotations

import sys
import time

import pytest
import torch

pytest.importorskip("torchtitan")
import graph_trainer_harness as H  # noqa: E402

if H.importable():  # a torch feature torchtitan's graph_trainer imports is absent (named)
    pytest.skip(H.importable(), allow_module_level=True)

from mp_harness import run_ranks, seed_base  # noqa: E402

WORLD = 2
OPTION = "--compile.pass_pipeline torch_ce"
NOT_RUN = "graph_trainer will not run the 'torch_ce' pass pipeline"


def _pp_post_init(cfg, world):
    """graph_trainer's post-init hook for ``cfg`` on a 2-stage pipeline-parallel mesh, as
    ``GraphTrainer.__init__`` runs it."""
    import zoo_models as zm
    from torchtitan.distributed import ParallelDims
    from torchtitan.experiments.graph_trainer.registry import POST_INIT_HOOKS
    from torchtitan.experiments.graph_trainer.trainer import GraphTrainer

    zm._stub_training_imports()
    pdims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=world, ep=1, world_size=world,
                         spmd_backend="partial_dtensor")
    pdims.build_mesh()
    cfg.parallelism.pipeline_parallel_degree = world
    tr = object.__new__(GraphTrainer)
    tr.config, tr.parallel_dims = cfg, pdims
    with H.LogLines() as lines:
        POST_INIT_HOOKS.get(cfg.compile.pass_pipeline, lambda _: None)(tr)
    return dict(log=lines.lines, pp_enabled=pdims.pp_enabled)


def _ranks(rank, world, seed, cache):
    from mp_harness import setup_compile

    setup_compile(cache, rank, torch_defaults=True)  # its warning names what enable() changed
    import torch_ce

    out = {"imported_first": "torchtitan.experiments.graph_trainer.registry" in sys.modules}
    torch_ce.enable(transport="copy_engine")  # before graph_trainer is imported
    H.prepare(register=False)
    import zoo_models as zm

    pdims = zm.parallel_dims(world, "fully_shard")
    t0 = time.monotonic()
    out["enable_first"] = H.one_run("llama3", pdims, world, rank, seed, mode="regional", pipeline="default",
                                    layers=1, steps=1)
    torch_ce.disable()
    from torch_ce.integrations import torchtitan  # noqa: F401  (the trampolines were replaced)

    def no_passes(cfg, _):
        cfg.compile.enable_passes = False

    def jit(cfg, _):
        cfg.compile.mode = "jit"

    for name, setup in (("enable_passes false", no_passes), ("mode jit", jit)):
        out[name] = H.one_run("llama3", pdims, world, rank, seed, mode="regional", pipeline="torch_ce",
                              layers=1, steps=1, setup=setup)
    out["pipeline parallel"] = _pp_post_init(H.graph_trainer_config("llama3", mode="regional", pipeline="torch_ce",
                                                                    layers=1), world)
    with torch_ce.config.patch(symm_min_shard_mib=1024.0):
        out["nothing served"] = H.one_run("llama3", pdims, world, rank, seed, mode="regional",
                                          pipeline="torch_ce", layers=1, steps=1)
    from torchtitan.experiments.graph_trainer import registry

    out["registry"] = {k: f"{v.__module__}.{v.__qualname__}" for k, v in registry.PASS_PIPELINE_REGISTRY.items()}
    out["seconds"] = time.monotonic() - t0
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    seed = seed_base()
    print(f"seed {seed}")
    res = run_ranks(_ranks, WORLD, seed, str(tmp_path_factory.mktemp("graph_trainer_warnings")), timeout=900)
    print(f"{res[0]['seconds']:.0f} s of runs on rank 0")
    return res


def _warnings(run) -> list[str]:
    return [text for level, text in run["log"] if level == "WARNING"]


def _never_trains_through(run) -> None:
    said = [text for _, text in run["log"] if H.TRAINS_THROUGH in text]
    assert not said, said


def test_enable_before_the_graph_trainer_import(results):
    for rank, r in enumerate(results):
        assert not r["imported_first"], rank
        run = r["enable_first"]
        assert run["ce_bytes"] == 0 and run["collective_bytes"] > 0, run["table"]
        assert run["by_reason"] and all(OPTION in why for why in run["by_reason"]), run["by_reason"]
        said = " ".join(_warnings(run))
        assert "runs its default pass pipeline" in said and "reorder_for_locality=False" in said, said
        _never_trains_through(run)
        assert r["registry"]["default"] == "torch_ce.integrations.torchtitan.default_graph_passes", r["registry"]


@pytest.mark.parametrize("setup, setting, route", [
    ("enable_passes false", "--compile.enable_passes is false", "--compile.enable_passes true"),
    ("mode jit", "--compile.mode jit", 'torch_ce.enable(transport="copy_engine")'),
    ("pipeline parallel", "pipeline parallelism is on", "--compile.mode jit"),
])
def test_no_pipeline_run_is_said(results, setup, setting, route):
    for rank, r in enumerate(results):
        run = r[setup]
        said = [w for w in _warnings(run) if NOT_RUN in w]
        assert len(said) == 1 and setting in said[0] and route in said[0], (rank, run["log"])
        _never_trains_through(run)
        if setup != "pipeline parallel":
            assert len(run["losses"]) == 1 and torch.isfinite(run["losses"][0]), run["losses"]
            assert run["ce_bytes"] == 0, run["table"]
        else:
            assert run["pp_enabled"], run


def test_a_graph_served_nothing_is_said(results):
    for rank, r in enumerate(results):
        run = r["nothing served"]
        said = [w for w in _warnings(run) if "put none of this step graph's" in w]
        assert len(said) == 1 and "shard below symm_min_shard_mib" in said[0], (rank, run["log"])
        _never_trains_through(run)
        assert run["ce_bytes"] == 0 and run["collective_bytes"] > 0, run["table"]
        assert torch.equal(run["losses"][0], r["enable_first"]["losses"][0]), (run["losses"], r["enable_first"]["losses"])
