"""Reshard after forward: the backward gathers each weight again instead of keeping it.

# NOTE [reshard after forward]
Under plain ``torch.compile`` AOTAutograd's partitioner saves what the backward needs,
and for a SimpleFSDP weight that is the *gathered* weight (collectives are never
recomputed unless tagged: ``force_save_collectives``): every full weight stays alive from
its forward use to its backward use, which undoes FSDP's memory saving. FSDP reshards
after forward and gathers again in the backward; torchtitan's graph trainer gets that by
tagging the gathers in the joint graph. This pass does the same on
``torch._inductor.config.joint_custom_pre_pass``, which runs on the joint graph before the
partitioner: each weight gather chain (parameter shard -> optional dtype cast ->
all_gather_into_tensor -> wait_tensor) that the copy engines serve is tagged
``MUST_RECOMPUTE``, so the partitioner
saves the shard (a parameter: free) and the backward graph recomputes the chain right
before its first use (``reordering_to_mimic_autograd_engine``).

# NOTE [reshard decides alike on every rank]
A tagged gather runs again in the backward; an untagged one does not. So the tags decide
which collectives each rank's backward issues, and ranks whose tags differ hang: one waits
in a re-gather while its peer waits in a gradient reduce-scatter. The tags therefore come
only from facts that are the same on every rank, whatever its shard sizes: which parameter
is gathered, the gathered output's (global) shape and what reads it, the input chain
placeholder -> optional cast -> optional ``constant_pad_nd``, the mutated inputs and the
config (``gate.serving_refusal``). Never the local shard: with an uneven Shard(0) the
short ranks pad before their gathers (their chains have one more node) and may hold no row
at all. A pad in the chain is recomputed with the gather, and a dim-0 slice of the wait
(the unpad of an uneven Shard(0)) with it, so no rank saves a gathered weight.

# NOTE [reshard only what the copy engines serve]
Re-gathering in the backward trades collective traffic for memory. The plain compiled run
does not reshard, so for a gather the copy engines do not serve (refused by the gate's
rules) resharding would only add collectives: torch_ce enabled would be slower than
without. So only the gathers ``gate.serving_refusal`` accepts are tagged; the others keep
the partitioner's choice, exactly as without torch_ce. The same predicate runs with either
transport, so an NCCL baseline (``reshard_after_forward=True``) has the same schedule.

Values do not change (a gather is exact, a cast and a pad are deterministic), only what
is alive when. It is installed with either transport when ``config.reshards_after_forward``
(on by default with "copy_engine" and training), so an NCCL baseline can run the same
schedule.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import fx_utils as U
from . import gate


def weight_chain(gather: fx.Node) -> list[fx.Node] | None:
    """(cast / pad..., gather, wait, dim-0 slices of the wait) of a weight gather; None for
    anything else (an activation, a gather of a gather)."""
    wg = gate.weight_gather(gather)
    if wg is None or wg.wait is None:
        return None
    slices = [u for u in wg.wait.users if u.op == "call_function" and u.target in gate._SLICE_OPS
              and (u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)) == 0]
    return [*wg.chain, gather, wg.wait, *slices]


def tag_recompute(graph: fx.Graph, cfg=None) -> int:
    """Tag every weight gather chain the copy engines serve MUST_RECOMPUTE (NOTE [reshard
    decides alike on every rank], NOTE [reshard only what the copy engines serve]);
    returns how many."""
    from torch.utils.checkpoint import CheckpointPolicy

    from ..config import config

    cfg = cfg or config
    U.merge_waits(graph)  # NOTE [one gather, several waits] in fx_utils.py
    ph_index = gate._placeholder_index(graph)
    mutated = gate.mutated_inputs(graph)
    n = 0
    for g in U.find_op_nodes(graph, U.ALL_GATHER):
        chain = weight_chain(g)
        if chain is None:
            continue
        if gate.serving_refusal(g, cfg, training=True, ph_index=ph_index, mutated=mutated) is not None:
            continue
        for node in chain + _resplit(chain[-1], g):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        n += 1
    return n


def _resplit(wait: fx.Node, gather: fx.Node) -> list[fx.Node]:
    """A Shard(d) gather's re-split (split, getitems, cat: NOTE [Shard(1) reads] in gate.py),
    recomputed with it: else the partitioner saves the rebuilt full weight."""
    from .gate import resplit_of

    x = gather.args[0]
    found = resplit_of(wait, x.meta.get("val") if isinstance(x, fx.Node) else None, int(gather.args[1]))
    return [] if found is None else [found[1], *found[2], found[3]]


class ReshardPass(CustomGraphPass):
    """The joint-graph pass (cache-safe: its uuid is torch_ce's identity)."""

    def __call__(self, graph: fx.Graph) -> None:
        from ..config import config

        if config.reshards_after_forward:
            tag_recompute(graph)

    def uuid(self) -> Any:
        from ..config import config
        from .identity import identity

        return identity(config)
