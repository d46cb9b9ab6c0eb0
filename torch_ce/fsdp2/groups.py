"""The FSDP2 param groups of a model, and whether torch_ce can serve each one's all-gather.

FSDP2 (``fully_shard``) gathers each param group eagerly, one flat all-gather per call:
every rank's chunk is the concatenation of its parameters' padded shards (cast to
``param_dtype``), the same number of elements on every rank, and the output holds the W
chunks in rank order. What torch_ce reads is that chunk, byte for byte, so the shapes,
shard dims and uneven shards of the parameters inside it do not matter; what does is
whether the chunk is exactly ``_sharded_param_data`` (cast), which these checks decide.
Each refusal is a sentence for ``explain()`` and the log; the group keeps FSDP2's own
all-gather.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ..config import config
from ..runtime import native
from ..runtime.eligibility import shard_refusal
from .report import Counts


@dataclasses.dataclass(eq=False)
class Group:
    """One FSDP param group: what it gathers, and how torch_ce serves it.

    ``module``: the FSDPModule whose state owns it; ``param_group``: FSDP2's
    ``FSDPParamGroup``; ``process_group``: the group its all-gather runs over (the shard
    dim of the mesh under HSDP). ``numel`` / ``dtype``: one rank's chunk (uint8 bytes when
    its parameters gather in several dtypes, as FSDP2 does). ``mode``: "static" (weights
    bound once, read with no signal), "staged" (training: a staging buffer refreshed every
    call, NOTE [FSDP2 training: step words] in fsdp2/signals.py), or "" when refused."""

    name: str
    module: Any
    param_group: Any
    process_group: Any = None
    numel: int = 0
    dtype: torch.dtype | None = None
    cast: bool = False  # param_dtype differs from the weights': the slot holds the cast chunk
    mode: str = ""
    reason: str = ""  # why FSDP2 keeps its own all-gather ("" when served)
    rs_reason: str = ""  # why the reduce-scatter stays FSDP2's, when it was asked for
    comm: Any = None  # the installed all-gather (fsdp2/comm.py)
    saved_comm: Any = None  # FSDP2's all-gather before enable(), put back by disable()
    saved_rs_comm: Any = None
    # What its calls moved since enable() (NOTE [FSDP2 bytes as run] in fsdp2/report.py):
    # FSDP2's own all-gathers and reduce-scatters, counted; the copy-engine
    # reduce-scatter's accounting when enable() installed it.
    ag_counts: Counts = dataclasses.field(default_factory=Counts)
    rs_counts: Counts = dataclasses.field(default_factory=Counts)
    rs_base: tuple | None = None

    @property
    def fsdp_params(self) -> list:
        return list(self.param_group.fsdp_params) if self.param_group is not None else []

    def detached(self) -> "Group":
        """A copy holding no FSDP2 object (a disabled model's entry must not keep the model
        alive: NOTE [what an enabled model holds] in fsdp2/__init__.py)."""
        return dataclasses.replace(self, module=None, param_group=None, comm=None,
                                   saved_comm=None, saved_rs_comm=None)

    @property
    def world(self) -> int:
        return self.process_group.size() if self.process_group is not None else 1

    @property
    def chunk_bytes(self) -> int:
        return self.numel * self.dtype.itemsize if self.dtype is not None else 0

    @property
    def gathered_bytes(self) -> int:
        """What one all-gather of the group writes (NOTE [coverage bytes] in report.py)."""
        return self.chunk_bytes * self.world


def fsdp_states(model: torch.nn.Module) -> list[tuple[str, Any, Any]]:
    """(module name, FSDPModule, its FSDP state) of every ``fully_shard``ed module of
    ``model``, once each, in ``named_modules`` order (the same on every rank)."""
    from torch.distributed.fsdp import FSDPModule

    out, seen = [], set()
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            if id(state) not in seen:
                seen.add(id(state))
                out.append((name or "<root>", m, state))
    return out


def param_groups(state) -> list:
    """The state's FSDP param groups (``_fsdp_param_groups`` on torch >= 2.12, a single
    ``_fsdp_param_group`` before)."""
    many = getattr(state, "_fsdp_param_groups", None)
    if many is not None:
        return list(many)
    one = getattr(state, "_fsdp_param_group", None)
    return [one] if one is not None else []


def top_level(model: torch.nn.Module) -> list:
    """The FSDP modules of ``model`` inside no other one (FSDP2's roots)."""
    mods = [m for _, m, _ in fsdp_states(model)]
    inner = {id(sub) for m in mods for sub in m.modules() if sub is not m}
    return [m for m in mods if id(m) not in inner]


def lazy_init(model: torch.nn.Module) -> None:
    """FSDP2's lazy init of every root, as the first forward would run it (streams, padded
    shards re-checked, mixed-precision dtypes), so the chunks are final before they are
    bound. Idempotent."""
    for m in top_level(model):
        m._get_fsdp_state()._lazy_init()


def _chunk_dtype(fsdp_params) -> tuple[torch.dtype | None, bool, str]:
    """(what the chunk holds, whether it is a cast of the weights, a refusal or "")."""
    dtypes = {fp.param_dtype or fp.orig_dtype for fp in fsdp_params}
    if len(dtypes) != 1:
        names = sorted(str(d).removeprefix("torch.") for d in dtypes)
        return None, False, (f"parameters gather in several dtypes ({', '.join(names)}): FSDP2 "
                             "gathers them as bytes, which torch_ce does not bind")
    cast = any(fp.param_dtype is not None for fp in fsdp_params)
    if cast and len({fp.orig_dtype for fp in fsdp_params}) != 1:
        return None, False, "the weights of the group have several dtypes under one param_dtype"
    return dtypes.pop(), cast, ""


def judge(name: str, module, state, pg, weights: str) -> Group:
    """One param group's verdict (``Group.reason`` empty: served), identical on every rank
    but for the local facts the bind's agreement then compares."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    g = Group(name, module, pg)
    fps = g.fsdp_params

    def refuse(why: str) -> Group:
        g.reason = why
        return g

    try:
        g.process_group = pg._all_gather_process_group
    except Exception as e:  # noqa: BLE001 (DDP-style mesh: no shard group)
        return refuse(f"no shard process group ({type(e).__name__}: {e})")
    if not fps:
        return refuse("no parameters")
    if isinstance(getattr(pg, "offload_policy", None), CPUOffloadPolicy) or any(fp.offload_to_cpu for fp in fps):
        return refuse("CPU offload (CPUOffloadPolicy): the shards live in host memory and are "
                      "copied to the device per gather")
    ext = [fp for fp in fps if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather")]
    if ext:
        return refuse(f"all-gather tensor subclass ({type(ext[0]._sharded_local_tensor).__name__} "
                      "with fsdp_pre_all_gather, e.g. float8): its gather inputs are made per call")
    if getattr(pg, "_use_post_forward_mesh", False):
        return refuse("integer reshard_after_forward (a post-forward mesh): the backward gathers "
                      "over another group")
    if type(pg._all_gather_comm) is not DefaultAllGather:
        return refuse(f"a custom all-gather is set already ({type(pg._all_gather_comm).__name__})")
    dtype, cast, why = _chunk_dtype(fps)
    if why:
        return refuse(why)
    g.dtype, g.cast = dtype, cast
    g.numel = sum(fp._sharded_param_data.numel() for fp in fps)
    world = g.process_group.size()
    device = fps[0]._sharded_param_data.device
    why = shard_refusal(device_type=device.type, nbytes=g.chunk_bytes, numel=g.numel, dim=1,
                        contiguous=all(fp._sharded_param_data.is_contiguous() for fp in fps),
                        group_size=world, cfg=config, kernel_refusal=native.kernel_refusal)
    if why is not None:
        return refuse(str(why))
    if dist.get_backend(g.process_group) == "fake":
        return refuse("fake process group: no peers to read from")
    training = weights == "training" or (weights == "auto" and any(fp.sharded_param.requires_grad for fp in fps))
    if training:
        from .signals import unavailable

        why = unavailable(device)
        if why:
            return refuse(why)
        g.mode = "staged"
    else:
        g.mode = "static"
    return g


def find(model: torch.nn.Module, weights: str) -> list[Group]:
    """Every FSDP param group of ``model``, judged (module docstring)."""
    out = []
    for name, module, state in fsdp_states(model):
        pgs = param_groups(state)
        for i, pg in enumerate(pgs):
            label = name if len(pgs) == 1 else f"{name}[{i}]"
            out.append(judge(label, module, state, pg, weights))
    return out
