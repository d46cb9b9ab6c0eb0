"""torch_ce's graph_trainer pipelines registered whichever comes first: ``torch_ce.enable()``
or graph_trainer's import.

``enable()`` registers them (integrations/torchtitan.py) at once when graph_trainer's
registry is already imported. Otherwise it puts a finder on ``sys.meta_path`` that, the
moment the registry module has run, fills its registries with trampolines: the registry is
imported from inside graph_trainer's own half-imported modules (its memory policy, its
passes), where importing the rest of graph_trainer, as the integration module does, would
find them half-built. A trampoline imports the integration module when graph_trainer first
calls it (the post-init hook at trainer construction, a pipeline at the first step), which
registers the real functions in the trampolines' place.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

REGISTRY = "torchtitan.experiments.graph_trainer.registry"


def _trampoline(attr: str):
    def call(*args, **kwargs):
        from . import torchtitan as tt

        return getattr(tt, attr)(*args, **kwargs)

    call.__name__ = call.__qualname__ = attr
    call.torch_ce_trampoline = True
    return call


# (registry dict, key) -> what stands in for integrations/torchtitan.py's function until then.
TRAMPOLINES = {
    ("PASS_PIPELINE_REGISTRY", "torch_ce"): _trampoline("torch_ce_graph_passes"),
    ("POST_INIT_HOOKS", "torch_ce"): _trampoline("post_init"),
    ("PASS_PIPELINE_REGISTRY", "default"): _trampoline("default_graph_passes"),
}


def is_trampoline(fn) -> bool:
    return bool(getattr(fn, "torch_ce_trampoline", False))


def _fill(registry) -> None:
    for (table, key), fn in TRAMPOLINES.items():
        getattr(registry, table).setdefault(key, fn)


class _Loader(importlib.abc.Loader):
    """The registry's own loader, then the trampolines."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _fill(module)

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != REGISTRY:
            return None
        sys.meta_path.remove(self)  # once: the real spec comes from the other finders
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def register_when_imported() -> None:
    """Register now if graph_trainer's registry is imported, else when it is (module
    docstring); idempotent."""
    if REGISTRY in sys.modules:
        from . import torchtitan  # noqa: F401  (registers)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
