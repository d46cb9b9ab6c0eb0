"""Scheduler-node costs for the reorder, in microseconds (compile time).

A CE launch costs wait(launch()) by the curve the run time calibrated
(NOTE [wait(launch()) cost] in runtime/cost_model.py); compute nodes cost our roofline from
device peaks measured at bind time. NCCL gathers are costed by the same roofline, whose
inputs (the node's flops and bytes, the device's peaks) are identical on every rank.
"""
from __future__ import annotations

import logging

import torch

from ..inductor_lowering import ce_launch_info
from ..runtime.cost_model import curve_for, measured_peaks

log = logging.getLogger("torch_ce")

# Plausibility floors for a CUDA device's peaks: the H200 run (torch 2.11, triton 3.6,
# a VM) gave Inductor helper values that made compute look ~1000x slower than it is.
_MIN_TFLOPS, _MIN_GBPS = 10.0, 200.0
_FALLBACK_PEAK = (400.0, 2000.0)  # conservative bf16 TFLOP/s, HBM GB/s


def _device_peaks(dtype) -> tuple[float, float]:
    """(TFLOP/s, GB/s) for the roofline: measured if we have them, else Inductor's helpers
    when plausible, else a conservative fallback."""
    try:
        name = torch.cuda.get_device_name()
        measured = measured_peaks(name)
        if measured is not None:
            return measured
    except Exception:
        pass
    try:
        from torch._inductor.utils import get_device_tflops, get_gpu_dram_gbps

        tflops, gbps = float(get_device_tflops(dtype)), float(get_gpu_dram_gbps())
    except Exception:
        tflops, gbps = 0.0, 0.0
    if tflops < _MIN_TFLOPS or gbps < _MIN_GBPS:
        if not _warned:
            _warned.append(True)
            log.warning("torch_ce: implausible device peaks from Inductor (%.3g TFLOP/s, %.3g GB/s); "
                        "using %s until measured", tflops, gbps, _FALLBACK_PEAK)
        return _FALLBACK_PEAK
    return tflops, gbps


_warned: list = []


def compute_us(snode) -> float:
    """Roofline estimate of a compute node, in us: max(flops / peak, bytes / bandwidth).

    Computed here rather than through ``get_estimated_runtime()``: its unit and its device
    peaks differ across torch releases and machines (on the H200 VM with torch 2.11 it came
    out ~1000x too large, which made every launch look covered and placed it one kernel
    before its wait). Peaks are measured at bind time (``calibration.measure_peaks``).
    """
    try:
        node = snode.get_nodes()[0].node
        dtype = node.get_dtype() if hasattr(node, "get_dtype") else torch.float32
        if snode.get_device() is None or snode.get_device().type != "cuda":
            return 0.0
        flops = snode.estimate_flops() or 0
        nbytes = snode.get_read_write_buffers_sizes() or 0
        tflops, gbps = _device_peaks(dtype)
        return max(flops / (tflops * 1e12), nbytes / (gbps * 1e9)) * 1e6
    except Exception:
        return 0.0


def launch_us(snode) -> float:
    """wait(launch()) of a transfer launch: the calibrated curve for CE, the roofline for NCCL."""
    info = ce_launch_info(snode)
    if info is not None:
        nbytes, gs, device_type = info
        return curve_for(device_type, gs).us(nbytes, gs)
    return compute_us(snode)  # our roofline of the NCCL node (rank-identical inputs)


def estimate_op_runtime(snode) -> float:
    """Inductor's ``estimate_op_runtime`` hook (milliseconds): CE gathers by our curve."""
    if ce_launch_info(snode) is not None:
        return launch_us(snode) / 1e3
    return snode.get_estimated_runtime()

