"""Binding FSDP2 chunks into the pooled windows, through the bind rounds every bind uses.

A group's chunk is one rank's FSDP2 all-gather input: its parameters' padded shards
(``_sharded_param_data``), concatenated, cast to ``param_dtype`` when there is one. One
bind round (``runtime.binding.bind_candidates``: agree, place, open, move, publish) binds
every served group of the model; each group becomes one slot, so a gather is one read per
peer. What the slot holds:

- static, in place (no cast): the chunk itself. The bind moves it into the window, then
  each parameter's padded shard and DTensor local tensor are re-pointed at their part of
  it (as FSDP2's own ``reset_sharded_param`` re-points them), so the weights live in the
  window once and peers read them where they are. Their views share the chunk's version
  counter, so the version net sees every in-place write of any of them.
- static, cast (``param_dtype``): a cast copy of the chunk, made once (NOTE [cast slots] in
  runtime/staging.py); the weights stay where they are, watched by the net, and
  ``updating_weights`` refreshes the copy (fsdp2/updates.py).
- staged (training): a staging buffer that each call refreshes from FSDP2's own input, and
  two step words beside it in their own slot (NOTE [FSDP2 training: step words]).
"""
from __future__ import annotations

import dataclasses
import logging
import weakref

import torch

from .. import report
from ..runtime import versions
from ..runtime import windows as W
from ..runtime.binding import Candidate, bind_candidates, local_reason
from ..runtime.inference_tensors import has_version_counter
from .groups import Group

log = logging.getLogger("torch_ce")


@dataclasses.dataclass(eq=False)
class Bound:
    """What a served group reads: its chunk's ``slot`` (peers' copies in
    ``slot.peer_views``), this rank's ``buffer`` (the chunk's local view), and for a
    staged group its ``words`` slot (this rank's two words in ``words.peer_views``)."""

    slot: W.Slot
    buffer: torch.Tensor
    words: W.Slot | None = None
    # A static group's FSDP2 state when its slot was last made consistent, per parameter:
    # (FSDPParam, its __dict__, its _sharded_param_data, its sharded_param, that one's
    # local tensor); and detach() aliases of the parameters, which the net watches (they
    # share the parameters' version counters). NOTE [FSDP2 parameters that move].
    anchors: tuple = ()
    aliases: list = dataclasses.field(default_factory=list)
    _pairs: tuple = ()  # (__dict__, _sharded_param_data) per parameter: what ``views`` compares
    # A CUDA training group's hold on its words' registered host mappings (its finalizer
    # lets go of them: fsdp2/step_words.py).
    host_words: object = None

    def views(self) -> bool:
        """Whether FSDP2 still gathers what the slot was made from (every gather of a static
        group asks: one identity test per parameter, no tensor call)."""
        for d, data in self._pairs:
            if d.get("_sharded_param_data") is not data:
                return False
        return True


def device_of(group: Group) -> torch.device:
    return group.fsdp_params[0]._sharded_param_data.device


def _fill(buffer: torch.Tensor, group: Group) -> None:
    """``buffer`` <- the group's chunk (cast like FSDP2's ``_to_dtype_if_needed``)."""
    off = 0
    with torch.no_grad():
        for fp in group.fsdp_params:
            n = fp._sharded_param_data.numel()
            buffer[off:off + n].copy_(fp._sharded_param_data)
            off += n


def refresh(group: Group, bound: Bound) -> None:
    """A cast chunk's slot <- the weights now (``updating_weights``' exit)."""
    _fill(bound.buffer, group)


def _repoint(group: Group, chunk: torch.Tensor, only=None) -> None:
    """Each parameter's padded shard and local tensor now view their part of ``chunk``
    (which views the window): what FSDP2's ``reset_sharded_param`` does when it re-pads.
    ``only``: the ids of the FSDPParams to re-point (default: all)."""
    off = 0
    for fp in group.fsdp_params:
        n = fp._sharded_param_data.numel()
        if only is not None and id(fp) not in only:
            off += n
            continue
        padded = chunk[off:off + n]
        local = fp._sharded_local_tensor
        dim = fp.fsdp_placement.dim
        length = local.size(dim) if local.numel() > 0 else 0
        fp._sharded_param_data = padded
        fp.sharded_param._local_tensor = padded.view(fp.padded_sharded_param_size).narrow(dim, 0, length)
        off += n


