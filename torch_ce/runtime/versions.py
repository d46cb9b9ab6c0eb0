"""The safety net for weights that change: each bound weight's version counters, checked
at every read of its slot (NOTE [the version net]).

# NOTE [the version net]
A weight bound in place is its window, and a cast slot is a copy made once; a peer reads
either whenever its stream gets there. A write outside ``torch_ce.updating_weights``
(runtime/updates.py) is unsafe: peers may still be reading, or read the old values later.
Where torch can tell, the writing rank never reads stale: every slot that holds a
weight (in place, padded, or its cast slot) carries a ``Watch`` of the version counters a
write moves, and each read of the slot compares them with the values recorded when the
slot was last made consistent (bind, or the protocol's exit). On a change the read
raises ``StaleWeightError`` naming the weight and the protocol. Which counters: the
local shard's (``copy_`` into it, an optimizer step on plain tensors) and that of every
tensor subclass wrapping it, found once at bind (a DTensor parameter's in-place ops,
``load_state_dict`` among them, move the wrapper's counter, never the local tensor's).
What no counter shows: ``.data`` writes (a fresh counter), c10d writes such as
``dist.broadcast`` (they bump none), and a peer's read that was in flight when the write
began; CUDA-graph replays run no host code. Those need the protocol.

While the protocol is open, and after it failed on some rank, the watches are poisoned:
every read raises with the reason, so no call computes with half-written weights.
"""
from __future__ import annotations

import gc
import weakref

import torch


class StaleWeightError(RuntimeError):
    """A bound weight changed outside ``torch_ce.updating_weights``: reading it could give
    stale or mixed values (NOTE [the version net])."""


class Watch:
    """The version counters of one bound weight, and their values when it was last
    consistent across ranks."""

    __slots__ = ("name", "refs", "versions", "poison")

    def __init__(self, name: str, tensors):
        self.name = name
        self.refs: list = []
        self.versions: list[int] = []
        self.poison = ""
        self.reset(tensors)

    def reset(self, tensors=None) -> None:
        """Record the current versions (of ``tensors`` when given, else the watched ones),
        and lift any poison."""
        if tensors is not None:
            self.refs = []
            for t in tensors:
                if t is not None and not t.is_inference() and all(r() is not t for r in self.refs):
                    self.refs.append(weakref.ref(t))
        live = [r() for r in self.refs]
        self.refs = [r for r, t in zip(self.refs, live) if t is not None]
        self.versions = [t._version for t in live if t is not None]
        self.poison = ""

    def add(self, tensors) -> None:
        """Watch ``tensors`` too (the protocol learns a module's wrappers)."""
        for t in tensors:
            if t is not None and not t.is_inference() and all(r() is not t for r in self.refs):
                self.refs.append(weakref.ref(t))
                self.versions.append(t._version)

    def moved(self) -> bool:
        for r, v in zip(self.refs, self.versions):
            t = r()
            if t is not None and t._version != v:
                return True
        return False

    def error(self) -> StaleWeightError:
        if self.poison:
            return StaleWeightError(f"torch_ce: {self.name or 'a weight'} cannot be read: {self.poison}")
        return StaleWeightError(
            f"torch_ce: {self.name or 'a weight'} changed in place outside "
            "torch_ce.updating_weights (its version counter moved since its slot was made "
            "consistent): peers may read old or half-written values, and this rank would "
            "mix them. Write bound weights inside `with torch_ce.updating_weights(model):` "
            "on every rank (README, 'Weights that change'); entering it now and writing "
            "again makes them consistent.")


def check(slot) -> None:
    """Raise if ``slot``'s weight changed since it was made consistent (the hot path)."""
    w = slot.watch
    if w is not None and (w.poison or w.moved()):
        raise w.error()


_wrapper_types: dict[type, bool] = {}


def _is_wrapper(tp: type) -> bool:
    hit = _wrapper_types.get(tp)
    if hit is None:
        hit = _wrapper_types[tp] = (isinstance(tp, type) and issubclass(tp, torch.Tensor)
                                    and tp is not torch.Tensor and tp is not torch.nn.Parameter
                                    and hasattr(tp, "__tensor_flatten__"))
    return hit


def owners(shards) -> dict[int, list[torch.Tensor]]:
    """The tensor subclasses (DTensor parameters) that hold each of ``shards`` as an inner
    tensor, by ``id(shard)``: one pass over the collector's objects, once per bind (a
    wrapper's in-place ops move its own version counter, not the shard's)."""
    want = {id(s): s for s in shards}
    found: dict[int, list[torch.Tensor]] = {}
    if not want:
        return found
    for o in gc.get_objects():
        if not _is_wrapper(type(o)):
            continue
        try:
            names, _ = o.__tensor_flatten__()
        except Exception:  # noqa: BLE001 (a half-built wrapper: not an owner)
            continue
        for n in names:
            inner = getattr(o, n, None)
            if inner is not None and id(inner) in want and want[id(inner)] is inner:
                found.setdefault(id(inner), []).append(o)
    return found


def watch_slots(items) -> None:
    """``items``: (slot, weight, name, known owners); each slot gets a Watch of the weight
    and its owners (those given, else found by ``owners``)."""
    items = list(items)
    need = [w for _, w, _, own in items if not own]
    found = owners(need) if need else {}
    for slot, w, name, own in items:
        slot.watch = Watch(name, [w, *(own or found.get(id(w), []))])
        _mirror(slot)


def _mirror(slot) -> None:
    """The C++ gather checks the same counters for CUDA slots (native.watch_slot)."""
    from . import native

    if slot.window.device.type == "cuda" and native.loaded() and slot.peer_ptrs:
        native.watch_slot(slot)


def poison(slot, why: str) -> None:
    if slot.watch is not None:
        slot.watch.poison = why
        _mirror(slot)


def reset(slot, extra=()) -> None:
    if slot.watch is not None:
        slot.watch.reset()
        if extra:
            slot.watch.add(extra)
        _mirror(slot)
