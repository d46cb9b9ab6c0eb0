"""Binding: move live weight shards into symmetric windows, once, agreed by every rank.

# NOTE [agreement before anything moves]
A gather retargeted on some ranks and not on others never completes (NCCL waits for a
peer that is doing one-sided reads). So before anything moves, every rank of the agreeing
group (each candidate's own group unless the caller names one) exchanges one descriptor
per candidate shard, the locally refused ones included:
(group ranks, shape, dtype, device type, local eligibility). Candidate i is bound only if
every member of its group reports an identical, eligible descriptor at position i and the
same number of candidates. Anything else is marked ``Fallback``: the CE ops gather such a
shard through the group's collective backend, identically on every rank.

After agreement: windows are opened per (group, dtype) pool (collective over that group),
each shard is copied into its slot and the tensor re-pointed at the slot in place
(``t.data = slot``: the parameter now views the window and its old storage is freed, so
no weight exists twice), and one publish barrier makes every slot readable by peers.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..config import config
from . import native
from . import windows as W

log = logging.getLogger("torch_ce")


@dataclasses.dataclass
class Candidate:
    name: str
    tensor: torch.Tensor | None  # the local shard (what moves)
    group: Any  # ProcessGroup or None
    reason: str | None = None  # why it cannot bind (None: locally eligible)


@dataclasses.dataclass
class BindResult:
    """What one bind call did: ``bound`` moved now, ``already_bound`` were in windows."""

    bound: list[str] = dataclasses.field(default_factory=list)
    already_bound: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    windows_opened: int = 0
    bytes_bound: int = 0

    def __repr__(self) -> str:
        return (
            f"BindResult(bound={len(self.bound)}, already_bound={len(self.already_bound)}, "
            f"skipped={self.skipped}, windows_opened={self.windows_opened}, "
            f"bytes_bound={self.bytes_bound})"
        )


# ---------------------------------------------------------------------------------------
# Local eligibility
# ---------------------------------------------------------------------------------------


def local_reason(t: torch.Tensor, group, min_shard_bytes: int) -> str | None:
    """Why this rank cannot bind ``t`` into a window of ``group`` (None: it can)."""
    if group is None:
        return "no process group (plain tensors need group=...)"
    if dist.get_world_size(group) < 2:
        return "group of size 1: nothing to gather"
    if t.dim() < 1 or t.numel() == 0:
        return "empty or 0-d shard"
    if not t.is_contiguous():
        return "non-contiguous shard"
    if t.device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA unavailable"
    elif t.device.type == "cpu":
        if not config.host_transport:
            return "CPU tensor with the CUDA copy-engine transport (host transport off)"
    else:
        return f"unsupported device {t.device.type}"
    nbytes = t.numel() * t.element_size()
    if nbytes < min_shard_bytes:
        return f"shard below symm_min_shard_mib ({nbytes} B)"
    return None


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
            return Candidate(name, None, None, f"placement {placements} on mesh {tuple(mesh.shape)}: {what}")
        dim = sharded[0]
        if placements[dim] != Shard(0):
            return Candidate(name, None, None, f"placement {placements[dim]}, not Shard(0)")
        if not all(placements[d].is_replicate() for d in dims if d != dim):
            return Candidate(name, None, None, f"placement {placements}: not Replicate beside Shard(0)")
        world = mesh.size(dim)
        if p.shape[0] % world:
            return Candidate(name, None, None, f"uneven Shard(0) ({p.shape[0]} rows over {world})")
        pg = mesh.get_group(dim)
        local = p._local_tensor
        return Candidate(name, local, pg, local_reason(local, pg, min_shard_bytes))
    return Candidate(name, p, group, local_reason(p, group, min_shard_bytes))


# ---------------------------------------------------------------------------------------
# Agreement
# ---------------------------------------------------------------------------------------


def _descriptor(c: Candidate) -> tuple:
    t = c.tensor
    ranks = W.group_ranks_of(c.group) if c.group is not None else ()
    if t is None:
        return (ranks, None, None, None, c.reason or "ineligible")
    return (ranks, tuple(t.shape), str(t.dtype), t.device.type, c.reason)


def agree(cands: list[Candidate], agree_group) -> tuple[list[bool], list[str | None], str]:
    """(agreed flag, refusal reason) per candidate, and a job token shared by all ranks."""
    mine = [_descriptor(c) for c in cands]
    token = uuid.uuid4().hex[:8]
    gathered: list = [None] * dist.get_world_size(agree_group)
    dist.all_gather_object(gathered, (dist.get_rank(), token, mine), group=agree_group)
    by_rank = {r: lst for r, _, lst in gathered}
    job = gathered[0][1]
    agreed, reasons = [], []
    for i, c in enumerate(cands):
        d = mine[i]
        if d[4] is not None:
            agreed.append(False)
            reasons.append(d[4])
            continue
        ok, why = True, None
        for m in d[0]:
            other = by_rank.get(m)
            if other is None:
                ok, why = False, f"rank {m} of the group did not take part in the agreement"
            elif len(other) != len(mine):
                ok, why = False, f"rank {m} has {len(other)} candidate shards, this rank {len(mine)}"
            elif other[i][:4] != d[:4]:
                ok, why = False, f"rank {m} disagrees on shard {i} ({other[i][:4]} vs {d[:4]})"
            elif other[i][4] is not None:
                ok, why = False, f"rank {m} refused it: {other[i][4]}"
            if not ok:
                break
        agreed.append(ok)
        reasons.append(None if ok else f"rank disagreement: {why}")
    return agreed, reasons, job


# ---------------------------------------------------------------------------------------
# Binding
# ---------------------------------------------------------------------------------------


def _transport(device: torch.device):
    if device.type == "cuda":
        from . import cuda

        return cuda
    from . import host

    return host


def _mark_fallback(c: Candidate, reason: str) -> None:
    if c.tensor is not None and c.group is not None and c.tensor.numel():
        W.register(c.tensor, W.Fallback(reason, c.group.group_name, weakref.ref(c.tensor)))


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
        entry = W.lookup(c.tensor) if c.tensor is not None else None
        if isinstance(entry, W.Slot):
            res.already_bound.append(c.name)
        elif isinstance(entry, W.Fallback):
            res.skipped[c.name] = entry.reason
        elif c.group is None and agree_group is None:
            res.skipped[c.name] = c.reason or "no process group"
        else:
            pg = agree_group if agree_group is not None else c.group
            ranks = W.group_ranks_of(pg)
            if ranks == world_ranks:
                pg = dist.group.WORLD
            units.setdefault(ranks, (pg, []))[1].append(c)
    cuda = [c.tensor.device for _, ms in units.values() for c in ms
            if c.tensor is not None and c.tensor.is_cuda]

    def bind_units():
        for ranks in sorted(units):
            pg, members = units[ranks]
            _bind_unit(members, pg, res)

    if cuda:
        _off_the_graph_pool(bind_units, cuda[0])
    else:
        bind_units()
    if res.bound or res.skipped:
        log.info("torch_ce.bind: %s", res)
    for name, why in res.skipped.items():
        log.debug("torch_ce.bind: %s stays on the collective backend: %s", name, why)
    return res


def _off_the_graph_pool(fn, device: torch.device):
    """Run ``fn`` (a bind) on a thread of its own, ordered after the caller's current
    stream, and return its result.

    # NOTE [bind off the graph pool]
    Under CUDA-graph trees (``mode="reduce-overhead"``) a compiled graph's first run routes
    the allocations of the running thread into the graph's private pool, and the bind step
    runs inside that first run. What a bind leaves allocated (the tensors of its agreement
    collectives and publish barrier, which ProcessGroupNCCL keeps until its watchdog
    retires the work) would sit in the pool untracked, and the trees refuse to record
    ("tensors in the cudagraph pool not tracked as outputs"). From its own thread the bind
    allocates from the ordinary caching allocator. Binding on a side stream of the same
    thread did not help (run 8 in bench/results): the routing is by thread.
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


