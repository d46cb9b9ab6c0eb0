"""torchtitan's SimpleFSDP parametrization, gathering outside compiled graphs through
torch_ce (NOTE [eager gathers] in runtime/eager.py).

SimpleFSDP gathers a weight where its module reads it: a property calls
``ReplicateComputation.forward`` -> ``replicate_compute(x)`` ->
``x.redistribute(Replicate(), forward_dtype=param_dtype, backward_dtype=reduce_dtype)
.to_local(grad_placements=[Partial()])``. SimpleFSDP offers no hook there, so while
torch_ce is enabled ``replicate_compute`` is wrapped [HACK: a class attribute of
torchtitan's, replaced by ``install`` and restored by ``uninstall``; torchtitan 0.3.0's
signature, checked at install]. The wrapper is inert whenever the call is traced (Dynamo,
make_fx, fake or functional tensors: ``eager.tracing``), so compiled graphs are exactly as
without it; run eagerly, it hands a plain FSDP weight (``full_dtensor=False``, no TP/EP
dims) to ``eager.gather_param`` and falls back on the original when that returns None.
"""
from __future__ import annotations

import inspect
import sys

import torch

MODULE = "torchtitan.experiments.graph_trainer.simple_fsdp"

_orig = None


def _wrap(orig):
    def replicate_compute(self, x):
        if torch.compiler.is_compiling():
            return orig(self, x)
        from ..runtime import eager

        if (not getattr(self, "full_dtensor", False) and x._spec.mesh.ndim == self.device_mesh.ndim
                and not eager.tracing(x)):
            out = eager.gather_param(x, self.param_dtype, self.reduce_dtype)
            if out is not None:
                return out
        return orig(self, x)

    replicate_compute.__wrapped__ = orig
    replicate_compute.torch_ce_eager = True
    return replicate_compute


def install() -> bool:
    """Wrap SimpleFSDP's ``replicate_compute`` if its module is imported (idempotent);
    whether it is wrapped."""
    global _orig
    mod = sys.modules.get(MODULE)
    cls = getattr(mod, "ReplicateComputation", None) if mod is not None else None
    if cls is None:
        return False
    fn = cls.__dict__.get("replicate_compute")
    if getattr(fn, "torch_ce_eager", False):
        return True
    if fn is None or list(inspect.signature(fn).parameters) != ["self", "x"]:
        return False  # another SimpleFSDP: its eager gathers stay as they are
    _orig = fn
    cls.replicate_compute = _wrap(fn)
    return True


def uninstall() -> None:
    global _orig
    mod = sys.modules.get(MODULE)
    cls = getattr(mod, "ReplicateComputation", None) if mod is not None else None
    if cls is not None and _orig is not None and getattr(cls.__dict__.get("replicate_compute"),
                                                         "torch_ce_eager", False):
        cls.replicate_compute = _orig
    _orig = None
