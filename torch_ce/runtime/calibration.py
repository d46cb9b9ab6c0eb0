"""Calibration: what a gather launch costs, measured on the real windows (run time).

# NOTE [wait(launch()) cost]
A copy-engine gather's launch is ~3 us of CPU issue; what the schedule must hide is the time
from launch until its consumer may proceed, i.e. the copies on the copy stream:
cost = wait(launch()). Sizing the overlap window by the launch alone undersizes it by an
order of magnitude. The curve latency + (group_size - 1) * bytes_per_rank / bandwidth is
measured at run time on the real windows right after they are published (``calibrate``),
kept per (device model, group size, link) and cached on disk for later compiles. Before any
calibration the default curve below (our 2 x H200 NV18 measurements) is used, and so it is
after a calibration (or a cached curve) that cannot be a real link's: not monotonic in
bytes, or faster than the link's physical bandwidth (``implausible``; a warning says why).

Which decisions must match across ranks: NCCL gathers are costed only from rank-identical
inputs (Inductor's analytical estimate); CE gathers may use this rank's calibration, since
the reorder keeps every launch's relative order (NOTE [launch order] in reorder.py).
Nothing here runs a collective.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Callable

import torch

log = logging.getLogger("torch_ce")


@dataclasses.dataclass
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

_curves: dict[str, Curve] = {}


def link_key(device: torch.device, group_size: int) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).replace(" ", "_")
        return f"{name}_g{group_size}_p2p"
    return f"cpu_g{group_size}_shm"


def _cache_path(key: str) -> str:
    from ..config import config

    root = config.cost_cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "torch_ce")
    return os.path.join(root, f"ce_cost_{key}.json")


def curve_for(device_type: str, group_size: int, device: torch.device | None = None) -> Curve:
    """The calibrated curve for this link if known (memory, then disk), else the default."""
    from ..config import config

    default = _default(device_type)
    if config.cost_mode != "calibrated":
        return default
    try:
        dev = device or (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu"))
        key = link_key(dev, group_size)
    except Exception:
        return default
    if key in _curves:
        return _curves[key]
    try:
        with open(_cache_path(key)) as f:
            d = json.load(f)
        # "cached", not "calibrated": a process with windows of its own still calibrates
        # once (calibrate() skips only its own in-process fit).
        cached = Curve(float(d["latency_us"]), float(d["gbps"]), "cached")
        points = [tuple(p) for p in d.get("points", [])]
        why = implausible(points, cached, _bound(dev))
    except (OSError, ValueError, KeyError, TypeError):
        return default
    if why is not None:
        log.warning("torch_ce: cached CE gather cost %s rejected (%.1f us + bytes / %.0f GB/s): "
                    "%s; using %s", _cache_path(key), cached.latency_us, cached.gbps, why,
                    default.source)
        cached = default
    _curves[key] = cached
    return cached


def fit(points: list[tuple[int, float]]) -> Curve:
    """Least-squares latency + bytes / bandwidth through (peer bytes, us) points."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points) or 1.0
    slope = sum((b - mx) * (t - my) for b, t in points) / sxx  # us per byte
    slope = max(slope, 1e-9)
    return Curve(max(my - slope * mx, 0.0), 1.0 / slope / 1e3, "calibrated")


