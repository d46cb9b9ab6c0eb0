"""Binding: move live weight shards into symmetric windows, once, agreed by every rank.

A bind of one group (``_bind_unit``) runs these steps, every rank in lock step through the
exchanges of one ``agreement.Round`` (NOTE [bind rounds go through the store]):

  1. agree    every rank's descriptors; refused or disputed candidates become
              ``Fallback`` (NOTE [agreement before anything moves] in agreement.py)
  2. layout   ``windows.place`` per pool; the ranks compare pool states and layouts
  3. open     new windows (transport-specific; collective over the group), and read
              each back from every rank (NOTE [peer read-back at bind] in readback.py)
  4. move     each shard is copied into its slot and re-pointed there in place
              (``t.data = slot``: the parameter views the window, its old storage is
              freed, so no weight exists twice)
  5. publish  one exchange: after it every slot is readable by every peer

# NOTE [bind is exception-safe]
Nothing is registered, and no pool grows, before step 5 succeeds everywhere. A failure on
any rank (an exception, a timeout) posts an abort that every peer sees at its next
exchange; each rank then rolls back what it did (moved shards go back to ordinary storage
with their values, new windows are dropped) and raises ``BindError`` naming the failing
rank. A rank that dies or hangs is caught by the exchange deadlines (``bind_timeout_s``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..config import config
from . import native, versions
from . import window_pools as WP
from . import windows as W
from .agreement import BindError, Descriptor, Round, agree, descriptor, refuse_split_staging
from .eligibility import Reason, Refusal, refusal, shard_refusal
from .inference_tensors import alias, has_version_counter, warn_unwatched
from .readback import read_back
from .transports import transport

log = logging.getLogger("torch_ce")


@dataclasses.dataclass
class Candidate:
    name: str
    tensor: torch.Tensor | None  # the local shard (what moves)
    group: Any  # ProcessGroup or None
    reason: Refusal | None = None  # why it cannot bind (None: locally eligible)
    # Staged (training graphs, runtime/staging.py): the window holds a copy of the weight
    # cast to this dtype, refreshed each step; the weight itself stays where it is.
    stage_dtype: torch.dtype | None = None
    # An uneven Shard(0) weight: its slot holds this many rows (``ceil(rows / W)``, the
    # same on every rank), the shard its first ones (NOTE [uneven Shard(0): padded slots]
    # in windows.py). 0: the slot is the shard's own shape.
    rows: int = 0
    static: bool = False  # a cast slot of an inference graph (NOTE [cast slots] in staging.py)
    # Tensors wrapping ``tensor`` whose version counters a write moves (the DTensor
    # parameter): NOTE [the version net] in versions.py. Empty: found at bind.
    owners: list = dataclasses.field(default_factory=list)
    # The weights this candidate holds that no version counter watches (NOTE [inference
    # tensors at bind] in inference_tensors.py), by name: None: ``[name]`` when ``tensor``
    # itself has no counter (an in-place or cast slot), else none. A caller whose slot
    # holds other weights (an FSDP2 group's chunk) names them here.
    unwatched: list | None = None
    # Set when the shard moves: it had no version counter then (an inference tensor), and
    # keeps none in its slot (``inference_tensors.alias``).
    inference: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return self.stage_dtype or self.tensor.dtype

    @property
    def slot_shape(self) -> tuple:
        shape = tuple(self.tensor.shape)
        return (self.rows, *shape[1:]) if self.rows else shape

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.slot_shape:
            n *= d
        return n * self.dtype.itemsize


@dataclasses.dataclass
class BindResult:
    """What one bind call did: ``bound`` moved now, ``already_bound`` were in windows."""

    bound: list[str] = dataclasses.field(default_factory=list)
    already_bound: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    windows_opened: int = 0
    bytes_bound: int = 0
    # Bytes of the cast slots this bind made (inference graphs' param_dtype copies of fp32
    # shards, held beside the weights: NOTE [cast slots] in staging.py).
    cast_slot_bytes: int = 0
    # Weights this bind bound that no version counter watches (inference tensors), by name:
    # written only inside ``torch_ce.updating_weights`` (NOTE [inference tensors at bind]).
    no_version_counter: list[str] = dataclasses.field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"BindResult(bound={len(self.bound)}, already_bound={len(self.already_bound)}, "
            f"skipped={self.skipped}, windows_opened={self.windows_opened}, "
            f"bytes_bound={self.bytes_bound}, cast_slot_bytes={self.cast_slot_bytes})"
        )


# ---------------------------------------------------------------------------------------
# Local eligibility
# ---------------------------------------------------------------------------------------


def local_reason(t: torch.Tensor, group, min_shard_bytes: int | None = None,
                 stage_dtype: torch.dtype | None = None, rows: int = 0) -> Refusal | None:
    """Why this rank cannot bind ``t`` into a window of ``group`` (None: it can): the
    gate's predicate (eligibility.shard_refusal) on the live shard, plus the kernels.
    ``stage_dtype``: a staging slot of that dtype (training), not ``t`` itself. ``rows``:
    a padded slot of that many rows (uneven Shard(0)): the slot's facts are asked, the
    same on every rank, so an empty shard is no refusal."""
    if group is None:
        return refusal(Reason.NO_GROUP, "no process group (plain tensors need group=...)")
    if stage_dtype is None and W.is_staged(t):
        return refusal(Reason.TRAINED_WEIGHT,
                       "a training graph stages this weight (it changes every step): an "
                       "inference graph cannot read it in place")
    itemsize = (stage_dtype or t.dtype).itemsize
    numel = t.numel()
    if rows:
        if t.dim() < 1 or t.shape[0] > rows:
            return refusal(Reason.UNEVEN_SHARD, f"shard of {tuple(t.shape)} does not fit a padded slot of {rows} rows")
        numel = rows
        for d in t.shape[1:]:
            numel *= d
    return shard_refusal(
        device_type=t.device.type, nbytes=numel * itemsize, numel=numel,
        dim=t.dim(), contiguous=t.is_contiguous(), group_size=dist.get_world_size(group),
        cfg=config, min_shard_bytes=min_shard_bytes, kernel_refusal=native.kernel_refusal)


def candidate_from_param(name: str, p: torch.Tensor, group, min_shard_bytes: int) -> Candidate:
    """Resolve a DTensor or a plain tensor with ``group``.

    A DTensor qualifies as the compiled path sees it: mesh dims of size 1 issue no gather
    there (a (1, N) mesh with ``[Shard(0), Shard(0)]`` is one gather over the size-N dim),
    so they are ignored whatever their placement. Of the rest, exactly one must be
    Shard(0) and the others Replicate (FSDP, or HSDP's replicate x shard): the local tensor
    is gathered over that dim's group. Shard on two such dims is a gather of a gathered
    tensor, which the compiled path refuses too (test/test_mesh_verdicts.py compares both).
    """
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(p, DTensor):
        mesh, placements = p.device_mesh, tuple(p.placements)
        dims = [d for d in range(mesh.ndim) if mesh.size(d) > 1]  # size 1: no collective
        sharded = [d for d in dims if placements[d].is_shard()]
        if len(sharded) != 1:
            if sharded:
                what = f"Shard on {len(sharded)} mesh dims of size > 1 (a gather of a gathered tensor)"
            elif any(pl.is_shard() for pl in placements):
                what = "sharded only over mesh dims of size 1: nothing to gather"
            else:
                what = "not sharded"
            return Candidate(name, None, None, refusal(Reason.PLACEMENT, f"placement {placements} on mesh {tuple(mesh.shape)}: {what}"))
        dim = sharded[0]
        if placements[dim] != Shard(0):
            return Candidate(name, None, None, refusal(Reason.NOT_SHARD0, f"placement {placements[dim]}, not Shard(0)"))
        if not all(placements[d].is_replicate() for d in dims if d != dim):
            return Candidate(name, None, None, refusal(Reason.PLACEMENT, f"placement {placements}: not Replicate beside Shard(0)"))
        world = mesh.size(dim)
        if p.shape[0] % world:
            return Candidate(name, None, None, refusal(Reason.UNEVEN_SHARD, f"uneven Shard(0) ({p.shape[0]} rows over {world})"))
        pg = mesh.get_group(dim)
        from .. import report

        report.note_mesh_dim(pg.group_name, mesh, dim)  # explain(): which mesh dim
        local = p._local_tensor
        return Candidate(name, local, pg, local_reason(local, pg, min_shard_bytes), owners=[p])
    return Candidate(name, p, group, local_reason(p, group, min_shard_bytes))


# ---------------------------------------------------------------------------------------
# Binding
# ---------------------------------------------------------------------------------------


# NOTE [empty shards]
# A weight with fewer rows than ranks leaves some ranks an empty local shard. The bind step
# decides "bind now?" by asking whether every shard it lists is resolved (bound, or marked
# Fallback: ``resolved``, the one such check), and the address registry (windows.lookup)
# cannot hold an empty tensor: empty tensors share addresses (often 0), so one's entry
# would answer for another, or be lost with it. An empty shard that is never marked makes
# its rank re-enter the bind at the next call while its peers go straight to the gathers,
# and the ranks split (a BindError after the arrival timeout on one side, a closed gloo
# connection on the other). So every registry here finds an empty shard without its
# address: a bound one of an uneven Shard(0) by its slot view's first-element address
# (NOTE [uneven Shard(0): padded slots] in windows.py), a refused one in place by the
# tensor's identity (``windows.register_padded_fallback``: a weak reference, the entry
# dies with the tensor), a staging or cast slot's by identity as well (``windows._wkey``).
# A rank holding one takes exactly the bind path of its peers: one round at the first
# call, none after.


def resolved(t: torch.Tensor, stage_dtype: torch.dtype | None = None, rows: int = 0,
             static: bool = False) -> W.Slot | W.Fallback | None:
    """``t``'s entry (in place; its padded slot for ``rows``; its staging entry of
    ``stage_dtype``, or its cast slot when ``static``): a Slot, a Fallback, or None when it
    has not been through a bind round yet (NOTE [empty shards])."""
    if static:
        hit = W.cast_slot(t, stage_dtype)
        return hit[0] if hit is not None else None
    if stage_dtype is not None:
        hit = W.staged(t, stage_dtype)
        return hit[0] if hit is not None else None
    if rows or not t.numel():
        hit = W.padded(t)
        return hit[0] if isinstance(hit, tuple) else hit
    return W.lookup(t)


def _mark_fallback(c: Candidate, why: Refusal) -> None:
    if c.tensor is None or c.group is None:
        return
    fb = W.Fallback(str(why), c.group.group_name, weakref.ref(c.tensor), int(why.code))
    if c.static:
        W.register_cast_slot(c.tensor, c.stage_dtype, fb)
    elif c.stage_dtype is not None:
        W.register_staged(c.tensor, c.stage_dtype, fb)
    else:
        if c.rows or not c.tensor.numel():
            W.register_padded_fallback(c.tensor, fb)  # by identity: an empty shard has no address
        if c.tensor.numel():
            W.register(c.tensor, fb)


def bind_candidates(cands: list[Candidate], agree_group=None) -> BindResult:
    """Bind resolved candidates: collective over each candidate's group (or ``agree_group``).

    Groups agree one after another in one global order (sorted by their ranks), never in
    each rank's order of first appearance: with a total order no two ranks can wait on each
    other in different groups (a rank that listed [dense, expert] and a peer that listed
    [expert, dense] hung before). A rank set that is the whole world agrees over WORLD,
    whichever group object with those ranks each rank happened to name.
    """
    res = BindResult()
    if not dist.is_initialized():
        raise RuntimeError("torch_ce.bind: torch.distributed is not initialized")
    world_ranks = W.group_ranks_of(dist.group.WORLD)
    units: dict[tuple, tuple[Any, list[Candidate]]] = {}
    for c in cands:
        entry = None if c.tensor is None else resolved(c.tensor, c.stage_dtype, c.rows, c.static)
        if isinstance(entry, W.Slot):
            res.already_bound.append(c.name)
        elif isinstance(entry, W.Fallback):
            res.skipped[c.name] = entry.reason
        elif c.group is None and agree_group is None:
            res.skipped[c.name] = str(c.reason or "no process group")
        else:
            pg = agree_group if agree_group is not None else c.group
            ranks = W.group_ranks_of(pg)
            if ranks == world_ranks:
                pg = dist.group.WORLD
            units.setdefault(ranks, (pg, []))[1].append(c)
    cuda = [c.tensor.device for _, ms in units.values() for c in ms
            if c.tensor is not None and c.tensor.is_cuda]
    # Before anything moves: which weights no version counter watches (NOTE [inference
    # tensors at bind]).
    unwatched = {c.name: _unwatched(c) for _, ms in units.values() for c in ms}

    def bind_units():
        for ranks in sorted(units):
            pg, members = units[ranks]
            _bind_unit(members, pg, res)

    if cuda:
        _off_the_graph_pool(bind_units, cuda[0])
    else:
        bind_units()
    res.no_version_counter = [n for c in res.bound for n in unwatched.get(c, ())]
    warn_unwatched(res.no_version_counter)
    if res.bound or res.skipped:
        log.info("torch_ce.bind: %s", res)
    for name, why in res.skipped.items():
        log.debug("torch_ce.bind: %s stays on the collective backend: %s", name, why)
    return res


def _unwatched(c: Candidate) -> list[str]:
    """The weights of ``c`` no version counter watches once bound (NOTE [inference
    tensors at bind]); a training graph's staging slot needs none."""
    if c.unwatched is not None:
        return list(c.unwatched)
    if c.tensor is None or (c.stage_dtype is not None and not c.static):
        return []
    return [] if has_version_counter(c.tensor) else [c.name]


