"""Cross-call prefetch: the next call's first weights, gathered under this call's last compute.

# NOTE [cross-call prefetch]
The first gathers of a forward have no compute before them to hide under: on 2 x H200 one
decoder layer's peer reads (243 MB per rank) take ~0.64 ms, 10% of a 1024-token forward of 8
layers, and at that size the copy stream is busy for most of the forward, so the head start
is never won back. With ``config.prefetch_next_call_mib`` > 0 the compiler appends one
``magi::ce_prefetch`` to the graph, after its last CE gather launch, listing the graph's
leading CE gathers up to that many MiB (passes/prefetch.py). At run time it gathers them
into fresh outputs on the same copy streams (queued behind the call's own gathers, under
its last layers' compute) and parks them here, one set per group. The next gather of that
group takes every parked member it asks for (the outputs still carry their c10d work, so
``wait_tensor`` orders the consumer after the copies); a gather that asks for none of them
drops the whole set (another graph runs in between: graph breaks, a different batch shape).

What it costs and assumes:
- The parked outputs stay allocated between calls (FSDP's "do not reshard the root").
- Weights change only inside ``torch_ce.updating_weights`` (NOTE [updating bound weights]
  in updates.py), which waits for the parked copies on the current stream and drops them
  before its first fence; a parked weight changed outside it is refused by the version net
  before it is used (NOTE [the version net] in versions.py).
- Nothing is prefetched while a CUDA graph is captured, and a parked set is never handed to
  a capturing gather (a replay cannot re-run this bookkeeping): the capture gathers as usual.
- Only bound members are prefetched: a member that fell back to the collective at run time
  is never gathered here (a collective issued by one rank alone would hang its peers).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Sequence

import torch

from . import native
from . import windows as W
from .versions import version_of
from .window_pools import on_release

log = logging.getLogger("torch_ce")


@dataclasses.dataclass
class _Parked:
    out: torch.Tensor
    version: int  # the shard's version counter when its gather was issued


_lock = threading.Lock()
_parked: dict[str, dict[int, _Parked]] = {}  # group name -> shard data_ptr -> parked output
stats = dict(prefetched=0, taken=0, dropped=0, stale=0)
_warned_drop: list = []


def _key(t: torch.Tensor) -> int:
    return t.data_ptr()


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _sync_native() -> None:
    native.set_prefetch_pending(any_parked())


_deferred: list[torch.Tensor] = []


def _retire(outs) -> None:
    """Drop parked outputs that no call will consume. Their c10d work is waited on a
    throwaway stream (the registry would otherwise report unwaited work at exit) and the
    caching allocator keeps each block until its copies finished (record_stream). During a
    CUDA-graph capture that wait would be captured: they wait for the next call outside."""
    cuda = [o for o in outs if o.is_cuda]
    if cuda and torch.cuda.is_current_stream_capturing():
        _deferred.extend(cuda)
        return
    cuda += _deferred
    _deferred.clear()
    if not cuda:
        return
    side = torch.cuda.Stream(device=cuda[0].device)
    with torch.cuda.stream(side):
        for o in cuda:
            torch.ops._c10d_functional.wait_tensor(o)


def prefetch(shards: Sequence[torch.Tensor], group_size: int, group_name: str) -> None:
    """The ``magi::ce_prefetch`` kernel: gather the bound ``shards`` now and park them."""
    if group_size < 2 or not shards or _capturing(shards[0]):
        return
    bound = [s for s in shards if isinstance(W.lookup(s), W.Slot)]
    drop(group_name)  # a set nobody took is stale by now; never gather twice into the park
    if not bound:
        return
    outs = torch.ops.magi.ce_all_gather_coalesced(bound, group_size, group_name)
    with _lock:
        _parked[group_name] = {_key(s): _Parked(o, version_of(s)) for s, o in zip(bound, outs)}
        stats["prefetched"] += len(bound)
    _sync_native()


def take(shards: Sequence[torch.Tensor], group_name: str) -> dict[int, torch.Tensor]:
    """Parked outputs for ``shards`` (by index), removed from the park. A call that matches
    none of the group's parked members drops them all (NOTE [cross-call prefetch])."""
    with _lock:
        park = _parked.get(group_name)
        if not park:
            return {}
        if _capturing(shards[0]):
            hits = {}
        else:
            hits = {i: park.pop(_key(s)) for i, s in enumerate(shards) if _key(s) in park}
        stale = {i for i, p in hits.items() if version_of(shards[i]) != p.version}
        if not hits:
            dropped = list(park.values())
            del _parked[group_name]
        else:
            dropped = [hits.pop(i) for i in sorted(stale)]
            if not park:
                del _parked[group_name]
        stats["taken"] += len(hits)
        stats["stale"] += len(stale)
        stats["dropped"] += len(dropped) - len(stale)
    _sync_native()
    if dropped:
        if len(dropped) > len(stale) and not _warned_drop:
            _warned_drop.append(True)
            log.info("torch_ce: a prefetched set was not used by the next gather of group %s "
                     "(another graph ran in between?); dropped. Further drops are counted in "
                     "torch_ce.prefetch.stats", group_name)
        _retire([p.out for p in dropped])
    return {i: p.out for i, p in hits.items()}


def drop(group_name: str | None = None, on_current_stream: bool = False) -> None:
    """Forget parked outputs (of one group, or all). ``on_current_stream``: the current
    stream waits for their copies first (``updating_weights``: its fence is then ordered
    after them)."""
    with _lock:
        names = list(_parked) if group_name is None else [group_name]
        dropped = [p.out for n in names for p in _parked.pop(n, {}).values()]
        stats["dropped"] += len(dropped)
    _sync_native()
    if on_current_stream:
        for o in dropped:
            if o.is_cuda:
                torch.ops._c10d_functional.wait_tensor(o)
    _retire(dropped)


def any_parked() -> bool:
    """Cheap check for the gather's hot path: is anything parked at all?"""
    return bool(_parked)


def pending() -> int:
    """How many outputs are parked now."""
    with _lock:
        return sum(len(p) for p in _parked.values())


def reset_stats() -> None:
    for k in stats:
        stats[k] = 0


on_release(drop)
