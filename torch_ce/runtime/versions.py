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
    consistent across ranks. ``weight`` is the weight itself (also an inference tensor,
    which has no counter: the protocol still finds it, NOTE [what the net sees])."""

    __slots__ = ("name", "weight", "refs", "versions", "poison", "members")

    def __init__(self, name: str, tensors):
        self.name = name
        self.weight = weakref.ref(tensors[0])
        # Weak references to what else names this weight to ``updating_weights(params)``
        # (a slot holding several weights: an FSDP2 group's chunk, its parameters' local
        # shards and modules; fsdp2/chunks.py).
        self.members: list = []
        self.refs: list = []
        self.versions: list[int] = []
        self.poison = ""
        self.reset(tensors)

    def reset(self, tensors=None) -> None:
        """Record the current versions (of ``tensors`` when given, else the watched ones),
        and lift any poison. State-dict shadows whose entries died go."""
        if tensors is not None:
            self.refs = []
            self._take(tensors)
        self.refs = [r for r in self.refs if r() is not None
                     and not (isinstance(r, _Shadow) and r.alive() is None)]
        self.versions = [r()._version for r in self.refs]
        self.poison = ""

    def add(self, tensors, shadow: bool = False) -> None:
        """Watch ``tensors`` too (the protocol learns a module's wrappers); ``shadow``: a
        state dict's detached entries, watched through a ``_Shadow`` (NOTE [what the net
        sees]). Forgets the dead, and the shadows of dead entries that wrote nothing."""
        keep = [(r, v) for r, v in zip(self.refs, self.versions)
                if r() is not None and not (isinstance(r, _Shadow) and r.alive() is None
                                            and r()._version == v)]
        self.refs = [r for r, _ in keep]
        self.versions = [v for _, v in keep]
        self._take(tensors, shadow)

    def _take(self, tensors, shadow: bool = False) -> None:
        for t in tensors:
            if t is None or t.is_inference():
                continue
            if any((r.alive() if isinstance(r, _Shadow) else r()) is t for r in self.refs):
                continue
            self.refs.append(_Shadow(t) if shadow else weakref.ref(t))
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


class _Shadow:
    """A watched tensor that may die before its write is seen: a state dict's entry, which
    ``model.state_dict()[k].to_local().copy_(x)`` writes and drops at once. It holds a
    ``detach()`` of the entry (the same version counter and storage, no copy), so the
    write is still seen after the entry died; ``alive`` tells when it did."""

    __slots__ = ("alive", "t")

    def __init__(self, t: torch.Tensor):
        self.alive = weakref.ref(t)
        with torch.autograd.grad_mode.no_grad():
            self.t = t.detach()

    def __call__(self) -> torch.Tensor:
        return self.t


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter; 0 for an inference tensor, which has none."""
    return 0 if t.is_inference() else t._version


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


def _inner(t) -> list:
    """The tensors a wrapper subclass holds (a DTensor's local tensor); [] for a plain one."""
    if not _is_wrapper(type(t)):
        return []
    try:
        names, _ = t.__tensor_flatten__()
    except Exception:  # noqa: BLE001 (a half-built wrapper: holds nothing we watch)
        return []
    return [x for x in (getattr(t, n, None) for n in names) if isinstance(x, torch.Tensor)]


def _scan(shards, wrappers) -> tuple[dict[int, list[torch.Tensor]], list[torch.nn.Module]]:
    """One pass over the collector's objects, once per bind: the tensor subclasses (DTensor
    parameters) that hold each of ``shards`` as an inner tensor, by ``id(shard)`` (a
    wrapper's in-place ops move its own version counter, not the shard's); and the modules
    whose parameters are any such wrapper or one of ``wrappers`` (their state dicts are
    followed, NOTE [what the net sees])."""
    want = {id(s): s for s in shards}
    found: dict[int, list[torch.Tensor]] = {}
    modules = []
    for o in gc.get_objects():
        if issubclass(type(o), torch.nn.Module):  # type(): a weak proxy raises on isinstance
            modules.append(o)
            continue
        if not want or not _is_wrapper(type(o)):
            continue
        for inner in _inner(o):
            if id(inner) in want and want[id(inner)] is inner:
                found.setdefault(id(inner), []).append(o)
    params = {id(w) for w in wrappers} | {id(o) for v in found.values() for o in v}
    held = [m for m in modules
            if any(id(p) in params for p in m._parameters.values() if p is not None)]
    return found, held