def _off_the_graph_pool(fn, device: torch.device):
    """Run ``fn`` (a bind) on a thread of its own, ordered after the caller's current
    stream, and return its result.

    # NOTE [bind off the graph pool]
    Under CUDA-graph trees (``mode="reduce-overhead"``) a compiled graph's first run routes
    the allocations of the running thread into the graph's private pool, and the bind step
    runs inside that first run. What a bind leaves allocated would sit in the pool
    untracked, and the trees refuse to record ("tensors in the cudagraph pool not tracked
    as outputs"). From its own thread the bind allocates from the ordinary caching
    allocator. Binding on a side stream of the same thread did not help (measured): the
    routing is by thread. The bind is bounded (NOTE [bind is exception-safe]), so the join
    is too.
    """
    caller = torch.cuda.current_stream(device)
    box: dict = {}

    def run():
        try:
            torch.cuda.set_device(device)
            own = torch.cuda.current_stream(device)  # this thread's default stream
            own.wait_stream(caller)  # the shards were produced on the caller's stream
            box["result"] = fn()
            caller.wait_stream(own)  # gathers read the moved shards after the bind
        except BaseException as e:  # noqa: BLE001 (re-raised on the caller's thread)
            box["error"] = e

    t = threading.Thread(target=run, name="torch_ce-bind")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


