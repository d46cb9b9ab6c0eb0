"""One-line FX helpers shared by the passes."""
from __future__ import annotations

import torch
import torch.fx as fx

c10d = torch.ops._c10d_functional
magi = torch.ops.magi

ALL_GATHER = c10d.all_gather_into_tensor.default
WAIT = c10d.wait_tensor.default


def is_all_gather(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is ALL_GATHER


def is_wait(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is WAIT


def is_ce_gather(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in (
        magi.ce_all_gather.default,
        magi.ce_all_gather_coalesced.default,
    )


def ce_launch_group(n: fx.Node) -> str | None:
    """The group name of a CE gather launch of any form (plain, coalesced, over a dim,
    padded), else None: every one of them takes from, or drops, its group's prefetched set."""
    if n.op != "call_function":
        return None
    if n.target in (magi.ce_all_gather.default, magi.ce_all_gather_coalesced.default,
                    magi.ce_all_gather_dim.default):
        return n.args[2]
    if n.target is magi.ce_all_gather_padded.default:
        return n.args[3]
    return None


def find_op_nodes(graph: fx.Graph, target) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def wait_of(gather: fx.Node) -> fx.Node | None:
    """The wait_tensor that consumes a single-tensor gather (None if there is none)."""
    waits = [u for u in gather.users if is_wait(u)]
    return waits[0] if len(waits) == 1 and len(gather.users) == 1 else None


# NOTE [one gather, several waits]
# torchtitan's ``Embedding.forward`` reads its parametrized weight twice (NOTE [unread
# gathers] in gate.py). Torch 2.11-2.13 keep two gathers; torch 2.14+ CSE merges them into
# one gather with two ``wait_tensor`` users, the first never read. Every wait of a gather
# is the same value, so they are merged into the first one in program order (it comes
# before every reader of the others): one gather, one wait, as the passes expect. A graph
# fact, the same on every rank.


def merge_waits(graph: fx.Graph) -> int:
    """Merge the wait_tensors of each all_gather_into_tensor whose users are all waits
    (NOTE [one gather, several waits]); returns how many waits went."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    gone = 0
    for g in find_op_nodes(graph, ALL_GATHER):
        waits = [u for u in g.users if is_wait(u)]
        if len(waits) < 2 or len(waits) != len(g.users):
            continue
        keep = min(waits, key=pos.__getitem__)
        for w in waits:
            if w is not keep:
                w.replace_all_uses_with(keep)
                graph.erase_node(w)
                gone += 1
    return gone


def nbytes(val) -> int | None:
    """Static byte size of a FakeTensor meta value (None when dynamic)."""
    try:
        return int(val.numel()) * val.element_size()
    except Exception:
        return None


def numel(val) -> int | None:
    """Static element count of a FakeTensor meta value (None when dynamic)."""
    try:
        return int(val.numel())
    except Exception:
        return None


def erase_unread_chain(graph: fx.Graph, node) -> None:
    """Erase ``node`` and then its producers while nothing reads them (a pad, a cast)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and not node.users:
        up = node.args[0] if node.args else None
        graph.erase_node(node)
        node = up


def last_placeholder(graph: fx.Graph) -> fx.Node | None:
    last = None
    for n in graph.nodes:
        if n.op == "placeholder":
            last = n
    return last