def time_wait_launch(launch: Callable[[], object], wait: Callable[[object], object],
                     device: torch.device, iters: int = 5) -> float:
    """Median microseconds of ``wait(launch())``: issue to consumer-may-proceed."""
    samples = []
    for i in range(iters + 1):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            # Hide the CPU issue behind a short sleep, so the interval is the device-side
            # wait(launch()): what compute must cover.
            torch.cuda._sleep(200_000)
            s.record()
            wait(launch())
            e.record()
            e.synchronize()
            us = s.elapsed_time(e) * 1e3
        else:
            t0 = time.perf_counter()
            wait(launch())
            us = (time.perf_counter() - t0) * 1e6
        if i:  # the first run warms up
            samples.append(us)
    samples.sort()
    return samples[len(samples) // 2]


# The largest ladder point must read at least this much from peers, else no calibration.
MIN_CALIBRATION_BYTES = 16 * 2**20

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


def adopt(key: str, points: list, bound_gbps: float, default: Curve) -> Curve:
    """Fit ``points`` (peer bytes, us) for link ``key``; keep and cache the fit if it is
    plausible, else warn with the numbers and use ``default``."""
    c = fit(points)
    why = implausible(points, c, bound_gbps)
    if why is not None:
        log.warning("torch_ce: calibrated CE gather cost for %s rejected (%.1f us + bytes / "
                    "%.0f GB/s): %s; using %s", key, c.latency_us, c.gbps, why, default.source)
        _curves[key] = default
        return default
    _curves[key] = c
    try:
        path = _cache_path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Ranks of one machine share the cache: write atomically, never a half file.
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(dict(dataclasses.asdict(c), points=points), f)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("torch_ce: could not cache the cost curve: %s", e)
    log.info("torch_ce: calibrated CE gather cost for %s: %.1f us + bytes / %.0f GB/s", key, c.latency_us, c.gbps)
    return c


def _default(device_type: str) -> Curve:
    return DEFAULT_CE_CURVE if device_type == "cuda" else DEFAULT_HOST_CURVE


def _bound(device: torch.device) -> float:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return link_bound_gbps(device.type, name)


def calibrate(slot, sizes_mib=(1, 4, 16, 64)) -> Curve | None:
    """Time wait(launch()) on the real windows of a just-published ``slot``'s window.

    Gathers prefixes of the peers' windows (up to the window's size) with the ops
    themselves (``magi::ce_all_gather`` on a probe registered at the window's start), so
    the curve is the one the compiled gathers follow. Local to this rank: no collective.
    A window smaller than ``MIN_CALIBRATION_BYTES`` of peer reads is not calibrated
    (returns None); an implausible ladder gives the built-in curve (``adopt``).
    """
    from . import cuda, host, windows as W

    w = slot.window
    dev = w.device
    key = link_key(dev, w.group_size)
    if key in _curves and _curves[key].source == "calibrated":
        return _curves[key]
    tr = cuda if dev.type == "cuda" else host
    gather = torch.ops.magi.ce_all_gather
    points = []
    for mib in sizes_mib:
        nbytes = min(int(mib * 2**20), w.nbytes) // 512 * 512
        if nbytes <= 0 or (points and nbytes == points[-1][0] // (w.group_size - 1)):
            continue
        probe_slot = W.Slot(w, 0, nbytes, (nbytes,), torch.uint8, "calibration")
        tr.publish_slot(probe_slot)
        probe = w.local[:nbytes]
        with W.registered_probe(probe, probe_slot):
            us = time_wait_launch(lambda: gather(probe, w.group_size, w.group.group_name),
                                  torch.ops._c10d_functional.wait_tensor, dev)
        points.append(((w.group_size - 1) * nbytes, us))
    if len(points) < 2 or points[-1][0] < MIN_CALIBRATION_BYTES:
        # A short ladder is all latency and noise: its slope is no bandwidth. Such a fit
        # (16.9 GB/s from a test's KiB-sized window, cached on disk) steered the e2e runs
        # 8-10 (docs/perf-notes.md, "the calibration in the e2e process").
        log.debug("torch_ce: window of %d B too small to calibrate the CE cost (needs %d B "
                  "of peer reads); keeping %s", w.nbytes, MIN_CALIBRATION_BYTES,
                  curve_for(dev.type, w.group_size, dev).source)
        return None
    return adopt(key, points, _bound(dev), _default(dev.type))

# ---------------------------------------------------------------------------------------
# Device peaks (for the compile side's roofline; passes/cost.py reads them)
# ---------------------------------------------------------------------------------------

_peaks: dict[str, tuple[float, float]] = {}  # device name -> (TFLOP/s, GB/s), measured


def measure_peaks(device: torch.device) -> tuple[float, float]:
    """Time one bf16 matmul and one device copy (at bind time, ~10 ms, local only)."""
    name = torch.cuda.get_device_name(device)
    if name in _peaks:
        return _peaks[name]
    n = 4096
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    src = torch.empty(64 * 2**20, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def timed(fn, iters=5):
        fn()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / iters / 1e3  # seconds

    tflops = 2 * n**3 / timed(lambda: torch.mm(a, b)) / 1e12
    gbps = 2 * src.numel() / timed(lambda: dst.copy_(src)) / 1e9
    _peaks[name] = (tflops, gbps)
    log.info("torch_ce: measured %s peaks: %.0f TFLOP/s bf16, %.0f GB/s", name, tflops, gbps)
    return _peaks[name]


def measured_peaks(name: str) -> tuple[float, float] | None:
    """(TFLOP/s, GB/s) measured at bind time for device ``name``, if any."""
    return _peaks.get(name)