@dataclasses.dataclass
class _PoolPlan:
    key: tuple
    pool: WP.WindowPool
    members: list[Candidate]
    layout: W.Layout
    new: list = dataclasses.field(default_factory=list)  # Windows opened by this bind


def _bind_unit(todo: list[Candidate], agree_pg, res: BindResult) -> None:
    """Agree, place, open, move, publish over ``agree_pg`` (the module docstring)."""
    if dist.get_world_size(agree_pg) < 2:
        for c in todo:
            res.skipped[c.name] = str(c.reason or "group of size 1: nothing to gather")
        return
    if dist.get_backend(agree_pg) == "fake":
        # A fake process group has no peers whose windows could be read.
        for c in todo:
            why = refusal(Reason.FAKE_GROUP, "fake process group: no peers to read from")
            res.skipped[c.name] = str(why)
            _mark_fallback(c, why)
        return
    ranks = W.group_ranks_of(agree_pg)
    rnd = Round(ranks, dist.get_rank(), config.bind_timeout_s, config.bind_arrival_timeout_s)
    plans: list[_PoolPlan] = []
    moved: list[tuple[Candidate, torch.Tensor]] = []
    try:
        # 1. agree
        mine = [descriptor(c) for c in todo]
        everyone = rnd.exchange("agree", {"cands": [d.to_json() for d in mine],
                                          "token": config.shm_prefix + uuid.uuid4().hex[:8],
                                          "readback": bool(config.bind_readback)})
        theirs = {r: [Descriptor.from_json(d) for d in v["cands"]] for r, v in everyone.items()}
        verdicts = agree(todo, mine, theirs)
        refuse_split_staging(todo, theirs)
        job = everyone[min(everyone)]["token"]  # the lowest rank's names every segment
        # Every rank runs the read-back's exchanges, or none does (a rank-dependent config).
        readback = all(v.get("readback", True) for v in everyone.values())
        chosen = []
        for c, why in zip(todo, verdicts):
            if why is None:
                chosen.append(c)
            else:
                res.skipped[c.name] = str(why)
                _mark_fallback(c, why)
        if not chosen:
            return
        # 2. layout: one rule (windows.place), compared across ranks
        by_pool: dict[tuple, list[Candidate]] = {}
        for c in chosen:
            key = WP.pool_key(W.group_ranks_of(c.group), c.dtype, c.tensor.device)
            by_pool.setdefault(key, []).append(c)
        for key, members in by_pool.items():
            pool = WP.get_pool(key)
            sizes = [m.nbytes for m in members]
            plans.append(_PoolPlan(key, pool, members, W.place(pool.state(), sizes, config.window_cap_bytes)))
        WP.check_window_limit(sum(len(p.layout.new_windows) for p in plans))
        layout = json.loads(json.dumps([[p.key, p.pool.state(), p.layout.digest()] for p in plans]))
        others = rnd.exchange("layout", layout)
        differ = sorted(r for r, v in others.items() if v != layout)
        if differ:
            log.warning("torch_ce.bind: window layouts differ on ranks %s (pools bound "
                        "differently before?); these shards stay on the collective", differ)
            why = refusal(Reason.DISAGREEMENT, f"rank disagreement: window layout differs on ranks {differ}")
            for c in chosen:
                res.skipped[c.name] = str(why)
                _mark_fallback(c, why)
            return
        # 3. open
        for i, p in enumerate(plans):
            p.new = _open_windows(p, rnd, f"{i}", job)
        # 3b. read back: a pool whose new windows some rank cannot read stays on the
        # collective, on every rank (NOTE [peer read-back at bind] in readback.py)
        for i, why in sorted(read_back(plans, rnd, readback).items(), reverse=True):
            for c in plans[i].members:
                res.skipped[c.name] = str(why)
                _mark_fallback(c, why)
            del plans[i]
        if not plans:
            return
        # 4. move
        slots = _slots(plans)
        views = _move_into_slots(slots, moved)
        if any(s.window.device.type == "cuda" for _, s in slots):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the shards' old blocks go back: no weight held twice
        # 5. publish: after this exchange every slot is readable by every peer
        rnd.exchange("moved", True)
    except BaseException as e:
        if not isinstance(e, BindError):
            rnd.abort(f"{type(e).__name__}: {e}")
        _roll_back(moved)
        if isinstance(e, BindError):
            raise
        raise BindError(f"torch_ce: bind failed on rank {dist.get_rank()} (this rank): "
                        f"{type(e).__name__}: {e}") from e
    for p in plans:
        WP.add_windows(p.pool, p.new)
        res.windows_opened += len(p.new)
    watched = []
    for c, slot in slots:
        slot.window.used = max(slot.window.used, slot.offset + W.align_up(slot.nbytes))
        transport(slot.window.device).publish_slot(slot)
        view, full = views[id(c)]
        if c.static:
            W.register_cast_slot(c.tensor, c.stage_dtype, slot, view, full if c.rows else None)
            res.cast_slot_bytes += slot.nbytes
        elif c.stage_dtype is not None:
            W.register_staged(c.tensor, c.stage_dtype, slot, view, full if c.rows else None)
        elif c.rows:
            W.register_padded(full, slot, c.tensor)
        else:
            W.register(c.tensor, slot)
        if c.static or c.stage_dtype is None:  # a staging slot is refreshed every step
            watched.append((slot, c.tensor, c.name, c.owners))
        res.bound.append(c.name)
        res.bytes_bound += slot.nbytes
    versions.watch_slots(watched)
    if config.cost_mode == "calibrated":
        _calibrate(max((s for _, s in slots), key=lambda s: s.window.nbytes))


