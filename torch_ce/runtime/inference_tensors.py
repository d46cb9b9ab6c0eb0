"""Weights bound without a version counter (inference tensors): what the bind asks of a
shard before it moves, how the move keeps what the shard was, and the one notice per bind
call (NOTE [inference tensors at bind]).
"""
from __future__ import annotations

import logging
import warnings

import torch

log = logging.getLogger("torch_ce")


# NOTE [inference tensors at bind]
# A weight made under ``torch.inference_mode()`` is an inference tensor: it has no version
# counter, so the version net (NOTE [the version net] in versions.py) cannot see a write
# to it, and a write outside ``updating_weights`` would leave peers reading its old rows
# with no error anywhere. Inference engines load weights
# that way on purpose, and the protocol does cover them (it finds a weight by identity,
# not by counter), so every bind path that takes one in place or into a cast slot binds
# it, and says so once per bind call: a UserWarning and a log line naming the weights (at
# most 8, then how many more), and the bind's row in ``explain()``. Which paths: a
# compiled graph's bind step (in place) and stage step (cast slots), ``torch_ce.bind``,
# and FSDP2's static groups (their parameters' DTensor wrappers, and a cast group's
# weights: fsdp2/chunks.py names them in ``Candidate.unwatched``). A training graph's
# staging slot is refreshed from the weight every step and needs no counter; a gather
# outside compiled graphs leaves an inference tensor on the collective, with the reason
# (runtime/eager.py).
# The move keeps what the weight was: ``t.data = view`` takes the view's dispatch keys,
# so an inference shard re-pointed at a window view made outside inference mode would be
# neither (``is_inference()`` False, still no counter: the net's ``_version`` read
# raises), and an ordinary shard bound inside inference mode (a compiled call under
# ``torch.inference_mode()``, whose host windows are inference tensors) would silently
# lose its counter. ``alias`` makes the slot view the kind the shard was.


def has_version_counter(t: torch.Tensor) -> bool:
    """Whether a write to ``t`` moves a version counter (an inference tensor's does not;
    neither does one's that ``.data =`` re-pointed at ordinary storage)."""
    if t.is_inference():
        return False
    try:
        t._version
    except RuntimeError:
        return False
    return True


def warn_unwatched(names: list[str]) -> None:
    """One warning and one log line for the weights a bind call bound without a version
    counter (NOTE [inference tensors at bind]); nothing when there are none."""
    if not names:
        return
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    msg = (f"torch_ce.bind: {len(names)} weight(s) bound without a version counter (inference "
           f"tensors, made under torch.inference_mode()): {shown}. Write them only inside "
           "`with torch_ce.updating_weights(model):`, on every rank: no version counter can see "
           "a write to them outside it, so no error would say that peers read their old values "
           "(README, 'Weights that change').")
    log.warning("%s", msg)
    warnings.warn(msg, UserWarning, stacklevel=3)


def alias(view: torch.Tensor, inference: bool) -> torch.Tensor:
    """A tensor on ``view``'s storage, shape and strides that is an inference tensor
    exactly when ``inference`` (NOTE [inference tensors at bind]): what a moved shard's
    ``.data`` becomes, so it keeps its kind whatever mode the bind runs in."""
    if view.is_inference() == inference:
        return view
    with torch.inference_mode(inference):
        t = torch.empty(0, dtype=view.dtype, device=view.device)
        t.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())
    return t
