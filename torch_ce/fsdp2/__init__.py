"""torch_ce for FSDP2 (``fully_shard``) models: their weight all-gathers on the copy
engines (on CPU: the host transport), through FSDP2's own hook (``set_custom_all_gather``'s
comm, set per param group).

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

Parameters FSDP2 is given new tensors for (``load_state_dict(assign=True)``, ``.to()``,
``to_empty()``) go back into their window inside ``updating_weights``, and are a
``StaleWeightError`` outside it (NOTE [FSDP2 parameters that move] in fsdp2/chunks.py).
Each model's chunks live in windows of its own, which ``disable(model)``, or the model's
death, gives back (NOTE [what an enabled model holds] below). ``explain()`` counts every
call (NOTE [FSDP2 bytes as run] in fsdp2/report.py).
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
from ..runtime import window_pools as WP
from . import chunks, groups as G
from .report import GroupRow, coverage, lines, row, totals

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
    owner: Any = None  # its windows' owner (NOTE [windows of one owner] in runtime/window_pools.py)
    snapshot: list = dataclasses.field(default_factory=list)  # a disabled model's rows
    finalizer: Any = None  # releases the windows when the entry dies with its model


class _Owner:
    """The token a model's windows are bound under (by identity; the label names them in
    ``explain()``)."""

    __slots__ = ("label", "__weakref__")

    def __init__(self, label: str):
        self.label = label

    def __str__(self) -> str:
        return self.label

    __repr__ = __str__


# NOTE [what an enabled model holds]
# An enabled model owns its entry, and torch_ce holds it only weakly, so a model dropped
# without disable() leaves nothing behind. The forward pre-hooks on its top-level FSDP
# modules hold the entry (and FSDP2's param groups hold the comms, which hold the groups
# and their bound slots); ``_models`` holds weak references, in enable order. When the
# model dies its entry dies, and the entry's finalizer releases its windows
# (``window_pools.release_owner``; NOTE [windows of one owner] says when the memory may go).
# ``disable()`` moves the weights out and releases the windows at once; the disabled
# entry then holds copies of the groups without any FSDP2 object, kept in ``_disabled``
# by the model, weakly, so ``explain()`` shows the disabled model while it lives.
_models: list = []  # weakref.ref(_Enabled), in enable order
_disabled: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its entry
_enables = [0]  # enable() calls in this process: the owners' labels


def _live() -> list[_Enabled]:
    """The entries of the models alive now (enabled or disabled), in enable order."""
    out, keep = [], []
    for r in _models:
        e = r()
        if e is not None and e.model() is not None:
            out.append(e)
            keep.append(r)
    _models[:] = keep
    return out


def _entry(model) -> _Enabled | None:
    for e in _live():
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
    ``timeout_s`` (default ``config.fsdp2_timeout_s``): how long a training gather waits for
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
        _disabled.pop(model, None)
    states = G.fsdp_states(model)
    if not states:
        raise ValueError("torch_ce.fsdp2.enable: no fully_shard'ed module in this model")
    G.lazy_init(model)
    for name, m, state in states:
        _settle(name, state)
        m.reshard()  # the sharded parameters registered: what the bind and the net look at
    gs = G.find(model, weights)
    _enables[0] += 1
    owner = _Owner(f"fsdp2 {type(model).__name__} #{_enables[0]}")
    cuda = [g for g in gs if not g.reason and g.fsdp_params[0]._sharded_param_data.is_cuda]
    if cuda:  # this rank's reads are done before the round (NOTE [windows of one owner])
        torch.cuda.synchronize()
        _flush_host_words()
    try:
        with WP.owned_pools(owner):
            bounds = chunks.bind(gs)
    except BaseException:
        WP.release_owner(owner)
        raise
    for ranks in {b.slot.window.group_ranks for b in bounds.values()}:
        WP.flush_deferred(ranks)  # every rank of ``ranks`` synchronized before this round
    t = float(config.fsdp2_timeout_s if timeout_s is None else timeout_s)
    comms = {}
    for g in gs:
        b = bounds.get(id(g))
        if b is None:
            log.info("torch_ce.fsdp2: %s keeps FSDP2's all-gather: %s", g.name, g.reason)
            continue
        comms[id(g)] = c = CopyEngineAllGather(g, b, t)
        g.comm, g.saved_comm = c, g.param_group._all_gather_comm
        # What set_custom_all_gather sets, per param group: it refuses a module with
        # several (per-parameter meshes), where each group's comm is its own here.
        g.param_group._all_gather_comm = c
    if reduce_scatter == "copy_engine":
        _install_reduce_scatters(gs)
    _count(gs)
    e = _Enabled(weakref.ref(model), gs, bounds, comms, owner=owner)
    e.hooks = _check_hooks(model, e)
    e.finalizer = weakref.finalize(e, WP.release_owner, owner)  # NOTE [what an enabled model holds]
    e.finalizer.atexit = False
    _models.append(weakref.ref(e))
    return rows_of(e)


def _flush_host_words() -> None:
    """The step words' host mappings no group holds any more, unregistered (this rank's
    device synchronized first: fsdp2/step_words.py)."""
    step_words = sys.modules.get(f"{__name__}.step_words")
    if step_words is not None:
        step_words.flush()


def _settle(name: str, state) -> None:
    """A forward or backward that raised (a peer's failure ended a gather's wait) leaves
    FSDP2's module state mid-pass: ``FORWARD`` with some groups unsharded, which
    ``reshard()`` then keeps (a root that does not reshard after forward), so this rank's
    next forward would skip gathers its peers run. Back to idle first, so that
    ``disable``/``enable`` is a full recovery on every rank."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    pgs = list(getattr(state, "_fsdp_param_groups", None) or [])  # per-parameter meshes: several
    if not pgs:
        try:
            pgs = [g for g in (state._fsdp_param_group,) if g is not None]
        except AssertionError:  # a torch that names several groups only in the plural
            pgs = []
    stuck = [s for s in (state, *pgs) if s._training_state != TrainingState.IDLE]
    if not stuck:
        return
    log.warning("torch_ce.fsdp2: %s was left mid-pass (%s, a pass that raised): set idle before "
                "binding", name, stuck[0]._training_state)
    for s in stuck:
        s._training_state = TrainingState.IDLE
    for pg in pgs:
        pg._all_gather_result = None


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
        if _rs.install_group(g.param_group, sink, name=g.name) and not g.rs_reason:
            g.rs_reason = "copy engine"


