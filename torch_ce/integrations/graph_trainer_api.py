"""What torch_ce takes from torchtitan's graph_trainer, found once at registration.

The ``"torch_ce"`` pipeline (integrations/torchtitan.py) leans on graph_trainer's private
names: its node annotations (``common_utils._get_module_fqn``, ``_is_backward_node``), its
pass names (``passes._get_pass_name``), the layout of a traced state entry
(``make_fx_tracer.SubclassLayout.meta``), the passes it must run before, and the families
with a ``config_registry``. After a rename each of these would quietly match nothing: no
coalescing, no early launch, or every gather refused as "not a weight", with a log that says
all is well. So ``partner()`` takes graph_trainer's own helpers where they exist and checks
every mirrored name once, raising ``PartnerChanged`` (what is missing, the torchtitan
version) when one is gone; ``require_anchor`` does the same for the pass list of a pipeline.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import pkgutil
from typing import Callable

GT = "torchtitan.experiments.graph_trainer"
# graph_trainer's passes before which torch_ce's pass runs: the first that reassigns or
# buckets the FSDP collectives (after them every weight gather is part of a bucket).
ANCHORS = ("reassign_collective_pgs_pass", "joint_transformer_block_bucketing_reordering_pass")
BUCKETING = "joint_transformer_block_bucketing_reordering_pass"
BUCKET_PLANS = "module_bucket_plans"  # the bucketing pass's keyword: its transformer-block plan
# The fields torch_ce reads of a traced input's layout (joint_facts in torchtitan.py).
_LAYOUT_FIELDS = {"SubclassLayout": ("num_tensors", "meta"), "SubclassMeta": ("cls", "attrs", "inner_metas")}


class PartnerChanged(RuntimeError):
    """graph_trainer no longer has something torch_ce's pipeline relies on."""


def torchtitan_version() -> str:
    try:
        from importlib.metadata import version

        return version("torchtitan")
    except Exception:  # an uninstalled checkout
        return "(unknown version)"


def changed(what: str) -> PartnerChanged:
    return PartnerChanged(
        f"torch_ce: torchtitan {torchtitan_version()}'s graph_trainer {what}; torch_ce's pass pipeline "
        f"was written against torchtitan 0.3.0 and would serve nothing here without saying so. "
        f"Use torchtitan 0.3.0, or --compile.pass_pipeline default (NCCL gathers).")


@dataclasses.dataclass(frozen=True)
class Partner:
    """graph_trainer's helpers, as torch_ce calls them."""

    pass_name: Callable  # a pass (or a functools.partial of one) -> its name
    module_fqn: Callable  # an FX node -> the module FQN graph_trainer annotated it with
    is_backward: Callable  # an FX node -> whether it belongs to the backward


def _attr(module: str, name: str):
    try:
        mod = importlib.import_module(f"{GT}.{module}")
    except ImportError as e:
        raise changed(f"has no module {module} ({e})") from e
    if not hasattr(mod, name):
        raise changed(f"has no {module}.{name}")
    return getattr(mod, name)


@functools.cache
def partner() -> Partner:
    """graph_trainer's helpers, every mirrored name checked (module docstring)."""
    for cls_name, fields in _LAYOUT_FIELDS.items():
        cls = _attr("make_fx_tracer", cls_name)
        have = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        missing = [f for f in fields if f not in have]
        if missing:
            raise changed(f"has no field(s) {missing} in make_fx_tracer.{cls_name} (torch_ce reads which "
                          f"traced inputs are DTensor parameter shards from it)")
    return Partner(pass_name=_attr("passes", "_get_pass_name"),
                   module_fqn=_attr("common_utils", "_get_module_fqn"),
                   is_backward=_attr("common_utils", "_is_backward_node"))


def require_anchor(names: list[str]) -> int:
    """Where torch_ce's pass goes in a pass list (before the first of ``ANCHORS``); raises
    ``PartnerChanged`` when none is there (after graph_trainer's bucketing every weight
    gather is a bucket member torch_ce cannot serve)."""
    at = next((i for i, n in enumerate(names) if n in ANCHORS), None)
    if at is None:
        raise changed(f"pass list has none of {list(ANCHORS)} (torch_ce's pass must run before its FSDP "
                      f"collectives are bucketed; the list: {names})")
    return at


def families() -> tuple[str, ...]:
    """Every graph_trainer family with a ``config_registry`` (llama3, qwen3, deepseek_v3,
    muse_glimmer, ... in torchtitan 0.3.0), longest first (``deepseek_v3`` before a
    ``deepseek``)."""
    pkg = importlib.import_module(GT)
    found = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.ispkg:
            continue
        try:
            spec = importlib.util.find_spec(f"{GT}.{info.name}.config_registry")
        except ImportError:
            spec = None
        if spec is not None:
            found.append(info.name)
    return tuple(sorted(found, key=lambda f: (-len(f), f)))
