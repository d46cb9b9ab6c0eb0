"""The cost model the compiler reads: what a gather launch costs, and the device's peaks.

# NOTE [wait(launch()) cost]
A copy-engine gather's launch is ~3 us of CPU issue; what the schedule must hide is the time
from launch until its consumer may proceed, i.e. the copies on the copy stream:
cost = wait(launch()). Sizing the overlap window by the launch alone undersizes it by an
order of magnitude. The curve latency + (group_size - 1) * bytes_per_rank / bandwidth is
measured at run time on the real windows right after they are published
(``calibration.calibrate``), kept per (device model, group size, link) and cached on disk
for later compiles. Before any calibration the default curve below (our 2 x H200 NV18
measurements) is used, and so it is after a calibration (or a cached curve) that cannot be
a real link's: not monotonic in bytes, or faster than the link's physical bandwidth
(``implausible``; a warning says why).

Which decisions must match across ranks: NCCL gathers are costed by our roofline, whose
inputs (a node's flops and bytes, the device peaks) are identical on every rank; CE
gathers may use this rank's calibration, since the reorder keeps every launch's relative
order (NOTE [launch order] in reorder.py). Nothing here runs a collective.

# NOTE [the compiler reads a snapshot]
What the run time measured reaches the compiler as one immutable ``Costs`` value: the run
time ``publish``-es a new one (a calibrated or cached curve, measured peaks), never edits
the current one, and the compile side reads ``current()``. Which curve each link has
(default, cached or calibrated) and whether peaks were measured is part of torch_ce's
cache identity (``Costs.identity``, read by passes/identity.py): a graph compiled before
this process calibrated and one compiled after are different entries. The measured values
themselves are not: they are noise from process to process, and keying on them would make
every warm process miss the cache.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

import torch

log = logging.getLogger("torch_ce")


@dataclasses.dataclass(frozen=True)
class Curve:
    latency_us: float
    gbps: float  # GB/s of peer bytes into one rank
    source: str = "default"

    def us(self, bytes_per_rank: int, group_size: int) -> float:
        return self.latency_us + (group_size - 1) * bytes_per_rank / (self.gbps * 1e3)


# 2 x H200, NV18, cudaMemcpyBatchAsync (DESIGN.md): 16 MiB 64.3 us, 64 MiB 229 us,
# 256 MiB 877 us -> ~310 GB/s; ~25 us at 1-4 MiB.
DEFAULT_CE_CURVE = Curve(latency_us=20.0, gbps=310.0, source="default (2xH200 NV18)")
# Host transport (memcpy through shared memory): a rough CPU figure.
DEFAULT_HOST_CURVE = Curve(latency_us=5.0, gbps=5.0, source="default (host memcpy)")


def default_curve(device_type: str) -> Curve:
    return DEFAULT_CE_CURVE if device_type == "cuda" else DEFAULT_HOST_CURVE


@dataclasses.dataclass(frozen=True)
class Costs:
    """What the run time measured, as of one moment (NOTE [the compiler reads a snapshot])."""

    curves: tuple[tuple[str, Curve], ...] = ()  # link key -> curve, sorted by key
    peaks: tuple[tuple[str, tuple[float, float]], ...] = ()  # device name -> (TFLOP/s, GB/s)

    def curve(self, key: str) -> Curve | None:
        return dict(self.curves).get(key)

    def peak(self, name: str) -> tuple[float, float] | None:
        return dict(self.peaks).get(name)

    def identity(self) -> str:
        """Which curve each link has and which devices have measured peaks (not the values)."""
        return repr(([(k, c.source) for k, c in self.curves], [n for n, _ in self.peaks]))


_current = Costs()


def current() -> Costs:
    return _current


def publish(*, curve: tuple[str, Curve] | None = None, peaks: tuple[str, tuple[float, float]] | None = None) -> Costs:
    """Replace the published costs with a new value holding ``curve`` / ``peaks`` too (run
    time: a calibration, a curve read from disk, measured peaks)."""
    global _current
    c = _current
    if curve is not None:
        c = dataclasses.replace(c, curves=tuple(sorted({**dict(c.curves), curve[0]: curve[1]}.items())))
    if peaks is not None:
        c = dataclasses.replace(c, peaks=tuple(sorted({**dict(c.peaks), peaks[0]: peaks[1]}.items())))
    _current = c
    return c


def forget(key: str | None = None) -> None:
    """Drop one link's published curve (None: every curve and peak), as a fresh process
    would start (tests)."""
    global _current
    _current = Costs() if key is None else dataclasses.replace(
        _current, curves=tuple((k, c) for k, c in _current.curves if k != key))


def link_key(device: torch.device, group_size: int) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).replace(" ", "_")
        return f"{name}_g{group_size}_p2p"
    return f"cpu_g{group_size}_shm"


def cache_path(key: str) -> str:
    from ..config import config

    root = config.cost_cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "torch_ce")
    return os.path.join(root, f"ce_cost_{key}.json")


def curve_for(device_type: str, group_size: int, device: torch.device | None = None) -> Curve:
    """The curve for this link: published (calibrated, or read from disk before), else the
    disk cache's (checked, then published), else the default."""
    from ..config import config

    default = default_curve(device_type)
    if config.cost_mode != "calibrated":
        return default
    try:
        dev = device or (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu"))
        key = link_key(dev, group_size)
    except Exception:
        return default
    known = _current.curve(key)
    if known is not None:
        return known
    try:
        with open(cache_path(key)) as f:
            d = json.load(f)
        # "cached", not "calibrated": a process with windows of its own still calibrates
        # once (calibrate() skips only its own in-process fit).
        cached = Curve(float(d["latency_us"]), float(d["gbps"]), "cached")
        points = [tuple(p) for p in d.get("points", [])]
        why = implausible(points, cached, bound_of(dev))
    except (OSError, ValueError, KeyError, TypeError):
        return default
    if why is not None:
        log.warning("torch_ce: cached CE gather cost %s rejected (%.1f us + bytes / %.0f GB/s): "
                    "%s; using %s", cache_path(key), cached.latency_us, cached.gbps, why,
                    default.source)
        cached = default
    publish(curve=(key, cached))
    return cached


def measured_peaks(name: str) -> tuple[float, float] | None:
    """(TFLOP/s, GB/s) measured at bind time for device ``name``, if any."""
    return _current.peak(name)


def fit(points: list[tuple[int, float]]) -> Curve:
    """Least-squares latency + bytes / bandwidth through (peer bytes, us) points."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points) or 1.0
    slope = sum((b - mx) * (t - my) for b, t in points) / sxx  # us per byte
    slope = max(slope, 1e-9)
    return Curve(max(my - slope * mx, 0.0), 1.0 / slope / 1e3, "calibrated")


# Peer bytes into one device can arrive no faster than its links carry them. GB/s per
# direction into one GPU, by a substring of the device name (first match wins).
LINK_GBPS = (
    ("H100", 18 * 26.5),  # NVLink4: 18 links x 26.5 GB/s = 477 GB/s
    ("H200", 18 * 26.5),
    ("H800", 8 * 26.5),  # NVLink4 with 8 links
    ("B200", 18 * 50.0),  # NVLink5
    ("B300", 18 * 50.0),
    ("A100", 12 * 25.0),  # NVLink3
    ("A800", 8 * 25.0),
)
UNKNOWN_GPU_LINK_GBPS = 1800.0  # generous: no known link is faster
HOST_MEMCPY_GBPS = 500.0  # generous for one memcpy stream through shared memory
# A fit may exceed the physical bound by this factor (timer noise) before it is rejected.
LINK_MARGIN = 1.10
# A ladder point (4x the bytes of the previous) may time down to this factor of the
# previous one (noise) before the ladder counts as not monotonic in bytes.
MONOTONIC_SLACK = 0.5


def link_bound_gbps(device_type: str, device_name: str = "") -> float:
    """The physical bound on peer bytes into one device, GB/s (before ``LINK_MARGIN``)."""
    if device_type != "cuda":
        return HOST_MEMCPY_GBPS
    for sub, gbps in LINK_GBPS:
        if sub in device_name:
            return gbps
    return UNKNOWN_GPU_LINK_GBPS


def bound_of(device: torch.device) -> float:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return link_bound_gbps(device.type, name)


def implausible(points: list, curve: Curve, bound_gbps: float) -> str | None:
    """Why a calibration cannot be a real link's (None: plausible): a ladder that gets
    faster with more bytes (seen on H200: 311 us at 1 MiB, 79 us at 16 MiB), or a fit
    faster than the link."""
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if t1 < MONOTONIC_SLACK * t0:
            return (f"not monotonic in bytes: {t0:.1f} us at {b0} B but {t1:.1f} us at {b1} B "
                    f"(points {points})")
    if curve.gbps > bound_gbps * LINK_MARGIN:
        return (f"{curve.gbps:.0f} GB/s exceeds the link's {bound_gbps:.0f} GB/s "
                f"(x{LINK_MARGIN} margin; points {points})")
    return None