def _open_windows(p: _PoolPlan, rnd: Round, tag: str, job: str) -> list:
    """Open the windows ``p.layout`` asks for (collective over the group)."""
    if not p.layout.new_windows:
        return []
    device, group = p.members[0].tensor.device, p.members[0].group
    new = [W.Window(p.key, len(p.pool.windows) + k, nbytes, group, p.key[0], dist.get_rank(group),
                    device, torch.empty(0, dtype=torch.uint8))
           for k, nbytes in enumerate(p.layout.new_windows)]
    transport(device).open_windows(new, rnd, tag, job)
    return new


def _slots(plans: list[_PoolPlan]) -> list[tuple[Candidate, W.Slot]]:
    out = []
    for p in plans:
        windows = p.pool.windows + p.new
        for m, (wi, off) in zip(p.members, p.layout.places):
            out.append((m, W.Slot(windows[wi], off, m.nbytes, m.slot_shape, m.dtype, m.name)))
    return out


def _move_into_slots(slots: list[tuple[Candidate, W.Slot]], moved: list) -> dict[int, torch.Tensor]:
    """Copy each shard into its slot and re-point it there; ``moved`` records what moved
    (with the slot view) so a failure can put it back. A staged candidate is only copied
    (cast) into its slot: the weight stays where it is. Returns the views by id(candidate)."""
    views = {}
    with torch.no_grad():
        for c, slot in slots:
            full = transport(slot.window.device).slot_local_view(slot)
            view = full
            if c.rows:  # NOTE [uneven Shard(0): padded slots] in windows.py
                n = c.tensor.shape[0]
                view = full[:n]
                full[n:].zero_()
            view.copy_(c.tensor)
            views[id(c)] = (view, full)
            if c.stage_dtype is None:
                c.inference = not has_version_counter(c.tensor)
                c.tensor.data = alias(view, c.inference)  # NOTE [inference tensors at bind]
                moved.append((c, view))
    return views


