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
    # + bytes, group, refused_gathers, rows (a weight embedding lookups read: its row
    # gather's account, or why it is gathered in full; None otherwise; passes/rows.py)
    bound: list = dataclasses.field(default_factory=list)
    refused: list = dataclasses.field(default_factory=list)  # + reason (the first gather's)
    buckets: list = dataclasses.field(default_factory=list)  # dicts: kind, members, bytes
    reorder: dict = dataclasses.field(default_factory=dict)
    prefetch: dict = dataclasses.field(default_factory=dict)  # members, bytes (gathered)

    @property
    def refusal_counts(self) -> dict:
        return dict(collections.Counter(r["reason"] for r in self.refused))


graphs: list[GraphRecord] = []
binds: list = []  # BindResult per run-time bind
# Process-group name -> the mesh dim(s) it gathers over, e.g. "'dp_shard' (dim 1 of mesh
# (2, 2))". Noted wherever torch_ce sees a DTensor with its mesh: the cache identity of
# every graph compiled (also one then served from a cache) and ``bind()`` on DTensors.
# One group can be a dim of several meshes (a dim spanning the world is the world group):
# then every such dim is listed, joined by " / ".
mesh_dims: dict = {}


def note_mesh_dim(group_name: str, mesh, dim: int) -> None:
    names = getattr(mesh, "mesh_dim_names", None)
    label = (f"{names[dim]!r} (dim {dim} of mesh {tuple(mesh.shape)})" if names
             else f"dim {dim} (of mesh {tuple(mesh.shape)})")
    with _lock:
        old = mesh_dims.get(group_name, "")
        if label not in old.split(" / "):
            mesh_dims[group_name] = f"{old} / {label}" if old else label


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
