"""torch_ce settings: one validated object, settable from code and from the environment.

Every value that changes what the graph passes emit is part of torch_ce's cache identity
(``cache_key()``, used by ``passes/identity.py``), so the FX graph cache stays on and stays
correct.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Any, Iterator

# Fields that change what a bind or a calibration does at run time, never the compiled
# graph: left out of the compile-cache key.
RUN_TIME_ONLY = ("cost_cache_dir", "bind_timeout_s", "bind_arrival_timeout_s", "bind_readback",
                 "cuda_torch_fallback", "shm_prefix", "rs_workspace_cap_mib", "rs_timeout_s", "eager_gathers",
                 "rs_native", "rs_host_flags", "fsdp2_timeout_s")
TRANSPORTS = ("nccl", "copy_engine")
REDUCE_SCATTERS = ("collective", "copy_engine")
_SHM_PREFIX = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
COST_MODES = ("calibrated", "default")


@dataclasses.dataclass
class Config:
    # "nccl": graphs untouched (our pass only carries the cache identity; the reorder, if on). "copy_engine": eligible weight gathers become one-sided
    # window reads (CUDA copy engines for CUDA weights, the host transport for CPU weights).
    transport: str = "nccl"
    # Shards smaller than this stay on NCCL (0: every eligible weight is bound).
    symm_min_shard_mib: float = 0.0
    # One symmetric window holds at most this many bytes; a larger shard gets its own.
    window_cap_mib: float = 4096.0
    # Cap on one coalesced gather bucket (0: no cap).
    bucket_size_mib: float = 0.0
    # CPU weights may use POSIX shared-memory windows (the host transport).
    host_transport: bool = True
    # Reorder: a launch needs upstream compute >= cost * scale + margin to be hidden.
    comm_overlap_window_scale: float = 1.5
    comm_overlap_margin_us: float = 5.0
    # A weight gathered only for embedding lookups reads just the looked-up rows
    # (magi::ce_gather_rows, NOTE [row gathers] in passes/rows.py); off: full gathers.
    row_gathers: bool = True
    # Install the latest-safe-launch reorder (either transport); read at each enable().
    reorder: bool = True
    # Gather the graph's leading CE weights (whole buckets, at most this many MiB of gathered
    # output) at the end of each call, for the next call (0: off). The outputs stay
    # allocated between calls; torch_ce.updating_weights drops them (the version net also
    # refuses a parked value of a weight written outside it, where a counter shows it).
    # NOTE [cross-call prefetch] in torch_ce/runtime/prefetch.py.
    prefetch_next_call_mib: float = 0.0
    # "calibrated": time wait(launch()) on the real windows after binding and use that
    # curve; "default": the documented curve from our H200 measurements only.
    cost_mode: str = "calibrated"
    # Where the calibrated cost curves are cached ("" = ~/.cache/torch_ce).
    cost_cache_dir: str = ""
    # The host transport's /dev/shm segments are named <shm_prefix><job>_...: the lowest
    # rank's prefix names every rank's segments (runtime/host.py), so jobs (or test
    # processes) that share /dev/shm can tell theirs apart.
    shm_prefix: str = "torch_ce_"
    # The bind's exchanges (NOTE [bind rounds go through the store] in runtime/agreement.py):
    # how long a rank waits for its peers at each step of a bind, and, at the first step,
    # for peers that may still be compiling. A failure on a peer is seen at once.
    bind_timeout_s: float = 30.0
    bind_arrival_timeout_s: float = 600.0
    # Before a bind's first gather, each rank reads a canary word of every peer's new
    # windows through the gathers' own copy path; a window some rank cannot read back
    # keeps that pool's weights of the bind on the collective, with the reason (NOTE
    # [peer read-back at bind] in runtime/readback.py). One 8-byte read per peer and new
    # window, two store exchanges, once per bind that opens windows.
    bind_readback: bool = True
    # Without the C++ gather kernels, CUDA weights stay on NCCL; True gathers them by
    # per-peer copy_ instead (slower than NCCL: for debugging, not for speed).
    cuda_torch_fallback: bool = False
    # Training graphs (forward and backward) gather on the copy engine too: each weight's
    # cast (param_dtype) lives in a staging slot of a window, refreshed once per forward
    # between two step fences (NOTE [training: staged windows and step fences] in
    # runtime/staging.py). False: graphs that need gradients keep the collective.
    training: bool = True
    # Recompute the weight gathers in the backward instead of saving the gathered weights
    # (FSDP's reshard after forward; passes/reshard.py). None: on with "copy_engine" and
    # training, off with "nccl" (set it True there too for a like-for-like baseline).
    reshard_after_forward: bool | None = None
    # Inference graphs that cast a weight before gathering it (MixedPrecisionPolicy's
    # param_dtype on fp32 weights) gather the cast from a cast slot: the param_dtype copy
    # of the shard, made once at bind and never refreshed (NOTE [cast slots] in
    # runtime/staging.py). It costs that copy's memory (explain(): cast_slot_bytes).
    # False: such gathers stay on the collective ("cast before gather").
    cast_slots: bool = True
    # Gradient reduce-scatters of graphs the copy_engine transport serves: "collective"
    # (the group's backend, as without torch_ce) or "copy_engine": pushes into the peers'
    # receive workspaces, flags, one reduction, no collective and no barrier (NOTE
    # [copy-engine reduce-scatter] in runtime/reduce_scatter/__init__.py), on CUDA (the C++ library's
    # stream flag ops) and on the host transport (x86 hosts). A push carries its call's
    # identity: ranks that run different reduce-scatters get an error naming both calls.
    reduce_scatter: str = "collective"
    # One reduce-scatter workspace (per group and dtype: two halves, a slice per sender)
    # holds at most this many MiB; a bucket whose slices do not fit stays on the collective.
    rs_workspace_cap_mib: float = 1024.0
    # How long a reduce-scatter waits for a peer's push (or for a peer to free a half)
    # before it raises, naming the bucket and the peer (CUDA: the watchdog then releases
    # the stream, the call's outputs are NaN, and the next call raises); also the bound on
    # a workspace round's waits. A failure ends that pool's generation only: the next call
    # opens a new one.
    rs_timeout_s: float = 300.0
    # CUDA reduce-scatters launched and completed by the C++ library, with one fused
    # reduction kernel per call (NOTE [native reduce-scatter path] in csrc/ce_reduce_scatter.cu), where
    # it has them; off: the Python launch and completion (verified exact on an H200 in
    # loopback: the default).
    rs_native: bool = True
    # Where a CUDA reduce-scatter's flags live: device memory (False), or host memory every
    # rank maps (True: /dev/shm, cudaHostRegister'ed), which a host store can always write,
    # so the watchdog releases a dead peer's wait even when every stream shares one
    # hardware queue (NOTE [poison word] in csrc/ce_flags.cu). None (auto): host memory under
    # CUDA_DEVICE_MAX_CONNECTIONS=1, where the native path with its reduction kernel
    # serves; device memory otherwise.
    rs_host_flags: bool | None = None
    # Gathers outside compiled graphs (SimpleFSDP's parametrization run eagerly: a graph
    # break, activation checkpointing's re-run in backward, an eager evaluation) read
    # windows too, with the transport "copy_engine" (NOTE [eager gathers] in
    # runtime/eager.py); False: they stay on the collective (explain() counts them either way).
    eager_gathers: bool = True
    # How long an FSDP2 training gather waits for a peer's step word (its chunk staged, or
    # its reads of this rank's chunk done) before it raises ``StepWordTimeout`` naming the
    # peer (NOTE [FSDP2 training: step words]); ``fsdp2.enable(timeout_s=...)`` overrides it.
    fsdp2_timeout_s: float = 300.0

    def validate(self) -> "Config":
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"torch_ce: transport must be one of {TRANSPORTS}, got {self.transport!r}"
            )
        if self.cost_mode not in COST_MODES:
            raise ValueError(
                f"torch_ce: cost_mode must be one of {COST_MODES}, got {self.cost_mode!r}"
            )
        for name in ("symm_min_shard_mib", "bucket_size_mib", "comm_overlap_margin_us",
                     "prefetch_next_call_mib"):
            if getattr(self, name) < 0:
                raise ValueError(f"torch_ce: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.reduce_scatter not in REDUCE_SCATTERS:
            raise ValueError(f"torch_ce: reduce_scatter must be one of {REDUCE_SCATTERS}, "
                             f"got {self.reduce_scatter!r}")
        for name in ("bind_timeout_s", "bind_arrival_timeout_s", "rs_workspace_cap_mib", "rs_timeout_s",
                     "fsdp2_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"torch_ce: {name} must be > 0, got {getattr(self, name)!r}")
        if self.rs_host_flags not in (None, True, False):
            raise ValueError(f"torch_ce: rs_host_flags must be True, False or None (auto), got {self.rs_host_flags!r}")
        if self.reshard_after_forward not in (None, True, False):
            raise ValueError("torch_ce: reshard_after_forward must be True, False or None (auto), "
                             f"got {self.reshard_after_forward!r}")
        if not _SHM_PREFIX.fullmatch(self.shm_prefix):
            raise ValueError("torch_ce: shm_prefix must be 1-64 letters, digits, '_', '.' or '-' "
                             f"(a file name in /dev/shm), got {self.shm_prefix!r}")
        if self.window_cap_mib <= 0:
            raise ValueError(f"torch_ce: window_cap_mib must be > 0, got {self.window_cap_mib!r}")
        if self.comm_overlap_window_scale <= 0:
            raise ValueError(
                "torch_ce: comm_overlap_window_scale must be > 0, "
                f"got {self.comm_overlap_window_scale!r}"
            )
        return self

    # Byte views used by the planner.
    @property
    def reshards_after_forward(self) -> bool:
        """Whether the joint-graph pass recomputes weight gathers in the backward."""
        if self.reshard_after_forward is None:
            return self.transport == "copy_engine" and self.training
        return self.reshard_after_forward

    @property
    def window_cap_bytes(self) -> int:
        return int(self.window_cap_mib * 2**20)

    @property
    def min_shard_bytes(self) -> int:
        return int(self.symm_min_shard_mib * 2**20)

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_size_mib * 2**20)

    def update(self, **overrides: Any) -> "Config":
        """``torch_ce.config.update(...)``: same as the module-level ``update``."""
        return update(**overrides)

    def patch(self, **overrides: Any):
        """``with torch_ce.config.patch(...)``: temporary overrides (tests)."""
        return patch(**overrides)

    def cache_key(self) -> tuple:
        """The values that change what the passes emit (the run-time-only ones do not)."""
        d = dataclasses.asdict(self)
        for run_time_only in RUN_TIME_ONLY:
            d.pop(run_time_only)
        return tuple(sorted(d.items()))


_ENV_PREFIX = "TORCH_CE_"


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"torch_ce: {name}={raw!r} is not a boolean (use 1/0, true/false)")


def _parse(field: dataclasses.Field, raw: str) -> Any:
    name = _ENV_PREFIX + field.name.upper()
    if field.type in ("bool", bool):
        return _parse_bool(name, raw)
    if field.type == "bool | None":  # "auto" (or "none"): decided from the other fields
        return None if raw.strip().lower() in ("auto", "none") else _parse_bool(name, raw)
    if field.type in ("float", float):
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"torch_ce: {name}={raw!r} is not a number") from None
    return raw.strip()


# TORCH_CE_* variables that are not config fields but are torch_ce's (the build's and the
# run time's switches). The test suite's switches are its own (test/testenv.py).
_OTHER_ENV = {"SKIP_CUDA_BUILD", "CUDA_ARCH", "CUDA_INCLUDE", "NATIVE",
              "PEER_ORDER", "PEER_CHUNK_MIB"}


def from_env(environ: dict | None = None) -> Config:
    """A Config with every ``TORCH_CE_<FIELD>`` variable applied, validated. A misspelled
    ``TORCH_CE_*`` variable is reported (a warning), not silently ignored."""
    environ = os.environ if environ is None else environ
    fields = {f.name.upper() for f in dataclasses.fields(Config)}
    unknown = sorted(k for k in environ if k.startswith(_ENV_PREFIX)
                     and k[len(_ENV_PREFIX):] not in fields | _OTHER_ENV)
    if unknown:
        import warnings

        warnings.warn(f"torch_ce: unknown environment variable(s) {unknown}; known: "
                      f"{sorted(_ENV_PREFIX + f for f in fields)}", stacklevel=2)
    kw = {}
    for f in dataclasses.fields(Config):
        raw = environ.get(_ENV_PREFIX + f.name.upper())
        if raw is not None and raw != "":
            kw[f.name] = _parse(f, raw)
    return Config(**kw).validate()


config: Config = from_env()


def update(**overrides: Any) -> Config:
    """Set fields of the global config; unknown names and bad values raise ValueError."""
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(
            f"torch_ce: unknown config option(s) {sorted(unknown)}; known: {sorted(known)}"
        )
    candidate = dataclasses.replace(config, **overrides).validate()
    for k in overrides:
        setattr(config, k, getattr(candidate, k))
    return config


@contextlib.contextmanager
def patch(**overrides: Any) -> Iterator[Config]:
    """Temporarily override config fields (tests)."""
    old = dataclasses.asdict(config)
    update(**overrides)
    try:
        yield config
    finally:
        for k, v in old.items():
            setattr(config, k, v)
