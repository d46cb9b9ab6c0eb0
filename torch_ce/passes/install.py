"""Installs torch_ce's passes into ``torch._inductor.config`` and removes them exactly.

``enable()`` applies the config, then makes Inductor's config match it: our post-grad pass
(``manager.TorchCEPass``, chained after whatever the user installed), the joint-graph
reshard when it is on, our reorder and cost estimate when ``reorder`` is on, and the
Inductor settings that would fight them turned off (``_OFF``). Each call first undoes the
previous one, and ``disable()`` restores every setting it changed, exactly.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..config import config, update
from .manager import TorchCEPass, _PassBase
from .reshard import ReshardPass

log = logging.getLogger("torch_ce")


class _Chained(_PassBase):
    """A pass the user had installed, then ours (2.11 takes one callable per hook)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, graph: fx.Graph, is_inference: bool | None = None) -> None:
        if _PassBase is not CustomGraphPass and isinstance(self.first, _PassBase):
            self.first(graph, is_inference=is_inference)
        else:
            self.first(graph)
        self.second(graph, is_inference)

    def uuid(self) -> Any:
        u = getattr(self.first, "uuid", None)
        first = u() if callable(u) else None
        if first is None:  # a bare function bypasses the caches, as it did before us
            return None
        return hashlib.sha256((str(first) + str(self.second.uuid())).encode()).hexdigest()


# Inductor settings that fight ours while our pass or our reorder is installed (NOTE in
# DESIGN.md: they only match all_gather_into_tensor, 2.11's overlap scheduler crashes on our
# buckets, and a second comm scheduler or Inductor's own CE gathers would undo our reorder's
# placement or its NCCL baseline): (setting, the value we set, the feature it switches, as
# "module" or "module:attribute" of torch). A torch without the feature needs no setting
# (said in a debug line); a torch with the feature but not the setting renamed it, and gets
# a warning (``off_list``; test/test_torch_features.py asserts it on every CI leg).
_OFF = [
    # Hoists every collective to the top of the graph, which would make all weight gathers
    # "program-adjacent" (one bucket) and leave our reorder nothing to place.
    ("reorder_for_locality", False, "torch._inductor.fx_passes.post_grad:reorder_for_locality"),
    ("bucket_all_gathers_fx", "none", "torch._inductor.fx_passes.bucketing:bucket_all_gather"),
    ("aten_distributed_optimizations.enable_overlap_scheduling", False,
     "torch._inductor.fx_passes.overlap_scheduling"),
    # Torch 2.14+ (on by default): moves every collective up and every wait down by
    # adjacent swaps after our reorder ran, undoing its placement, the bind step's lead
    # (NOTE [the bind step leads] in reorder.py) and gloo's one collective in flight.
    ("aten_distributed_optimizations.enable_simple_overlap", False, "torch._inductor.comms:simple_overlap"),
    ("aten_distributed_optimizations.enable_low_contention_collectives", False,
     "torch._inductor.fx_passes.low_contention_collectives"),
]


def has_feature(spec: str) -> bool:
    """Whether this torch has ``"module"`` or ``"module:attribute"``."""
    import importlib

    mod, _, attr = spec.partition(":")
    try:
        m = importlib.import_module(mod)
    except ImportError:
        return False
    return not attr or hasattr(m, attr)


def off_list(ic=None) -> list[tuple[str, Any, str, bool, bool]]:
    """``_OFF`` on this torch: (setting, value, feature, has the setting, has the feature)."""
    if ic is None:
        import torch._inductor.config as ic
    return [(k, v, f, _get(ic, k) is not _MISSING, has_feature(f)) for k, v, f in _OFF]


def _say_missing(ic) -> None:
    for k, _, feature, has_setting, has_feat in off_list(ic):
        if has_setting:
            continue
        if has_feat:
            log.warning("torch_ce: this torch has %s but no Inductor setting %s to turn it off: it may undo "
                        "torch_ce's placement of its gathers (a renamed setting: please report it)", feature, k)
        else:
            log.debug("torch_ce: this torch has no Inductor setting %s, nor what it switches (%s): nothing to "
                      "turn off", k, feature)


