"""Calibration: the run-time measurements the cost model publishes (run time, local only).

``calibrate`` times wait(launch()) on a just-published window's real slots (probe slots
gathered by the ops themselves), fits the curve, checks it (``cost_model.implausible``),
publishes it for the compiler and caches it on disk for later processes
(NOTE [wait(launch()) cost] in runtime/cost_model.py). ``measure_peaks`` times one bf16
matmul and one device copy for the compile side's roofline. Nothing here runs a
collective; the compile side never imports this module (it reads ``cost_model``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Callable

import torch

from . import cost_model as M

log = logging.getLogger("torch_ce")


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


def adopt(key: str, points: list, bound_gbps: float, default: M.Curve) -> M.Curve:
    """Fit ``points`` (peer bytes, us) for link ``key``; publish and cache the fit if it is
    plausible, else warn with the numbers and publish ``default``."""
    c = M.fit(points)
    why = M.implausible(points, c, bound_gbps)
    if why is not None:
        log.warning("torch_ce: calibrated CE gather cost for %s rejected (%.1f us + bytes / "
                    "%.0f GB/s): %s; using %s", key, c.latency_us, c.gbps, why, default.source)
        M.publish(curve=(key, default))
        return default
    M.publish(curve=(key, c))
    try:
        path = M.cache_path(key)
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


def calibrate(slot, sizes_mib=(1, 4, 16, 64)) -> M.Curve | None:
    """Time wait(launch()) on the real windows of a just-published ``slot``'s window.

    Gathers prefixes of the peers' windows (up to the window's size) with the ops
    themselves (``magi::ce_all_gather`` on a probe registered at the window's start), so
    the curve is the one the compiled gathers follow. Local to this rank: no collective.
    A window smaller than ``MIN_CALIBRATION_BYTES`` of peer reads is not calibrated
    (returns None); an implausible ladder gives the built-in curve (``adopt``).
    """
    from . import windows as W
    from .transports import transport

    w = slot.window
    dev = w.device
    key = M.link_key(dev, w.group_size)
    known = M.current().curve(key)
    if known is not None and known.source == "calibrated":
        return known
    tr = transport(dev)
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
        # (16.9 GB/s from a test's KiB-sized window, cached on disk) once steered the e2e
        # runs (docs/perf-notes.md, "the calibration in the e2e process").
        log.debug("torch_ce: window of %d B too small to calibrate the CE cost (needs %d B "
                  "of peer reads); keeping %s", w.nbytes, MIN_CALIBRATION_BYTES,
                  M.curve_for(dev.type, w.group_size, dev).source)
        return None
    return adopt(key, points, M.bound_of(dev), M.default_curve(dev.type))


def measure_peaks(device: torch.device) -> tuple[float, float]:
    """Time one bf16 matmul and one device copy (at bind time, ~10 ms, local only) and
    publish them for the compile side's roofline (passes/cost.py)."""
    name = torch.cuda.get_device_name(device)
    known = M.measured_peaks(name)
    if known is not None:
        return known
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
    M.publish(peaks=(name, (tflops, gbps)))
    log.info("torch_ce: measured %s peaks: %.0f TFLOP/s bf16, %.0f GB/s", name, tflops, gbps)
    return tflops, gbps
