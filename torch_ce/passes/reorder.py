"""Reorder: latest-safe-launch of weight gathers over Inductor's scheduler nodes.

Installed as the only entry of ``reorder_for_compute_comm_overlap_passes`` by ``enable()``
with ``reorder`` on (either transport). One back-to-front sweep over the launches: each one is placed at
the latest position whose upstream compute, up to its wait, covers
``cost * comm_overlap_window_scale + comm_overlap_margin_us``; if there is not enough
compute, as early as legal (after its producers). Waits are first sunk to just before their
first consumer. The rebuilt order is checked to be topological over real (non-weak)
dependencies; if it is not, the original order is kept and a warning logged.

# NOTE [launch order]
Every launch, NCCL or CE, keeps its relative program order. NCCL collectives must be issued
in the same order on every rank; CE gathers need not be, but a CE gather whose binding was
refused at run time falls back to the collective inside the op, so keeping all launches in
order keeps the collective sequence identical on every rank even though CE costs (and so
CE positions) come from this rank's calibration.

# NOTE [CE ops are transfers]
The CE ops lower to FallbackKernels, which Inductor counts as compute (``is_collective``
only knows ``_CollectiveKernel``). ``_issues_transfer`` says what is a transfer here.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import torch

from ..inductor_lowering import _issues_transfer
from . import cost as cost_mod
from .identity import identity

log = logging.getLogger("torch_ce")


def _kernel(snode):
    return getattr(snode, "node", None)


def _is_wait(snode) -> bool:
    from torch._inductor import ir

    return isinstance(_kernel(snode), ir._WaitKernel)


def _is_bind_step(unit) -> bool:
    from . import fx_utils as U

    return any(getattr(_kernel(s), "op_overload", None) is U.magi.ce_bind.default for s in unit.snodes)


def _on_gloo(snode) -> bool:
    """A collective launch on a CPU tensor of a group whose backend is gloo."""
    import torch.distributed as dist
    from torch._inductor import ir

    node = _kernel(snode)
    if not isinstance(node, ir._CollectiveKernel) or isinstance(node, ir._WaitKernel):
        return False
    device = node.get_device()
    if device is None or device.type != "cpu":
        return False
    # c10d_functional ops take the group name last (after a reduce op's name, if any).
    names = [a for a in node.constant_args if isinstance(a, str)]
    if not names:
        return False
    try:
        group = torch._C._distributed_c10d._resolve_process_group(names[-1])
    except RuntimeError:
        return False
    return "gloo" in str(dist.get_backend(group))


def _is_multi_output(snode) -> bool:
    from torch._inductor import ir

    return isinstance(_kernel(snode), ir.MultiOutput)


def _real_deps(snode) -> set[str]:
    from torch._inductor.dependencies import WeakDep

    return {d.name for d in snode.unmet_dependencies if not isinstance(d, WeakDep)}


@dataclasses.dataclass
class Unit:
    """Scheduler nodes that move together: a launch and its MultiOutput members."""

    snodes: list
    kind: str  # "launch" | "wait" | "compute"
    index: int = 0

    # Cached: the sweep asks every unit for these once per launch. Units are complete
    # (MultiOutput members appended) before anyone asks.
    @functools.cached_property
    def outputs(self) -> set[str]:
        return {n for s in self.snodes for n in s.get_buffer_names()}

    @functools.cached_property
    def deps(self) -> set[str]:
        own = self.outputs
        return {d for s in self.snodes for d in _real_deps(s)} - own


def _units(snodes) -> list[Unit]:
    units: list[Unit] = []
    for s in snodes:
        if _is_multi_output(s) and units and units[-1].kind == "launch" and (
            _real_deps(s) <= {n for x in units[-1].snodes for n in x.get_buffer_names()}
        ):
            units[-1].snodes.append(s)
            continue
        kind = "launch" if _issues_transfer(s) else "wait" if _is_wait(s) else "compute"
        units.append(Unit([s], kind))
    return units


def _topological(units: list[Unit]) -> bool:
    produced_by = {}
    for i, u in enumerate(units):
        for name in u.outputs:
            produced_by[name] = i
    seen: set[str] = set()
    for u in units:
        for d in u.deps:
            if d in produced_by and d not in seen:
                return False
        seen |= u.outputs
    return True


def _sink_waits(base: list[Unit]) -> list[Unit]:
    """Move each wait to just before its first consumer."""
    waits = [u for u in base if u.kind == "wait"]
    rest = [u for u in base if u.kind != "wait"]
    for w in waits:
        outs = w.outputs
        pos = next((i for i, u in enumerate(rest) if u.deps & outs), len(rest))
        rest.insert(pos, w)
    # Keep a wait after whatever it itself depends on (its launch is placed later).
    return rest


# NOTE [the bind step leads]
# The bind step's first run exchanges with every peer (agreement over the store; on CUDA a
# symmetric-memory rendezvous), so it must come before every launch of the graph, on every
# rank: a rank inside a collective while its peer waits in the bind is a hang. The rewrite
# puts it right after the placeholders, but Inductor's scheduler may move a launch with no
# producer (a gather of a graph input) above it: torch 2.15's does. Moving the bind step up
# is always legal (it reads only graph inputs), so the reorder places it first whatever
# order Inductor chose, also where it otherwise keeps Inductor's order (gloo).


def _bind_step_first(units: list[Unit]) -> list[Unit]:
    """``units`` with the bind step moved to just before the first launch (NOTE [the bind
    step leads]); unchanged when it is there already or the move would not be legal."""
    bind = next((i for i, u in enumerate(units) if _is_bind_step(u)), None)
    first = next((i for i, u in enumerate(units) if u.kind == "launch"), None)
    if bind is None or first is None or bind < first:
        return units
    order = units[:first] + [units[bind]] + units[first:bind] + units[bind + 1:]
    if not _topological(order):
        log.warning("torch_ce reorder: the bind step reads a value computed after a launch; order kept")
        return units
    return order


@dataclasses.dataclass
class Placement:
    name: str
    cur: int  # original position among the units
    target: int  # slot in the non-launch order (insert before that unit)
    need_us: float
    covered_us: float
    compute_limited: bool
    deadline: int = 0  # slot of its first consumer: the transfer must be done by then


def latest_safe_launch(
    snodes: list,
    cost_us: Callable | None = None,
    scale: float | None = None,
    margin_us: float | None = None,
) -> list:
    from ..config import config

    cost_us = cost_us or _default_cost
    scale = config.comm_overlap_window_scale if scale is None else scale
    margin_us = config.comm_overlap_margin_us if margin_us is None else margin_us

    units = _units(snodes)
    for i, u in enumerate(units):
        u.index = i
    launches = [u for u in units if u.kind == "launch"]
    if not launches:
        return snodes
    if any(_on_gloo(s) for u in launches for s in u.snodes):
        # NOTE [gloo: one functional collective in flight] (ops.py): a second collective
        # in flight on gloo can corrupt the heap, so such a graph keeps Inductor's order,
        # but for the bind step (NOTE [the bind step leads]).
        log.info("torch_ce reorder: collectives on gloo: Inductor's order kept (%d launches)", len(launches))
        _record([], valid=True, kept="collectives on gloo: Inductor's order kept")
        return [s for u in _bind_step_first(units) for s in u.snodes]
    base = _sink_waits([u for u in units if u.kind != "launch"])
    producer_pos = {}
    for i, u in enumerate(base):
        for name in u.outputs:
            producer_pos[name] = i

    # Earliest legal slot per launch, non-decreasing in program order (NOTE [launch order]):
    # a launch may not pass an earlier launch that still waits for its producers, nor the
    # bind step (its first run issues collectives of its own).
    floor = max((i + 1 for i, u in enumerate(base) if _is_bind_step(u)), default=0)
    earliest_of: dict[int, int] = {}
    for L in launches:
        floor = max([floor] + [producer_pos[d] + 1 for d in L.deps if d in producer_pos])
        earliest_of[id(L)] = floor

    slots: dict[int, list[Unit]] = {}
    placements: list[Placement] = []
    upper = len(base)  # a launch may not pass the next launch (NOTE [launch order])
    for L in reversed(launches):
        outs = L.outputs
        consumers = [i for i, u in enumerate(base) if u.deps & outs]
        wait_pos = min(consumers) if consumers else len(base)
        earliest = earliest_of[id(L)]
        need = cost_us(L.snodes[0]) * scale + margin_us
        # Walk up from the wait, counting compute, until it covers the need and the launch
        # sits no later than the next launch.
        covered, k = 0.0, wait_pos
        while k > earliest and (covered < need or k > upper):
            k -= 1
            if base[k].kind == "compute":
                covered += sum(cost_us(s) for s in base[k].snodes)
        limited = covered < need
        k = max(k, earliest)
        slots.setdefault(k, []).insert(0, L)
        upper = k
        placements.append(Placement(L.snodes[0].get_name(), L.index, k, need, covered, limited, wait_pos))
        log.debug("torch_ce reorder: %s cur=%d target=%d deadline=%d need=%.1fus covered=%.1fus",
                  placements[-1].name, L.index, k, wait_pos, need, covered)
    # A launch that depends on another launch's output must follow it (same slot is fine:
    # back-to-front insertion keeps program order within a slot).
    order: list[Unit] = []
    for i in range(len(base) + 1):
        order.extend(slots.get(i, []))
        if i < len(base):
            order.append(base[i])
    if not _topological(order):
        log.warning("torch_ce reorder: rebuilt order is not topological; graph left unchanged")
        _record(placements, valid=False)
        return snodes
    _record(placements, valid=True)
    moved = sum(1 for p in placements if _moved(p, order))
    log.info("torch_ce reorder: %d launch(es), %d moved, %d compute-limited",
             len(placements), moved, sum(p.compute_limited for p in placements))
    return [s for u in order for s in u.snodes]


def _moved(p: Placement, order: list[Unit]) -> bool:
    for pos, u in enumerate(order):
        if u.snodes[0].get_name() == p.name:
            return pos != p.cur
    return False


def _record(placements: list[Placement], valid: bool, kept: str = "") -> None:
    from .. import report

    from ..config import config

    rec = report.graphs[-1] if report.graphs else report.new_graph(config.transport)
    rec.reorder = dict(
        valid=valid,
        launches=len(placements),
        compute_limited=sum(p.compute_limited for p in placements),
        placements=[dataclasses.asdict(p) for p in reversed(placements)],
        kept=kept,
    )


def _default_cost(snode) -> float:
    if _issues_transfer(snode):
        return cost_mod.launch_us(snode)
    if _is_wait(snode):
        return 0.0
    return cost_mod.compute_us(snode)


class LatestSafeLaunch:
    """The reorder entry. Inductor's FX graph cache key pickles the config, this entry
    included: it pickles with torch_ce's cache identity (identity.py), so the key changes
    whenever our code or config could place launches differently."""

    def __call__(self, snodes: list) -> list:
        return latest_safe_launch(snodes)

    def __reduce__(self):
        from ..config import config

        return (_make_pass, (identity(config),))


def _make_pass(digest: str) -> LatestSafeLaunch:
    """Unpickle a LatestSafeLaunch. ``digest`` is not used: it is an argument only so that
    it is part of the pickled bytes, i.e. of Inductor's cache key."""
    return LatestSafeLaunch()


def install(ic) -> None:
    """Make ours the only reorder pass (restored by install.disable)."""
    ic.reorder_for_compute_comm_overlap = True
    ic.reorder_for_compute_comm_overlap_passes = [LatestSafeLaunch()]
    ic.estimate_op_runtime = cost_mod.estimate_op_runtime
