"""The code half of torch_ce's compile-cache identity.

Inductor's FX graph cache keys a compiled graph on, among others, our post-grad pass's
``uuid()`` (manager.TorchCEPass) and the pickled entries of
``reorder_for_compute_comm_overlap_passes`` (reorder.LatestSafeLaunch). Both must change
whenever our code could compile a different graph or schedule, or a warm cache serves
code the current torch_ce would not produce. Both combine ``code_identity()`` (the source of
every module in ``MODULES``) with ``config.cache_key()``.
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
    "torch_ce.passes.cost",
    "torch_ce.passes.fx_utils",
    "torch_ce.passes.gate",
    "torch_ce.passes.identity",
    "torch_ce.passes.manager",
    "torch_ce.passes.param_names",
    "torch_ce.passes.plan",
    "torch_ce.passes.prefetch",
    "torch_ce.passes.reorder",
    "torch_ce.passes.rewrite",
    "torch_ce.inductor_lowering",  # which ops lower how; which nodes count as transfers
    "torch_ce.ops",  # op schemas (mutation, aliasing) shape what Inductor emits
    "torch_ce.fake_impls",  # output shapes and dtypes
    "torch_ce.runtime.eligibility",  # the gate's shard predicate
    "torch_ce.runtime.calibration",  # the default cost curves the reorder places launches by
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
    """The cache identity of torch_ce's compile side under ``config``: its code and every
    config value that changes what it emits."""
    return hashlib.sha256((code_identity() + repr(config.cache_key())).encode()).hexdigest()
