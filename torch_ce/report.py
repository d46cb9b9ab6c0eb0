"""What torch_ce did, as data: refusals per graph, binds, windows. ``torch_ce.explain()``
turns it into a dataclass and a readable table."""
from __future__ import annotations

import collections
import dataclasses
import threading

_lock = threading.Lock()


class _Readable:
    """Dict-style reads (``rec["reason"]``, ``rec.get("rows")``) of a typed record, for
    code written against the dicts these records were."""

    def __getitem__(self, key: str):
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default=None):
        return getattr(self, key, default)


@dataclasses.dataclass
class WeightRecord(_Readable):
    """One weight of one graph (not one gather: a forward may gather a weight twice).
    ``param``: the parameter's name (NOTE [parameter names]); ``name``: the post-grad
    placeholder; ``gathers``: how many gathers of it the graph holds.

    NOTE [coverage bytes]
    ``gathered_bytes`` is what this weight's gathers move per call
    of the graph, counted as the bytes a gather call writes to its output (local shard x
    group size: the padded size of an uneven Shard(0)), summed over its gathers; a weight
    read by row gathers counts the looked-up rows x row bytes instead (the most the row
    gather reads; its full size when an ids shape is dynamic). ``ce_gathered_bytes``: the
    part the gate put on the copy engines; the rest stayed on the collective, by reason
    (``collective_bytes``). Whether a planned weight really is on the copy engines is the
    run time's (a bind may still refuse it): explain() completes it."""

    name: str
    param: str
    gathers: int = 1
    gathered_bytes: int = 0
    ce_gathered_bytes: int = 0
    collective_bytes: dict = dataclasses.field(default_factory=dict)  # reason -> bytes


@dataclasses.dataclass
class BoundWeight(WeightRecord):
    """A weight with at least one gather retargeted to the copy engines."""

    bytes: int = 0  # the local shard's bytes (what its window slot holds)
    group: str = ""
    refused_gathers: list = dataclasses.field(default_factory=list)  # reasons of the others
    # A weight embedding lookups read: its row gather's account, or why it is gathered in
    # full (passes/rows.py); None otherwise.
    rows: dict | None = None
    staged: str | None = None  # a training graph's staging slot dtype; None: in place
    # An inference graph's cast slot dtype (NOTE [cast slots] in runtime/staging.py).
    cast_slot: str | None = None
    # An uneven Shard(0): the rows of every rank's padded slot (NOTE [uneven Shard(0):
    # padded slots] in runtime/windows.py); None: even.
    padded_rows: int | None = None


@dataclasses.dataclass
class RefusedWeight(WeightRecord):
    """A weight whose every gather stays on the collective backend."""

    reason: str = ""  # the first gather's
    code: int = 0  # its eligibility.Reason


@dataclasses.dataclass
class GraphRecord:
    """One compiled graph's decisions (filled by the pass manager)."""

    graph_id: int
    transport: str
    bound: list = dataclasses.field(default_factory=list)  # BoundWeight
    refused: list = dataclasses.field(default_factory=list)  # RefusedWeight
    buckets: list = dataclasses.field(default_factory=list)  # dicts: kind, members, bytes
    reorder: dict = dataclasses.field(default_factory=dict)
    prefetch: dict = dataclasses.field(default_factory=dict)  # members, bytes (gathered)
    # One dict per gradient reduce-scatter: name, bytes (input, per call), kind ("ce" or
    # "collective"), reason, group (passes/reduce_scatter.py).
    reduce_scatters: list = dataclasses.field(default_factory=list)
    # The key its bind or stage step counts its calls under at run time (``step_key``;
    # NOTE [calls, not graphs]); None: the graph has no step (its calls are not counted).
    step_key: tuple | None = None

    @property
    def refusal_counts(self) -> dict:
        return dict(collections.Counter(r.reason for r in self.refused))


graphs: list[GraphRecord] = []
binds: list = []  # BindResult per run-time bind
# Process-group name -> the mesh dim(s) it gathers over, e.g. "'dp_shard' (dim 1 of mesh
# (2, 2))". Noted wherever torch_ce sees a DTensor with its mesh: the cache identity of
# every graph compiled (also one then served from a cache) and ``bind()`` on DTensors.
# One group can be a dim of several meshes (a dim spanning the world is the world group):
# then every such dim is listed, joined by " / ".
mesh_dims: dict = {}


# NOTE [calls, not graphs]
# A graph's record says what one call of it gathers; the run time says how often each ran.
# Every compiled graph torch_ce rewrites starts with one bind step (``magi::ce_bind``) or
# stage step (``magi::ce_stage``) that runs at each of its calls: the step counts the call
# under ``step_key`` (its kind, weight names, shard elements and flags: what the graph
# carries, so the record knows its key at compile time), one dict increment, no sync. A
# gather outside any compiled graph (SimpleFSDP's parametrization run eagerly: a graph
# break, a checkpointed region re-run in backward, an eager evaluation) is counted by the
# eager path itself (runtime/eager.py), per weight, path and reason. ``explain()``
# multiplies each record's bytes per call by its calls and adds the eager bytes; a graph
# with no step (transport="nccl", or only bucketed gathers) counts once. Several records
# of one key (a recompile of the same weights; the same names and sizes, so the same
# bytes per call) share its calls: the latest takes them.
# ``reset_counts()`` starts a new window (a step), so a user reads one step's share.
calls: collections.Counter = collections.Counter()
# (weight name, "ce" | "collective", reason, where) -> [gathers, bytes]: gathers outside
# compiled graphs. ``where``: "backward" (re-run in backward: activation checkpointing),
# "graph break" (an eager stretch of a frame Dynamo compiles), "eager" (Dynamo off:
# outside torch.compile, or a region it skips, such as torch.utils.checkpoint).
eager: dict = {}
# Modules compiled graphs were traced from (weak), so an eager gather names its weight
# as ``named_parameters()`` does (NOTE [parameter names] in passes/param_names.py).
import weakref as _weakref  # noqa: E402

roots: "_weakref.WeakSet" = _weakref.WeakSet()


def step_key(kind: str, names, numel, *flags) -> tuple:
    """The run-time key of a graph's bind (``kind="bind"``) or stage step (``"stage"``,
    flags: dtypes, refresh, static), as the compile side and the run time both form it.
    ``numel``: the shards' elements in all (names are relative to the compiled frame's
    module, so two graphs of resumed frames may both list one ``weight``)."""
    return (kind, tuple(names), numel) + tuple(flags)


def count_call(key: tuple) -> None:
    calls[key] += 1


def count_eager(name: str, path: str, reason: str, where: str, nbytes: int) -> None:
    k = (name, path, reason, where)
    c = eager.get(k)
    if c is None:
        eager[k] = [1, nbytes]
    else:
        c[0] += 1
        c[1] += nbytes


def reset_counts() -> None:
    """Forget the run-time counts (calls of compiled graphs, eager gathers): what
    ``explain().coverage()`` counts from now on is the next window (a step, say)."""
    with _lock:
        calls.clear()
        eager.clear()


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
        calls.clear()
        eager.clear()