def _roll_back(moved: list[tuple[Candidate, torch.Tensor]]) -> None:
    """Put moved shards back on ordinary storage, values kept (NOTE [bind is exception-safe])."""
    with torch.no_grad():
        for c, view in reversed(moved):
            try:
                with torch.inference_mode(c.inference):  # back as what it was
                    c.tensor.data = view.clone()
            except Exception as e:  # noqa: BLE001 (report, keep rolling back the others)
                log.error("torch_ce.bind: could not restore %s after a failed bind: %s", c.name, e)
        if any(v.is_cuda for _, v in moved):
            torch.cuda.synchronize()


def _calibrate(slot: W.Slot) -> None:
    """Time wait(launch()) on the fresh windows for the reorder's cost curve (local only)."""
    from . import calibration

    try:
        calibration.calibrate(slot)
        if slot.window.device.type == "cuda":
            calibration.measure_peaks(slot.window.device)
    except Exception as e:  # calibration is an optimisation: never fail a bind for it
        log.warning("torch_ce: cost calibration failed (%s); using the default curve", e)


def _named(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, torch.nn.Module):
        return list(params.named_parameters())
    if isinstance(params, dict):
        return list(params.items())
    if isinstance(params, torch.Tensor):
        return [("param0", params)]
    return [(f"param{i}", p) for i, p in enumerate(params)]


def bind(params: Any, group=None, *, min_shard_mib: float | None = None) -> BindResult:
    """Bind weight shards into symmetric windows so ``magi::ce_all_gather`` can read them.

    ``params``: a module, a dict of name -> tensor, or an iterable of tensors. DTensors must
    be Shard(0) on one mesh dim of size > 1 and Replicate on the others, with rows divisible
    by that dim's size (what the compiled path binds); plain tensors are local
    shards of ``group``. Collective: every rank of each shard's group (of ``group`` if
    given) must call it with corresponding parameters. Binding an already-bound shard is a
    no-op. Returns a BindResult: what moved, what was already bound, what was skipped and why.
    """
    min_bytes = int((config.symm_min_shard_mib if min_shard_mib is None else min_shard_mib) * 2**20)
    cands = [candidate_from_param(n, p, group, min_bytes) for n, p in _named(params)]
    return bind_candidates(cands, agree_group=group)
