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


def find_op_nodes(graph: fx.Graph, target) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def wait_of(gather: fx.Node) -> fx.Node | None:
    """The wait_tensor that consumes a single-tensor gather (None if there is none)."""
    waits = [u for u in gather.users if is_wait(u)]
    return waits[0] if len(waits) == 1 and len(gather.users) == 1 else None


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