def _aliases(group: Group) -> list:
    """A ``detach()`` of each DTensor parameter: it shares the parameter's version counter
    (a DTensor's in-place ops move that one, not the local tensor's), so the net watches
    it in the parameter's place, with no weak reference to the parameter (NOTE [FSDP2
    parameters that move])."""
    return [fp.sharded_param.detach() for fp in group.fsdp_params]


def _anchor(group: Group, bound: Bound) -> None:
    """Record what FSDP2 gathers from now (NOTE [FSDP2 parameters that move])."""
    fps = group.fsdp_params
    bound.anchors = tuple((fp, fp.__dict__, fp._sharded_param_data, fp.sharded_param,
                           fp.sharded_param._local_tensor) for fp in fps)
    bound._pairs = tuple((a[1], a[2]) for a in bound.anchors)


def _watch(group: Group, bound: Bound, extra=()) -> None:
    """The version net's watch of a static group (NOTE [the version net]): the weights'
    counters (the chunk's, shared by the views of an in-place chunk; a cast chunk's
    weights' own), the DTensor parameters' (through their aliases), their state dicts';
    named by the parameters' local tensors and the module to ``updating_weights``.
    ``extra``: more tensors to watch (local tensors with counters of their own)."""
    fps = group.fsdp_params
    locals_ = [fp._sharded_local_tensor for fp in fps]
    tensors = [*bound.aliases, *extra]
    if group.cast:
        tensors += [fp._sharded_param_data for fp in fps] + locals_
    # The local tensors name the slot to the state-dict hook (a DTensor parameter's inner
    # tensor); the parameters themselves get no weak reference.
    versions.watch_members(bound.slot, owners=locals_, members=[*locals_, group.module],
                           tensors=tensors)
    for m in {id(fp._module_info.module): fp._module_info.module for fp in fps}.values():
        versions._follow_state_dict(m)


def _unwatched(group: Group) -> list[str]:
    """The parameters of a static group that no version counter watches once bound (NOTE
    [inference tensors at bind] in runtime/inference_tensors.py), by name: those whose
    DTensor parameter is an inference tensor (its in-place ops and its state-dict entries
    move no counter), and in a cast group those whose shard is one (it stays where it is,
    the slot a copy). An in-place group's shards become views of the chunk, an ordinary
    tensor."""
    out = []
    for i, fp in enumerate(group.fsdp_params):
        held = [fp.sharded_param] + ([fp._sharded_param_data, fp._sharded_local_tensor] if group.cast else [])
        if not all(has_version_counter(t) for t in held):
            out.append(getattr(fp, "_param_fqn", None) or f"{group.name}[{i}]")
    return out