def _count(gs: list) -> None:
    """FSDP2's own comms of the groups, counted on their way through, and where the
    copy-engine reduce-scatter serves a group its accounting's start (NOTE [FSDP2 bytes as
    run] in fsdp2/report.py). ``disable()`` puts FSDP2's comms back."""
    from .report import CountingComm

    RS = sys.modules.get("torch_ce.runtime.reduce_scatter")
    for g in gs:
        pg = g.param_group
        if g.comm is None:  # FSDP2 (or the user's comm) keeps the all-gather
            g.saved_comm = pg._all_gather_comm
            pg._all_gather_comm = CountingComm(g.saved_comm, g.ag_counts, "all_gather")
        if g.rs_reason == "copy engine":
            s = RS.served.get(f"fsdp2 {g.name}") if RS is not None else None
            g.rs_base = (s.calls, s.ce_bytes, s.collective_bytes) if s is not None else (0, 0, 0)
            continue
        if g.saved_rs_comm is None:
            g.saved_rs_comm = pg._reduce_scatter_comm
        pg._reduce_scatter_comm = CountingComm(pg._reduce_scatter_comm, g.rs_counts, "reduce_scatter")


def _check_hooks(model, e: _Enabled) -> list:
    """The version net's check at the head of every forward of ``model``'s top-level FSDP
    modules, before FSDP2 runs anything (also when it gathers nothing: the root keeps its
    unsharded parameters after a no_grad forward): a write outside ``updating_weights``,
    or parameters FSDP2 was given new tensors for, is a ``StaleWeightError`` at the next
    forward on the rank that wrote, and FSDP2's state is left as it was (NOTE [FSDP2
    weights under the update protocol], NOTE [FSDP2 parameters that move]). The hooks
    hold the model's entry (NOTE [what an enabled model holds])."""
    static = [(g, e.bounds[id(g)]) for g in e.groups if id(g) in e.bounds and g.mode == "static"]

    def check(_module, _args) -> None:
        for g, b in static:
            if g.comm is not None and g.comm.poison:
                raise RuntimeError(g.comm.poison)
            versions.check(b.slot)
            if b.anchors:
                chunks.settle(g, b)

    check.entry = e  # the model owns its entry through its hooks
    return [m.register_forward_pre_hook(check, prepend=True) for m in G.top_level(model)]


