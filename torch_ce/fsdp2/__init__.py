"""torch_ce for FSDP2 (``fully_shard``) models: their weight all-gathers on the copy
engines (on CPU: the host transport), through FSDP2's own hook, ``set_custom_all_gather``.

FSDP2 gathers eagerly, outside any compiled graph, so the Inductor passes never see its
gathers; ``enable(model)`` serves them instead, param group by param group::

    model = Transformer(...)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch_ce.fsdp2.enable(model)          # collective: every rank, after fully_shard
    with torch.no_grad():
        out = model(x)                    # each group: one read per peer, no signal
    print(torch_ce.explain().table())     # one row per param group: bytes, bound or why not
    torch_ce.fsdp2.disable(model)         # FSDP2's own all-gathers again

Each group's chunk (its FSDP2 all-gather input) is bound once into the pooled windows by
the bind rounds (fsdp2/chunks.py). Static weights (``weights="static"``, or "auto" with no
parameter requiring grad) are read with no per-call signal; they change only inside
``torch_ce.updating_weights(model)``, and the version net raises ``StaleWeightError`` on a
write outside it (fsdp2/updates.py). Training groups (parameters that require grad) stage
their chunk each call and order the reads with one-sided step words (NOTE [FSDP2
training: step words] in fsdp2/signals.py). What cannot be served keeps FSDP2's own
all-gather, with the reason in ``explain()`` and the log (fsdp2/groups.py).
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import weakref
from typing import Any

import torch

from ..config import config
from ..runtime import updates as _updates
from ..runtime import versions
from ..runtime import windows as W
from . import chunks, groups as G
from .report import GroupRow, coverage, lines, row

log = logging.getLogger("torch_ce")

REDUCE_SCATTERS = ("collective", "copy_engine")
WEIGHTS = ("auto", "static", "training")


@dataclasses.dataclass(eq=False)
class _Enabled:
    model: Any  # weakref to the model
    groups: list
    bounds: dict  # id(group) -> chunks.Bound
    comms: dict  # id(group) -> comm.CopyEngineAllGather
    hooks: list = dataclasses.field(default_factory=list)
    disabled: bool = False


_models: list[_Enabled] = []


def _entry(model) -> _Enabled | None:
    for e in _models:
        if e.model() is model:
            return e
    return None


def enable(model: torch.nn.Module, reduce_scatter: str = "collective", *, weights: str = "auto",
           timeout_s: float | None = None) -> list[GroupRow]:
    """Serve the all-gathers of every FSDP2 param group of ``model`` (module docstring).

    Collective: every rank calls it on its model after ``fully_shard`` (before or after the
    first forward), with the same arguments. ``reduce_scatter="copy_engine"`` also installs
    the copy-engine reduce-scatter where it can. ``weights``: "static" (inference: bound
    once, changed only inside ``torch_ce.updating_weights``), "training" (staged every
    call), or "auto" (training when a parameter of the group requires grad).
    ``timeout_s`` (default ``config.rs_timeout_s``): how long a training gather waits for
    a peer's step word. Returns one row per param group (also in ``explain()``).
    """
    from .comm import CopyEngineAllGather

    if reduce_scatter not in REDUCE_SCATTERS:
        raise ValueError(f"torch_ce.fsdp2.enable: reduce_scatter={reduce_scatter!r}: one of {REDUCE_SCATTERS}")
    if weights not in WEIGHTS:
        raise ValueError(f"torch_ce.fsdp2.enable: weights={weights!r}: one of {WEIGHTS}")
    old = _entry(model)
    if old is not None and not old.disabled:
        raise RuntimeError("torch_ce.fsdp2.enable: already enabled on this model (disable(model) first)")
    if old is not None:
        _models.remove(old)
    states = G.fsdp_states(model)
    if not states:
        raise ValueError("torch_ce.fsdp2.enable: no fully_shard'ed module in this model")
    G.lazy_init(model)
    for _, m, _ in states:
        m.reshard()  # the sharded parameters registered: what the bind and the net look at
    gs = G.find(model, weights)
    bounds = chunks.bind(gs)
    t = float(config.rs_timeout_s if timeout_s is None else timeout_s)
    comms = {}
    for g in gs:
        b = bounds.get(id(g))
        if b is None:
            log.info("torch_ce.fsdp2: %s keeps FSDP2's all-gather: %s", g.name, g.reason)
            continue
        comms[id(g)] = c = CopyEngineAllGather(g, b, t)
        g.comm, g.saved_comm = c, g.param_group._all_gather_comm
        g.module.set_custom_all_gather(c)
    if reduce_scatter == "copy_engine":
        _install_reduce_scatters(gs)
    e = _Enabled(weakref.ref(model), gs, bounds, comms)
    e.hooks = _check_hooks(model, gs, bounds)
    _models.append(e)
    return rows_of(e)


def _install_reduce_scatters(gs: list) -> None:
    """The copy-engine reduce-scatter on every group (fsdp2/reduce_scatter.py decides,
    and says why not through the sink)."""
    for g in gs:
        def sink(why: str, g=g) -> None:
            g.rs_reason = why

        try:
            from . import reduce_scatter as _rs
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.reduce_scatter":
                raise
            sink("copy-engine reduce-scatter not available")
            continue
        g.saved_rs_comm = g.param_group._reduce_scatter_comm
        if _rs.install(g.module, g.process_group, sink, name=g.name) and not g.rs_reason:
            g.rs_reason = "copy engine"


def _check_hooks(model, gs: list, bounds: dict) -> list:
    """The version net's check at the head of every forward of ``model``'s top-level FSDP
    modules, before FSDP2 runs anything (also when it gathers nothing: the root keeps its
    unsharded parameters after a no_grad forward): a write outside ``updating_weights``
    is a ``StaleWeightError`` at the next forward on the rank that wrote, and FSDP2's
    state is left as it was (NOTE [FSDP2 weights under the update protocol])."""
    slots = [bounds[id(g)].slot for g in gs if id(g) in bounds and g.mode == "static"]
    if not slots:
        return []

    def check(_module, _args) -> None:
        for s in slots:
            versions.check(s)

    return [m.register_forward_pre_hook(check, prepend=True) for m in G.top_level(model)]


def disable(model: torch.nn.Module) -> None:
    """FSDP2's own all-gathers (and reduce-scatters) again on every group of ``model``.
    The weights stay where they are (a window, for static groups bound in place), and
    FSDP2's collectives read them there."""
    e = _entry(model)
    if e is None or e.disabled:
        return
    for h in e.hooks:
        h.remove()
    for g in e.groups:
        if g.saved_comm is not None:
            g.param_group._all_gather_comm = g.saved_comm
        if g.saved_rs_comm is not None:
            uninstall = getattr(sys.modules.get(f"{__name__}.reduce_scatter"), "uninstall", None)
            if uninstall is not None:
                uninstall(g.module)  # its own bookkeeping, then FSDP2's default
            g.param_group._reduce_scatter_comm = g.saved_rs_comm
        g.saved_comm = g.saved_rs_comm = None
    e.disabled = True


def rows_of(e: _Enabled) -> list[GroupRow]:
    return [row(g, e.bounds.get(id(g)), e.comms.get(id(g)), e.disabled) for g in e.groups]


def rows() -> list[GroupRow]:
    """One row per FSDP2 param group of every live enabled model (explain())."""
    out = []
    for e in list(_models):
        if e.model() is not None:
            out += rows_of(e)
    return out


def _on_update_exit(wanted) -> None:
    """``updating_weights``' exit, after every rank finished writing (fsdp2/updates)."""
    from .updates import refresh_after_update

    for e in list(_models):
        m = e.model()
        if m is not None and not e.disabled:
            refresh_after_update(e.groups, e.bounds, wanted)


def _on_release() -> None:
    """``torch_ce.release_all()``: the bindings are gone; each comm refuses from now on."""
    for e in _models:
        for c in e.comms.values():
            c.poison = ("torch_ce.fsdp2: torch_ce.release_all() dropped the windows this group "
                        "read: call fsdp2.disable(model) and enable(model) again on every rank")


_updates.on_exit(_on_update_exit)
W.on_release(_on_release)

__all__ = ["GroupRow", "coverage", "disable", "enable", "lines", "rows"]
