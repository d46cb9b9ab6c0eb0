"""What torch_ce did, as data: refusals per graph, binds, windows. ``torch_ce.explain()``
turns it into a dataclass and a readable table."""
from __future__ import annotations

import collections
import dataclasses
import threading

_lock = threading.Lock()


@dataclasses.dataclass
class GraphRecord:
    """One compiled graph's decisions (filled by the pass manager)."""

    graph_id: int
    transport: str
    # One dict per weight (not per gather: a forward may gather a weight twice). ``param``:
    # the parameter's name (NOTE [parameter names]); ``name``: the post-grad placeholder;
    # ``gathers``: how many gathers of it the graph holds.
    bound: list = dataclasses.field(default_factory=list)  # + bytes, group, refused_gathers
    refused: list = dataclasses.field(default_factory=list)  # + reason (the first gather's)
    buckets: list = dataclasses.field(default_factory=list)  # dicts: kind, members, bytes
    reorder: dict = dataclasses.field(default_factory=dict)
    prefetch: dict = dataclasses.field(default_factory=dict)  # members, bytes (gathered)

    @property
    def refusal_counts(self) -> dict:
        return dict(collections.Counter(r["reason"] for r in self.refused))


graphs: list[GraphRecord] = []
binds: list = []  # BindResult per run-time bind


def new_graph(transport: str) -> GraphRecord:
    with _lock:
        g = GraphRecord(len(graphs), transport)
        graphs.append(g)
        return g


def record_bind(res) -> None:
    with _lock:
        binds.append(res)


def clear() -> None:
    with _lock:
        graphs.clear()
        binds.clear()