def bind(groups: list[Group]) -> dict[int, Bound]:
    """Bind every served group (one round; collective over each group's ranks, every rank
    calls it with the same groups in the same order). A candidate the agreement refuses
    (on any rank) leaves its group on FSDP2's all-gather, with the reason, on every rank.
    Returns ``Bound`` by ``id(group)``."""
    cands: list[Candidate] = []
    made: dict[int, tuple] = {}
    for g in groups:
        name = f"fsdp2:{g.name}"
        if g.reason:  # a rank that refused it lists fewer candidates: its peers' agreement refuses them too
            continue
        device = g.fsdp_params[0]._sharded_param_data.device
        # An ordinary tensor also under inference_mode: the parameters re-pointed at an
        # in-place chunk share its version counter (NOTE [inference tensors at bind]).
        with torch.inference_mode(False):
            chunk = torch.empty(g.numel, dtype=g.dtype, device=device)
            if g.mode == "static":
                _fill(chunk, g)
            else:
                chunk.zero_()
        aliases = _aliases(g) if g.mode == "static" else []
        c = Candidate(name, chunk, g.process_group, local_reason(chunk, g.process_group),
                      owners=aliases,
                      unwatched=_unwatched(g) if g.mode == "static" else [])
        cands.append(c)
        words = None
        if g.mode == "staged":  # host memory on every device (fsdp2/step_words.py)
            wt = torch.zeros(2, dtype=torch.int32)
            words = Candidate(f"{name}/step words", wt, g.process_group,
                              local_reason(wt, g.process_group, min_shard_bytes=0))
            cands.append(words)
        made[id(g)] = (c, words, aliases)
    if not made:
        return {}
    res = bind_candidates(cands)
    report.record_bind(res)
    out: dict[int, Bound] = {}
    for g in groups:
        if id(g) not in made:
            continue
        c, words, aliases = made[id(g)]
        slot = W.lookup(c.tensor)
        wslot = W.lookup(words.tensor) if words is not None else None
        if not isinstance(slot, W.Slot) or (words is not None and not isinstance(wslot, W.Slot)):
            g.reason = res.skipped.get(c.name) or (res.skipped.get(words.name) if words else "") \
                or "not bound"
            g.mode = ""
            continue
        b = Bound(slot, c.tensor, wslot, aliases=aliases)
        if g.mode == "static":
            if not g.cast:
                _repoint(g, c.tensor)
            _anchor(g, b)
            _watch(g, b)
        else:
            slot.watch = None  # refreshed every call: nothing for the net to see
            wslot.watch = None
            if device_of(g).type == "cuda":
                from . import step_words

                step_words.hold(wslot)
                b.host_words = weakref.finalize(b, step_words.let_go, step_words.bases(wslot))
        out[id(g)] = b
    return out


# NOTE [FSDP2 parameters that move]
# FSDP2 points a group's sharded data at new tensors whenever its parameters get new
# ones: ``load_state_dict(assign=True)`` (its post-load hook), and ``nn.Module._apply``
# (``.to()``, ``.half()``, ``.float()``, ``to_empty()``: it swaps each DTensor parameter's
# contents with ``torch.utils.swap_tensors``), both through
# ``FSDPParam.reset_sharded_param``, which gives ``_sharded_param_data`` a new tensor
# when the local tensor's storage changed. A static group's peers keep reading its bound
# slot, so from then on they would read the old weights beside this rank's new ones, with
# no error. So each bound static group records what FSDP2 gathered from when its slot was
# last made consistent (``Bound.anchors``), and:
# - every gather of the group compares each parameter's ``_sharded_param_data`` with it
#   by identity (``Bound.views``: one dict lookup and one ``is`` per parameter), and the
#   forward pre-hook also each ``sharded_param`` (``settle``): a difference outside
#   ``updating_weights`` is a ``StaleWeightError`` on this rank before it reads anything;
#   a parameter whose new local tensor is a ``detach()`` over the same storage (``.to()``
#   to where it already is) is adopted, while nothing wrote through it (its own counter
#   is still 0);
# - ``updating_weights``' exit (every rank finished writing, before the last fence)
#   copies the new values into the slot, points FSDP2 back at it and watches the new
#   tensors (``rebind``): the window holds the weights as before, nothing is bound again,
#   and an empty block adopts tensors given outside it. A cast group's slot is a copy: its
#   weights stay where FSDP2 put them and the exit's refresh copies them. New sizes or
#   dtypes (``.half()`` alone) cannot go into the slot: the group refuses every gather,
#   with the reason, until ``disable`` and ``enable``.
# The net watches the parameters through ``detach()`` aliases, which share their version
# counters, never through weak references to them: ``swap_tensors`` refuses a tensor
# that has one, and every ``_apply`` on an enabled model failed with "Couldn't swap".
def _name(group: Group, i: int, fp) -> str:
    return getattr(fp, "_param_fqn", None) or f"{group.name}[{i}]"