def disable(model: torch.nn.Module) -> None:
    """FSDP2's own all-gathers (and reduce-scatters) again on every group of ``model``, and
    its windows given back: the weights of static groups bound in place move out of the
    window into memory of their own (values kept), then the model's windows, slots and
    comms are released (NOTE [windows of one owner] in runtime/window_pools.py). Local: each
    rank gives back its own; a peer that still gathers reads its mapping of this rank's
    last values (host), or the memory stays until the next ``enable`` over those ranks
    (CUDA)."""
    e = _entry(model)
    if e is None or e.disabled:
        return
    snapshot = [dataclasses.replace(r, status="disabled") if r.status == "bound" else r
                for r in rows_of(e)]
    for h in e.hooks:
        h.remove()
    for g in e.groups:
        if g.saved_comm is not None:
            g.param_group._all_gather_comm = g.saved_comm
        if g.saved_rs_comm is not None:
            g.param_group._reduce_scatter_comm = g.saved_rs_comm
        g.saved_comm = g.saved_rs_comm = None
        b = e.bounds.get(id(g))
        if b is not None:
            chunks.unbind(g, b)  # the weights leave the window
        g.comm = None
    e.disabled = True
    if any(b.host_words is not None for b in e.bounds.values()):
        torch.cuda.synchronize()  # no stream waits on the words any more
        _flush_host_words()
    if e.finalizer is not None:
        e.finalizer.detach()
    WP.release_owner(e.owner)
    # The entry that stays while the model lives holds no FSDP2 object (NOTE [what an
    # enabled model holds]).
    gone = _Enabled(e.model, [g.detached() for g in e.groups], {}, {}, disabled=True,
                    owner=e.owner, snapshot=snapshot)
    _disabled[model] = gone
    _models[:] = [weakref.ref(gone) if r() is e else r for r in _models]
    e.groups, e.bounds, e.comms = [], {}, {}


def rows_of(e: _Enabled) -> list[GroupRow]:
    if e.disabled:
        return list(e.snapshot)
    return [row(g, e.bounds.get(id(g)), e.comms.get(id(g)), e.disabled) for g in e.groups]


def rows() -> list[GroupRow]:
    """One row per FSDP2 param group of every model alive now that was enabled (a
    disabled one's rows say so), in enable order (explain())."""
    out = []
    for e in _live():
        out += rows_of(e)
    return out


def _on_update_exit(wanted) -> None:
    """``updating_weights``' exit, after every rank finished writing (fsdp2/updates)."""
    from .updates import refresh_after_update

    for e in _live():
        if not e.disabled:
            refresh_after_update(e.groups, e.bounds, wanted)


def _on_release() -> None:
    """``torch_ce.release_all()``: the bindings are gone; each comm refuses from now on."""
    step_words = sys.modules.get(f"{__name__}.step_words")
    if step_words is not None:
        step_words.release_all()
    for e in _live():
        for c in e.comms.values():
            c.poison = ("torch_ce.fsdp2: torch_ce.release_all() dropped the windows this group "
                        "read: call fsdp2.disable(model) and enable(model) again on every rank")


_updates.on_exit(_on_update_exit)
WP.on_release(_on_release)

__all__ = ["GroupRow", "coverage", "disable", "enable", "lines", "rows", "totals"]