def owners(shards) -> dict[int, list[torch.Tensor]]:
    """The tensor subclasses that hold each of ``shards``, by ``id(shard)`` (``_scan``)."""
    return _scan(shards, [])[0] if shards else {}


def watch_slots(items) -> None:
    """``items``: (slot, weight, name, known owners); each slot gets a Watch of the weight
    and its owners (those given, else found by one scan), and the modules holding those
    owners have their state dicts followed."""
    items = list(items)
    need = [w for _, w, _, own in items if not own]
    given = [o for _, _, _, own in items for o in (own or [])]
    found, modules = _scan(need, given)
    for slot, w, name, own in items:
        slot.watch = Watch(name, [w, *(own or found.get(id(w), []))])
        _note(w, slot)
        _mirror(slot)
    for m in modules:
        _follow_state_dict(m)


# NOTE [what the net sees]
# A write moves the version counter of the tensor it goes through, and of the tensors that
# share that counter (views, ``detach()``). The net watches, per slot: the weight (the
# local shard), every tensor subclass wrapping it (the DTensor parameter), and the
# entries of every state dict taken of a module holding it. The last need a hook: a
# DTensor's ``detach()`` (what ``state_dict()`` and ``get_model_state_dict`` return)
# shares the parameter's wrapper counter but gives its local tensor a fresh one, so
# ``model.state_dict()[k].to_local().copy_(x)`` moves no counter of the parameter. Each
# module that holds a bound weight's wrapper gets a state-dict post hook (at bind) that
# adds its entries to the slot's watch (through a ``_Shadow``: an entry written and dropped at
# once is still seen; unwritten dead ones leave at the next add or reset). What still
# moves no watched counter: ``.data`` (a fresh counter for each ``.data``), c10d writes
# (``dist.broadcast`` bumps none), writes to an inference tensor (no counter at all), and
# a peer's read that was in flight when the write began. Those the protocol covers; the
# README's "Weights that change" lists them.
_watched_by_weight: dict[int, tuple] = {}  # id(weight) -> (weakref(weight), [weakref(slot)])
_followed: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _note(weight: torch.Tensor, slot) -> None:
    hit = _watched_by_weight.get(id(weight))
    if hit is None or hit[0]() is not weight:
        hit = _watched_by_weight[id(weight)] = (weakref.ref(weight), [])
    hit[1][:] = [r for r in hit[1] if r() is not None and r() is not slot] + [weakref.ref(slot)]


def watch_members(slot, owners=(), members=(), tensors=()) -> None:
    """A slot holding several weights (an FSDP2 group's chunk): its watch also covers
    ``tensors``; state dicts of ``owners`` (their wrappers) are followed like a bound
    weight's (NOTE [what the net sees]); ``members`` (tensors or modules) name the slot to
    ``updating_weights(params)``."""
    if slot.watch is None:
        return
    if tensors:
        slot.watch.add(list(tensors))
    for o in owners:
        _note(o, slot)
    slot.watch.members = [weakref.ref(m) for m in members]
    _mirror(slot)


def slots_of(weight: torch.Tensor) -> list:
    """The watched slots holding ``weight`` (in place, padded or cast)."""
    hit = _watched_by_weight.get(id(weight))
    if hit is None or hit[0]() is not weight:
        return []
    return [s for s in (r() for r in hit[1]) if s is not None and s.watch is not None]


def forget() -> None:
    """Drop the weight -> slot index (``release_all``)."""
    _watched_by_weight.clear()


def _follow_state_dict(module: torch.nn.Module) -> None:
    if module in _followed:
        return
    _followed.add(module)
    register = getattr(module, "register_state_dict_post_hook", None) or module._register_state_dict_hook
    register(_state_dict_post_hook)


def _state_dict_post_hook(module, state_dict, prefix, local_metadata) -> None:
    """Watch the detached entries ``state_dict()`` made of bound weights (NOTE [what the
    net sees])."""
    for name, p in module._parameters.items():
        if p is None:
            continue
        v = state_dict.get(prefix + name)
        if not isinstance(v, torch.Tensor) or v is p:
            continue
        for weight in [p, *_inner(p)]:
            for slot in slots_of(weight):
                slot.watch.add([v, *_inner(v)], shadow=True)
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


def _register_teardown() -> None:
    from . import window_pools

    window_pools.on_release(forget)


_register_teardown()