def _bind_unit(todo: list[Candidate], agree_pg, res: BindResult) -> None:
    """Agree over ``agree_pg``, open windows, move, publish (NOTE at the top)."""
    if dist.get_world_size(agree_pg) < 2:
        for c in todo:
            res.skipped[c.name] = c.reason or "group of size 1: nothing to gather"
        return
    if dist.get_backend(agree_pg) == "fake":
        # A fake process group has no peers whose windows could be read.
        for c in todo:
            res.skipped[c.name] = "fake process group: no peers to read from"
            _mark_fallback(c, res.skipped[c.name])
        return

    agreed, reasons, job = agree(todo, agree_pg)
    chosen: list[Candidate] = []
    for c, ok, why in zip(todo, agreed, reasons):
        if ok:
            chosen.append(c)
        else:
            res.skipped[c.name] = why
            _mark_fallback(c, why)
    if not chosen:
        return

    # Plan per pool, in order of first appearance (identical on every group member).
    by_pool: dict[tuple, list[Candidate]] = {}
    for c in chosen:
        key = W.pool_key(W.group_ranks_of(c.group), c.tensor.dtype, c.tensor.device)
        by_pool.setdefault(key, []).append(c)
    slots: list[tuple[Candidate, W.Slot]] = []
    for key, members in by_pool.items():
        pool = W.get_pool(key, config.window_cap_bytes)
        placed = pool.plan_slots([m.tensor.numel() * m.tensor.element_size() for m in members])
        n_new = placed[-1][0] + 1
        W.reserve_windows(n_new)
        group, device = members[0].group, members[0].tensor.device
        new = []
        for k in range(n_new):
            nbytes = sum(W.align_up(nb) for (wi, _, nb) in placed if wi == k)
            new.append(W.Window(key, len(pool.windows) + k, nbytes, group, key[0],
                                dist.get_rank(group), device, torch.empty(0, dtype=torch.uint8),
                                used=nbytes))
        tr = _transport(device)
        if device.type == "cuda":
            tr.open_windows(new)
        else:
            tr.open_windows(new, job)
        for w in new:
            W.add_window(pool, w)
        res.windows_opened += n_new
        for m, (wi, off, nb) in zip(members, placed):
            slots.append((m, W.Slot(new[wi], off, nb, tuple(m.tensor.shape), m.tensor.dtype, m.name)))

    # Move each shard into its slot in place; the old storage is released.
    with torch.no_grad():
        for c, slot in slots:
            view = _transport(slot.window.device).slot_local_view(slot)
            view.copy_(c.tensor)
            c.tensor.data = view
            res.bound.append(c.name)
            res.bytes_bound += slot.nbytes
    if any(s.window.device.type == "cuda" for _, s in slots):
        torch.cuda.synchronize()
        # Hand the shards' old blocks back to the driver: no weight held twice.
        torch.cuda.empty_cache()
    # One publish barrier: after it every slot is readable by every peer.
    dist.barrier(group=agree_pg)
    for c, slot in slots:
        _transport(slot.window.device).publish_slot(slot)
        W.register(c.tensor, slot)
        if slot.window.device.type == "cuda" and native.loaded():
            native.register_slot(slot)  # the C++ kernels' mirror of the registry
    if config.cost_mode == "calibrated":
        _calibrate(max((s for _, s in slots), key=lambda s: s.window.nbytes))


def _calibrate(slot: W.Slot) -> None:
    """Time wait(launch()) on the fresh windows for the reorder's cost curve (local only)."""
    from . import calibration as cost

    try:
        cost.calibrate(slot)
        if slot.window.device.type == "cuda":
            cost.measure_peaks(slot.window.device)
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
    be Shard(0) on a 1-D mesh with rows divisible by the mesh size; plain tensors are local
    shards of ``group``. Collective: every rank of each shard's group (of ``group`` if
    given) must call it with corresponding parameters. Binding an already-bound shard is a
    no-op. Returns a BindResult: what moved, what was already bound, what was skipped and why.
    """
    min_bytes = int((config.symm_min_shard_mib if min_shard_mib is None else min_shard_mib) * 2**20)
    cands = [candidate_from_param(n, p, group, min_bytes) for n, p in _named(params)]
    return bind_candidates(cands, agree_group=group)
