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
all_gather_into_tensor -> wait_tensor) is tagged ``MUST_RECOMPUTE``, so the partitioner
saves the shard (a parameter: free) and the backward graph recomputes the chain right
before its first use (``reordering_to_mimic_autograd_engine``).

Values do not change (a gather is exact, a cast is deterministic), only what is alive
when. It is installed with either transport when ``config.reshards_after_forward`` (on by
default with "copy_engine" and training), so an NCCL baseline can run the same schedule.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import fx_utils as U

_CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def weight_chain(gather: fx.Node) -> list[fx.Node] | None:
    """(casts..., gather, wait) of a gather whose input is a graph input, possibly cast;
    None for anything else (an activation, a gather of a gather)."""
    chain, x = [gather], gather.args[0]
    from .gate import _end_pad

    if _end_pad(x) is not None:
        # An uneven Shard(0) short rank's pad: part of its chain, so that it recomputes the
        # same gathers as the ranks without one (NOTE [uneven Shard(0): padded slots]).
        chain.insert(0, x)
        x = x.args[0]
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in _CASTS:
        if len(x.users) != 1:
            return None
        chain.insert(0, x)
        x = x.args[0]
    if not (isinstance(x, fx.Node) and x.op == "placeholder" and x.name.startswith("primals")):
        return None
    wait = U.wait_of(gather)
    if wait is None:
        return None
    return chain + [wait]


def tag_recompute(graph: fx.Graph) -> int:
    """Tag every weight gather chain of a joint graph MUST_RECOMPUTE; returns how many."""
    from torch.utils.checkpoint import CheckpointPolicy

    n = 0
    for g in U.find_op_nodes(graph, U.ALL_GATHER):
        chain = weight_chain(g)
        if chain is None:
            continue
        for node in chain:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        n += 1
    return n


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