def stale_error(group: Group, bound: Bound) -> versions.StaleWeightError:
    moved = [_name(group, i, a[0]) for i, a in enumerate(bound.anchors)
             if a[1].get("_sharded_param_data") is not a[2] or a[0].sharded_param is not a[3]
             or a[3]._local_tensor is not a[4]]
    shown = ", ".join(moved[:4]) + (f", ... ({len(moved)} parameters)" if len(moved) > 4 else "")
    return versions.StaleWeightError(
        f"torch_ce.fsdp2: {group.name}: FSDP2's sharded parameters ({shown}) were given new "
        "tensors outside torch_ce.updating_weights (load_state_dict(assign=True), to_empty(), "
        ".to(), .half(), .float(), ...): peers read this group from the window it is bound "
        "to, so they would read the old weights beside this rank's new ones. Do it inside "
        "`with torch_ce.updating_weights(model):` on every rank (the new values then go into "
        "the window); entering it now on every rank, even with an empty block, adopts them "
        "(NOTE [FSDP2 parameters that move]).")


def settle(group: Group, bound: Bound) -> None:
    """The forward pre-hook's check of a bound static group (NOTE [FSDP2 parameters that
    move]): raise ``StaleWeightError`` where FSDP2 no longer gathers from the slot's
    tensors; adopt local tensors that were only swapped for aliases of themselves."""
    adopt = False
    for fp, d, data, param, local in bound.anchors:
        if d.get("_sharded_param_data") is not data or fp.sharded_param is not param:
            raise stale_error(group, bound)
        if param._local_tensor is not local:
            adopt = True
    if not adopt:
        return
    fresh = []
    for fp, _, data, param, local in bound.anchors:
        # A fresh detach() over the slot's storage: its counter is its own, and still 0
        # unless something wrote through it (then the net could not tell what).
        new = param._local_tensor
        if new is local:
            continue
        if (new.untyped_storage().data_ptr() != data.untyped_storage().data_ptr()
                or new._version not in (0, data._version)):
            raise stale_error(group, bound)
        fresh.append(new)
    _anchor(group, bound)
    _watch(group, bound, fresh)


def rebind(group: Group, bound: Bound) -> str:
    """``updating_weights``' exit, after every rank finished writing: the slot holds what
    FSDP2 gathers now (NOTE [FSDP2 parameters that move]). Returns why it cannot ("":
    done, or nothing moved)."""
    if not bound.anchors:
        return ""
    same = all(d.get("_sharded_param_data") is data and fp.sharded_param is param
               and param._local_tensor is local for fp, d, data, param, local in bound.anchors)
    if same:
        return ""
    for i, (fp, _, data, _, _) in enumerate(bound.anchors):
        new = fp._sharded_param_data
        if new is not data and (new.dtype != data.dtype or new.numel() != data.numel()
                                or new.device != data.device):
            return (f"torch_ce.fsdp2: {group.name}: {_name(group, i, fp)} now gathers "
                    f"{new.numel()} {new.dtype} elements on {new.device} where its window slot "
                    f"holds {data.numel()} {data.dtype} on {data.device} (re-typed or resized "
                    "inside updating_weights); call fsdp2.disable(model) and enable it again on "
                    "every rank")
    with torch.no_grad():
        if not group.cast:
            for fp, _, data, _, _ in bound.anchors:
                new = fp._sharded_param_data
                if new is not data:
                    data.copy_(new)  # ``data`` views the chunk: the window
            _repoint(group, bound.buffer)
    bound.aliases = _aliases(group)
    _anchor(group, bound)
    _watch(group, bound)
    return ""


def unbind(group: Group, bound: Bound) -> None:
    """``disable()``: an in-place group's weights leave the window for memory of their own,
    values kept, so the window can go (NOTE [windows of one owner] in
    runtime/window_pools.py). Parameters FSDP2 already moved elsewhere stay there."""
    if bound.host_words is not None:
        bound.host_words()  # unregistered at the disable's flush, after its synchronize
    if group.mode != "static" or group.cast or not bound.anchors:
        return
    ours = {id(fp) for fp, d, data, _, _ in bound.anchors if d.get("_sharded_param_data") is data}
    if not ours:
        return
    with torch.inference_mode(False), torch.no_grad():
        own = torch.empty_like(bound.buffer)
        own.copy_(bound.buffer)
    _repoint(group, own, ours)
    bound.anchors, bound._pairs, bound.aliases = (), (), []