class _ChainedJoint(CustomGraphPass):
    """A joint-graph pass the user had installed, then ours."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, graph: fx.Graph) -> None:
        self.first(graph)
        self.second(graph)

    def uuid(self) -> Any:
        u = getattr(self.first, "uuid", None)
        first = u() if callable(u) else None
        if first is None:
            return None
        return hashlib.sha256((str(first) + str(self.second.uuid())).encode()).hexdigest()


_saved: dict[str, Any] | None = None
_pass = TorchCEPass()
_reshard = ReshardPass()


def _get(cfg, dotted: str):
    obj = cfg
    *head, last = dotted.split(".")
    for h in head:
        obj = getattr(obj, h, None)
        if obj is None:
            return _MISSING
    return getattr(obj, last, _MISSING)


def _set(cfg, dotted: str, value) -> None:
    obj = cfg
    *head, last = dotted.split(".")
    for h in head:
        obj = getattr(obj, h)
    setattr(obj, last, value)


_MISSING = object()


def _install(ic) -> dict[str, Any]:
    """Apply the current config to Inductor's; returns the old values of what it changed.

    Our post-grad pass, always: with "copy_engine" it rewrites gathers; with "nccl" it
    leaves every graph as it is and only carries our cache identity, whose per-rank part
    keeps a cache dir shared by the ranks safe (NOTE [a cache shared by ranks] in
    identity.py). reorder: our reorder pass and cost estimate (either transport: with
    "nccl" it reorders the NCCL gathers). With "copy_engine" or reorder, the ``_OFF``
    settings; ``enable(transport="nccl", reorder=False)`` changes nothing else.
    """
    ce, reorder = config.transport == "copy_engine", config.reorder
    keys = ["post_grad_custom_post_pass"]
    if config.reshards_after_forward:
        keys.append("joint_custom_pre_pass")
    if reorder:
        keys += ["reorder_for_compute_comm_overlap", "reorder_for_compute_comm_overlap_passes",
                 "estimate_op_runtime"]
    if ce or reorder:
        keys += [k for k, _, _ in _OFF]
        _say_missing(ic)
    saved = {k: _get(ic, k) for k in keys}
    prev = saved["post_grad_custom_post_pass"]
    if prev is None:
        ic.post_grad_custom_post_pass = _pass
    elif isinstance(prev, (list, tuple)):
        ic.post_grad_custom_post_pass = type(prev)([*prev, _pass])
    else:
        ic.post_grad_custom_post_pass = _Chained(prev, _pass)
    if config.reshards_after_forward:  # NOTE [reshard after forward] in reshard.py
        prev = saved["joint_custom_pre_pass"]
        ic.joint_custom_pre_pass = _reshard if prev in (None, _MISSING) else _ChainedJoint(prev, _reshard)
    if reorder:
        from .reorder import install as install_reorder

        install_reorder(ic)
    if ce or reorder:
        for k, v, _ in _OFF:
            if saved[k] is not _MISSING:
                _set(ic, k, v)
    return saved


def changed_settings() -> dict[str, Any]:
    """The Inductor settings enable() changed, with their values now (empty: not enabled);
    its passes and hooks are named by their settings."""
    import torch._inductor.config as ic

    plain = (bool, int, float, str, type(None))
    now = {k: _get(ic, k) for k, old in (_saved or {}).items() if old is not _MISSING and _get(ic, k) is not old}
    return {k: v if isinstance(v, plain) else type(v).__name__ for k, v in now.items()}


def refuse_out_of_process_compile() -> None:
    """Raise when Inductor compiles FX graphs in another process
    (``TORCHINDUCTOR_FX_COMPILE_MODE=subprocess``, or its async / progressive forms): torch_ce's
    passes, its decisions made before Inductor (``manager.decided_before_inductor``) and its
    lowerings live in this process, and would not reach that one: its weight gathers would stay
    on the collective, or be decided twice."""
    import torch._inductor.compile_fx as cf

    mode = getattr(cf, "fx_compile_mode", None)
    out_of_process = (getattr(mode, "name", "NORMAL") == "SUBPROCESS" or getattr(cf, "fx_compile_async", False)
                      or getattr(cf, "fx_compile_progressive", False))
    if out_of_process:
        import os

        raise RuntimeError(
            "torch_ce: Inductor compiles FX graphs in a subprocess here (TORCHINDUCTOR_FX_COMPILE_MODE="
            f"{os.environ.get('TORCHINDUCTOR_FX_COMPILE_MODE', getattr(mode, 'name', mode))!r}); torch_ce's "
            "graph passes and lowerings run in this process only, so no gather would reach the copy engines. "
            "Unset TORCHINDUCTOR_FX_COMPILE_MODE (or set it to 'normal') before torch is imported.")


def _restore(ic) -> None:
    global _saved
    for k, v in (_saved or {}).items():
        if v is not _MISSING:
            _set(ic, k, v)
    _saved = None


def enable(**overrides: Any):
    """Apply ``overrides`` to the config, then make Inductor's config match it: each call
    first undoes what the previous one installed (``enable(); enable(reorder=False)``
    leaves no reorder), so ``disable()`` restores what was there before the first call."""
    global _saved
    import torch._inductor.config as ic

    refuse_out_of_process_compile()
    if overrides:
        update(**overrides)
    from ..inductor_lowering import register_lowerings

    register_lowerings()
    _restore(ic)
    _saved = _install(ic)
    log.info("torch_ce: enabled (transport=%s, reorder=%s)", config.transport, config.reorder)
    return config


def disable() -> None:
    """Restore every Inductor setting enable() changed, exactly."""
    import torch._inductor.config as ic

    if _saved is None:
        return
    _restore(ic)
    log.info("torch_ce: disabled")


def is_enabled() -> bool:
    return _saved is not None
