"""The code half of torch_ce's compile-cache identity.

Inductor's FX graph cache keys a compiled graph on, among others, our post-grad pass's
``uuid()`` (manager.TorchCEPass) and the pickled entries of
``reorder_for_compute_comm_overlap_passes`` (reorder.LatestSafeLaunch). Both must change
whenever our code could compile a different graph or schedule, or a warm cache serves
code the current torch_ce would not produce. Both combine ``code_identity()`` (the source of
every module in ``MODULES``), ``config.cache_key()`` and ``rank_view()``.

# NOTE [a cache shared by ranks]
One Inductor cache dir is shared by every rank of a host by default. The cache that serves
compiled code across ranks is AOTAutograd's (torch 2.13): it keys on the Dynamo graph,
the inputs (a DTensor by its *global* spec: mesh, placements, global shape) and
Inductor's config, where our ``uuid()`` and pickled reorder sit. (Torch 2.11's AOTAutograd
cache takes no DTensor graph: its Dynamo records ``redistribute`` as a call of a local
closure, ``prim_redistribute``, which that cache refuses, "Unsupported call_function
target". There the FX graph cache serves the warm run, keyed on the AOT output graph: no
rank gets another's code, and this identity changes nothing.) Two things that change
the compiled code per rank are in none of these: the process-group names the gathers name
(on a 2-D mesh, each host's shard group has another name) and the local shard shapes
(uneven Shard(0)). A warm cache then served one rank another's code ("Could not resolve
the process group registered under the name 4"; ``assert_size_stride`` on a short shard).
(The FX graph cache keys on the AOT output graph, which names groups and shapes, but on
2.13 it never hits for DTensor graphs: the device-mesh input hashes by address.)

``rank_view()`` adds exactly those facts, per graph: while a graph is compiled Dynamo's
``TracingContext.tensor_to_context`` holds the live input tensors of the frame (torch's
note [Tensor Fakification and Symbol Caching]); for every DTensor among them, the name and
ranks of each mesh dim's group it is not replicated over, and its local shape. Ranks whose
graphs name the same groups with the same shards get the same key and share entries
(1-D fully_shard: all ranks; HSDP: the ranks of one shard group if every shard is even);
the others get their own. Outside a compile (no tracing context, or no input recorded)
the view is this process's rank and groups: never shared, always safe.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect

# Every module whose source can change the graph our post-grad pass emits, or the order
# our reorder picks, for the same inputs and config. Rule: a module belongs here if an
# edit to it could change generated code or its schedule; every module of torch_ce/passes
# belongs here (test_cache_identity checks that, so a new pass cannot be forgotten).
MODULES = (
    "torch_ce.passes.bucket",
    "torch_ce.passes.census",
    "torch_ce.passes.cost",
    "torch_ce.passes.fx_utils",
    "torch_ce.passes.gate",
    "torch_ce.passes.identity",
    "torch_ce.passes.install",
    "torch_ce.passes.joint",
    "torch_ce.passes.manager",
    "torch_ce.passes.param_names",
    "torch_ce.passes.plan",
    "torch_ce.passes.prefetch",
    "torch_ce.passes.reduce_scatter",
    "torch_ce.passes.reorder",
    "torch_ce.passes.rewrite",
    "torch_ce.passes.reshard",
    "torch_ce.passes.rows",
    "torch_ce.inductor_lowering",  # which ops lower how; which nodes count as transfers
    "torch_ce.ops",  # op schemas (mutation, aliasing) shape what Inductor emits
    "torch_ce.fake_impls",  # output shapes and dtypes
    "torch_ce.runtime.eligibility",  # the gate's shard predicate
    "torch_ce.runtime.cost_model",  # the default cost curves the reorder places launches by
    "torch_ce.config",  # defaults, cache_key(), derived byte sizes
)


@functools.cache
def code_identity() -> str:
    """sha256 of torch_ce's version and the source of every module in ``MODULES`` (once per
    process: the source of an imported module does not change under it)."""
    from .. import __version__

    h = hashlib.sha256(__version__.encode())
    for name in MODULES:
        h.update(name.encode())
        h.update(inspect.getsource(importlib.import_module(name)).encode())
    return h.hexdigest()


def identity(config) -> str:
    """The cache identity of torch_ce's compile side under ``config``: its code, every
    config value that changes what it emits, and what of this rank can change the graph
    being compiled (NOTE [a cache shared by ranks])."""
    from ..runtime import cost_model

    # NOTE [the compiler reads a snapshot] in runtime/cost_model.py: which curves, not their values.
    text = code_identity() + repr(config.cache_key()) + rank_view() + cost_model.current().identity()
    return hashlib.sha256(text.encode()).hexdigest()


def rank_view() -> str:
    """The per-rank facts of the graph being compiled (NOTE [a cache shared by ranks]):
    "" when it has no DTensor input (its key already says everything), else a digest."""
    inputs = _traced_inputs()
    if not inputs:
        return _process_view()
    from torch.distributed.tensor import DTensor

    facts = set()
    for t in inputs:
        if isinstance(t, DTensor):
            facts.add(dtensor_facts(t))
    return hashlib.sha256(repr(sorted(facts)).encode()).hexdigest() if facts else ""


def _traced_inputs() -> list:
    import torch

    tc = torch._guards.TracingContext.try_get()
    return list(getattr(tc, "tensor_to_context", {}).keys()) if tc is not None else []


def note_mesh_dims() -> None:
    """Note the mesh dim of each DTensor input of the graph being compiled for
    ``explain()`` (what ``dtensor_facts`` notes). The pass asks it itself: torch 2.15 asks
    a pass's ``uuid()`` only when a graph cache is on."""
    from torch.distributed.tensor import DTensor

    for t in _traced_inputs():
        if isinstance(t, DTensor):
            dtensor_facts(t)


def dtensor_facts(t) -> tuple:
    """What of a DTensor differs per rank and shapes the compiled code: its local shape,
    and per mesh dim it is not replicated over (size > 1), the name and ranks of that dim's
    group on this rank. Notes each such group's mesh dim for ``explain()``."""
    import torch.distributed as dist

    from .. import report

    mesh, placements = t.device_mesh, tuple(t.placements)
    groups = []
    for d, p in enumerate(placements):
        if mesh.size(d) > 1 and not p.is_replicate():
            g = mesh.get_group(d)
            groups.append((d, g.group_name, tuple(dist.get_process_group_ranks(g))))
            report.note_mesh_dim(g.group_name, mesh, d)
    return (tuple(t.shape), repr(placements), tuple(t._local_tensor.shape), tuple(groups))


def _process_view() -> str:
    """No graph to look at: this rank and its live groups (conservative: never shared
    between two ranks of one job)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return ""
    from torch.distributed import distributed_c10d as c10d

    me = dist.get_rank()
    groups = []
    for pg, name in list(getattr(c10d._world, "pg_names", {}).items()):
        try:
            ranks = tuple(dist.get_process_group_ranks(pg))
        except Exception:  # noqa: BLE001 (a group being torn down: leave it out)
            continue
        if me in ranks:
            groups.append((name, ranks))
    return hashlib.sha256(repr((me, sorted(groups))).encode()).hexdigest()
