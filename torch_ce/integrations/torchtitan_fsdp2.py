"""torch_ce in torchtitan's main trainer (FSDP2 ``fully_shard``): ``--module``.

torchtitan's main trainer (``torchtitan.train``) shards each model with FSDP2 in its
``parallelize_fn`` (``apply_fsdp_to_decoder``: ``fully_shard`` per block, then the root),
on a meta-device model that it materializes and initializes afterwards
(``to_empty`` + ``init_weights``), and loads a checkpoint before the first step. So this
module changes one thing: the model spec's ``parallelize_fn`` is torchtitan's own,
followed by a forward pre-hook on the model that, at the first forward (weights real,
initialized or loaded), calls ``torch_ce.fsdp2.enable(model, reduce_scatter=...)`` once
and removes itself. The hook runs before FSDP2's own root pre-forward (``prepend``), so
the first step's gathers are already served.

From torchtitan's command line::

    torchrun --nproc_per_node 2 -m torchtitan.train \\
        --module torch_ce.integrations.torchtitan_fsdp2 --config llama3_debugmodel

``--config`` takes any of torchtitan's own model configs (``llama3_debugmodel``,
``qwen3_debugmodel``, ...; looked up in ``torchtitan.models.<family>.config_registry``).
The gradient reduce-scatter stays FSDP2's collective unless ``TORCH_CE_REDUCE_SCATTER=
copy_engine`` (torch_ce's ``config.reduce_scatter``). Where FSDP2 is not used (no
``fully_shard``: data parallel degree 1, pipeline parallelism's stages are sharded the same
way and served), ``enable`` says what it served and why not, in its log line and in
``torch_ce.explain()``: never silently nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Callable

log = logging.getLogger("torch_ce")


def enable_at_first_forward(model) -> object:
    """Register the one-shot pre-forward hook (module docstring) on ``model``; returns
    its handle."""
    handle = []

    def hook(module, args, kwargs):
        handle[0].remove()
        from ..config import config
        from .. import fsdp2

        fsdp2.enable(module, reduce_scatter=config.reduce_scatter)
        return None

    handle.append(model.register_forward_pre_hook(hook, prepend=True, with_kwargs=True))
    return handle[0]


def with_torch_ce(parallelize_fn: Callable) -> Callable:
    """``parallelize_fn`` followed by ``enable_at_first_forward`` on what it returns."""

    @functools.wraps(parallelize_fn)
    def parallelize(model, *args, **kwargs):
        model = parallelize_fn(model, *args, **kwargs)
        enable_at_first_forward(model)
        return model

    parallelize._torch_ce_fsdp2 = True
    return parallelize


def _with_torch_ce_config(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def config_fn(*args, **kwargs):
        cfg = fn(*args, **kwargs)
        spec = cfg.model_spec
        if not getattr(spec.parallelize_fn, "_torch_ce_fsdp2", False):
            cfg.model_spec = dataclasses.replace(spec, parallelize_fn=with_torch_ce(spec.parallelize_fn))
        return cfg

    return config_fn


def _families() -> list[str]:
    from torchtitan.models import _supported_models

    return sorted(_supported_models)


def __getattr__(name: str):
    """torchtitan's model config ``name`` (``llama3_debugmodel``, ...) with torch_ce's
    gathers enabled at the first forward (module docstring)."""
    if name.startswith("__"):
        raise AttributeError(name)
    fams = _families()
    for fam in [f for f in fams if name.startswith(f"{f}_")] or fams:
        try:
            mod = importlib.import_module(f"torchtitan.models.{fam}.config_registry")
        except ImportError:
            continue
        fn = getattr(mod, name, None)
        if callable(fn):
            return _with_torch_ce_config(fn)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}: no torchtitan model family "
                         f"({', '.join(fams)}) has a config of that name")
