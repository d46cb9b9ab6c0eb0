"""torch_ce: FSDP weight all-gathers on the GPU copy engines, in compiled graphs
(inference forwards and training steps).

Public API:
  enable(**config) / disable()   install / remove the graph passes (plain torch.compile)
  bind(params, group=None)       move Shard(0) weight shards into symmetric windows
  all_gather(shard, group)       gather one bound shard (op + wait), eager convenience
  config                         the settings (see torch_ce/config.py; TORCH_CE_* env vars)
  explain()                      what the passes and binds did
  drop_prefetched()              forget gathers prefetched for the next call
  reset_counts()                 start a new window of explain()'s run-time counts (a step)
  updating_weights(model)        the context every rank updates bound weights in (NOTE
                                 [updating bound weights] in runtime/updates.py);
                                 StaleWeightError / UpdateError: the net's and its errors
  fsdp2.enable(model) / disable  FSDP2 (fully_shard) models' all-gathers (torch_ce/fsdp2/)
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # noqa: F401  (defines torch.ops.magi.*)
from .config import config
from .runtime.binding import BindResult, bind
from .runtime.prefetch import drop as drop_prefetched
from .runtime.updates import UpdateError, updating_weights
from .runtime.versions import StaleWeightError
from .runtime.window_pools import release_all


def all_gather(shard, group=None):
    """``wait_tensor(magi.ce_all_gather(shard, ...))`` for a bound shard of ``group``."""
    import torch
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    out = torch.ops.magi.ce_all_gather(shard, dist.get_world_size(group), group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def reduce_scatter(input, group=None, op: str = "sum", name: str = ""):
    """``wait_tensor(magi.ce_reduce_scatter(input, op, ...))``: this rank's chunk of
    ``input`` (dim 0 cut in group-size chunks) summed (``op="avg"``: averaged) over
    ``group``, with no collective (NOTE [copy-engine reduce-scatter]). ``name`` is the
    call's bucket identity: every rank must give the same call the same name, and calls of
    different names never pair up (a mismatch is an error on every rank); unnamed calls
    are told apart by their sizes and sequence only."""
    import torch
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    out = torch.ops.magi.ce_reduce_scatter(input, op, dist.get_world_size(group), group.group_name, name)
    return torch.ops._c10d_functional.wait_tensor(out)


def enable(**overrides):
    from .integrations.import_hook import register_when_imported
    from .passes.install import enable as _enable

    cfg = _enable(**overrides)
    # graph_trainer runs its own pass pipelines: register torch_ce's, and observe the
    # default one (torch_ce/integrations/torchtitan.py), whether graph_trainer is imported
    # already or later (integrations/import_hook.py).
    register_when_imported()
    # SimpleFSDP's eager gathers (NOTE [eager gathers] in runtime/eager.py); also tried at
    # each compile, for a SimpleFSDP imported after enable().
    from .integrations import simple_fsdp
    from .runtime import eager

    simple_fsdp.install()
    eager.active = True
    return cfg


def disable():
    from .integrations import simple_fsdp
    from .passes.install import disable as _disable
    from .runtime import eager

    eager.active = False
    simple_fsdp.uninstall()
    return _disable()


def reset_counts():
    """Forget the run-time counts ``explain().coverage()`` reads (calls of compiled graphs,
    gathers outside them), so the next read covers what ran since: one step, say."""
    from .report import reset_counts as _reset

    _reset()


def explain(print_table: bool = False):
    """What torch_ce did in this process (``torch_ce.explanation.Explanation``): per graph
    and weight, bound (window, offset) or refused (why); binds; windows."""
    from .explanation import explain as _explain

    return _explain(print_table=print_table)


def __getattr__(name):
    """``torch_ce.fsdp2``, imported at its first use."""
    if name == "fsdp2":
        import importlib

        return importlib.import_module(".fsdp2", __name__)
    raise AttributeError(f"module 'torch_ce' has no attribute {name!r}")


__all__ = ["BindResult", "StaleWeightError", "UpdateError", "all_gather", "bind", "config", "disable",
           "drop_prefetched", "enable", "explain", "reduce_scatter", "release_all", "reset_counts",
           "updating_weights"]
