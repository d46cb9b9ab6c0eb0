"""FSDP2 weights that change: what ``torch_ce.updating_weights(model)`` does for them.

# NOTE [FSDP2 weights under the update protocol]
A static group is covered by the protocol like any bound weight (NOTE [updating bound
weights] in runtime/updates.py): its chunk's slot is watched, named by the parameters'
local tensors and modules, so ``updating_weights(model)`` fences its group, poisons it
while the block runs, and records the new versions after it. Two copies of the weights
live outside the slot, and the protocol's exit (after every rank finished writing, before
the last fence) refreshes both here:
- a cast chunk (``param_dtype``): copied again from the weights (cast);
- FSDP2's unsharded parameters: a module FSDP2 does not reshard after forward (the root,
  under ``no_grad``) keeps them, and its next forward gathers nothing. FSDP2's own path
  then computes with the old values after ``copy_`` into the local shards (its
  ``load_state_dict`` pre-hook reshards first, ``copy_`` does not). torch_ce reshards
  every FSDP2 module the update covers, so the next forward gathers the new values, on
  every path.
Parameters FSDP2 was given new tensors for inside the block (``load_state_dict(assign=
True)``, ``to_empty()``, ``.to()``) go back into the slot at the exit (NOTE [FSDP2
parameters that move] in chunks.py).
Outside the protocol a write that moves a watched counter (``copy_`` into ``to_local()``,
into ``model.state_dict()``'s entries, ``load_state_dict``) is a ``StaleWeightError`` at
the writing rank's next forward (a forward pre-hook checks, whether or not FSDP2 gathers
then), and at its next gather. Training groups stage their chunk at every call, so any
write is read at the next gather; the protocol reshards them too.
"""
from __future__ import annotations

import torch

from . import chunks


def _covered(group, wanted) -> bool:
    if wanted is None:
        return True
    fps = group.fsdp_params
    objs = [group.module, *(fp.sharded_param for fp in fps), *(fp._sharded_local_tensor for fp in fps)]
    return any(id(o) in wanted for o in objs)


def refresh_after_update(groups, bounds, wanted) -> None:
    """The exit's refreshes (NOTE [FSDP2 weights under the update protocol])."""
    resharded = set()
    with torch.no_grad():
        for g in groups:
            if not _covered(g, wanted):
                continue
            b = bounds.get(id(g))
            if b is not None and g.mode == "static":
                # Parameters given new tensors inside the block go back into the slot (NOTE
                # [FSDP2 parameters that move] in chunks.py); what cannot poisons the group
                # (an exception here would leave the peers in the last fence).
                why = chunks.rebind(g, b)
                if why and g.comm is not None:
                    g.comm.poison = why
                elif g.cast:
                    chunks.refresh(g, b)
            if id(g.param_group) not in resharded:
                resharded.add(id(g.param_group))
                g.param_group.reshard()
