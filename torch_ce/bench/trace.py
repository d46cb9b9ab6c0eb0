"""Trace summary of ``torch-ce bench e2e --trace``: copy-engine activity, its overlap with
compute, and the compute stream's idle gaps, from a torch.profiler Chrome trace.

The arithmetic is pure Python (tested on CPU); ``trace_ce`` profiles a few calls on this
rank and keeps only the summary (traces of a compiled decoder run to hundreds of MiB).
"""
from __future__ import annotations

import json
import os
import tempfile

from . import common as C
from . import ranks as R


def merge_intervals(iv) -> list[tuple[float, float]]:
    """Disjoint, sorted union of (start, end) intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for s, e in sorted((float(s), float(e)) for s, e in iv if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def union_length(iv) -> float:
    return sum(e - s for s, e in merge_intervals(iv))


def overlap_length(a, b) -> float:
    """Length of (union of a) intersected with (union of b)."""
    A, B = merge_intervals(a), merge_intervals(b)
    i = j = 0
    total = 0.0
    while i < len(A) and j < len(B):
        lo, hi = max(A[i][0], B[j][0]), min(A[i][1], B[j][1])
        if hi > lo:
            total += hi - lo
        if A[i][1] < B[j][1]:
            i += 1
        else:
            j += 1
    return total


def _stream(ev: dict):
    args = ev.get("args") or {}
    return args.get("stream", ev.get("tid"))


def _is_copy(ev: dict) -> bool:
    cat = str(ev.get("cat", "")).lower()
    return cat in ("gpu_memcpy", "memcpy") or str(ev.get("name", "")).startswith("Memcpy")


def summarize_trace(trace: dict, iterations: int = 1) -> dict:
    """Copy-engine activity of a Chrome trace (torch.profiler export), in microseconds.

    The copy stream is the stream with the most ``Memcpy PtoP`` / ``Memcpy DtoD`` time;
    its copies are the CE activity (PtoP: reads from peers; DtoD: this rank's own slot).
    ``overlap_with_compute_us`` is how much of that activity (as a union of intervals)
    runs while some kernel runs on another stream. Also counts the kernels whose name
    contains "nccl" (a CE variant should have none).

    Compute idle: the gaps between compute kernels inside the span (``compute_gaps``), split
    into time while a CE copy ran (the compute waiting for a gather, or a launch gap that a
    copy happens to cover) and time without one (CPU issue, events, allocator); the largest
    gaps list where in the iteration they fall (index of the kernel after the gap, counted
    within an iteration) and the kernels around them.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if str(e.get("cat", "")).lower() == "kernel"]
    copies = [e for e in events if _is_copy(e)]
    peer = [e for e in copies if any(k in str(e.get("name", "")) for k in ("PtoP", "DtoD"))]
    per_stream: dict = {}
    for e in peer:
        s = str(_stream(e))
        kind = "PtoP" if "PtoP" in str(e.get("name", "")) else "DtoD"
        d = per_stream.setdefault(s, {}).setdefault(kind, dict(n=0, us=0.0, bytes=0))
        d["n"] += 1
        d["us"] += float(e["dur"])
        d["bytes"] += int((e.get("args") or {}).get("bytes", 0) or 0)
    for d in per_stream.values():
        for v in d.values():
            v["us"] = round(v["us"], 1)
    copy_stream = (max(per_stream, key=lambda s: sum(v["us"] for v in per_stream[s].values()))
                   if per_stream else None)
    ce = [e for e in peer if str(_stream(e)) == copy_stream]
    ptop = [e for e in ce if "PtoP" in str(e.get("name", ""))]
    compute = [e for e in kernels if str(_stream(e)) != copy_stream]
    iv = lambda evs: [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs]  # noqa: E731
    ce_iv, comp_iv = iv(ce), iv(compute)
    busy = union_length(ce_iv)
    ptop_busy = union_length(iv(ptop))
    ptop_bytes = sum(int((e.get("args") or {}).get("bytes", 0) or 0) for e in ptop)
    overlap = overlap_length(ce_iv, comp_iv)
    gpu_iv = iv(kernels) + iv(copies)
    span = (max(e for _, e in gpu_iv) - min(s for s, _ in gpu_iv)) if gpu_iv else 0.0
    gaps = _compute_gaps(compute, ce_iv, max(int(iterations), 1))
    names: dict = {}
    for e in copies:
        n = str(e.get("name", ""))
        names[n] = names.get(n, 0) + 1
    it = max(int(iterations), 1)
    return dict(
        iterations=it,
        copy_stream=copy_stream,
        copy_streams=per_stream,
        ce_copies=len(ce),
        ce_copy_sum_us=round(sum(float(e["dur"]) for e in ce), 1),
        ce_copy_busy_us=round(busy, 1),
        ce_copy_busy_us_per_iter=round(busy / it, 1),
        overlap_with_compute_us=round(overlap, 1),
        overlap_fraction=round(overlap / busy, 4) if busy else None,
        exposed_copy_us_per_iter=round((busy - overlap) / it, 1),
        compute_busy_us_per_iter=round(union_length(comp_iv) / it, 1),
        gpu_span_us_per_iter=round(span / it, 1),
        ptop_gbps=round(ptop_bytes / ptop_busy / 1e3, 1) if ptop_busy and ptop_bytes else None,
        kernels=len(kernels),
        kernels_on_copy_stream=sum(1 for e in kernels if str(_stream(e)) == copy_stream),
        nccl_kernels=sum("nccl" in str(e.get("name", "")).lower() for e in kernels),
        memcpy_names=names,
        compute_gaps=gaps,
    )


def _compute_gaps(compute: list, ce_iv: list, iterations: int, top: int = 8) -> dict:
    """Idle time between compute kernels (see ``summarize_trace``), in us per iteration."""
    evs = sorted(compute, key=lambda e: float(e["ts"]))
    per_iter = max(len(evs) // iterations, 1)
    gaps, end, prev = [], None, None
    for i, e in enumerate(evs):
        s, f = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if end is not None and s > end:
            gaps.append(dict(us=s - end, with_copy_us=overlap_length([(end, s)], ce_iv), pos=i % per_iter,
                             before=str(prev.get("name", ""))[:48], after=str(e.get("name", ""))[:48]))
        if end is None or f >= end:
            end, prev = f, e
    total = sum(g["us"] for g in gaps)
    with_copy = sum(g["with_copy_us"] for g in gaps)
    largest = sorted(gaps, key=lambda g: -g["us"])[:top]
    return dict(
        idle_us_per_iter=round(total / iterations, 1),
        idle_with_copy_us_per_iter=round(with_copy / iterations, 1),
        gaps_over_20us_per_iter=round(sum(1 for g in gaps if g["us"] > 20) / iterations, 1),
        kernels_per_iter=per_iter,
        largest=[[round(g["us"], 1), round(g["with_copy_us"], 1), g["pos"], g["before"], g["after"]]
                 for g in largest],
    )


def trace_ce(fn, iterations: int = 3, keep: dict | None = None) -> dict:
    """Profile ``iterations`` calls on this rank; summarise and delete the trace file. Each
    call is one ``torch_ce_iter<i>`` annotation; ``keep["events"]`` gets the compact trace
    that the per-gather account reads (account.py)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from .account import ITER_MARK, compact

    acts = [ProfilerActivity.CPU]
    if R.is_cuda():
        acts.append(ProfilerActivity.CUDA)
    C.sync()
    with profile(activities=acts) as prof:
        for i in range(iterations):
            with record_function(f"{ITER_MARK}{i}"):
                fn()
        C.sync()
    fd, path = tempfile.mkstemp(prefix="torch_ce_trace_", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        size = os.path.getsize(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
    s = summarize_trace(trace, iterations)
    if keep is not None:
        keep["events"] = compact(trace)
    s["trace_file_mib"] = round(size / 2**20, 2)
    del trace
    return s


def trace_line(t: dict) -> str:
    """One log line for a ``summarize_trace`` result."""
    return (f"[e2e]   trace: CE copies busy {t['ce_copy_busy_us_per_iter']} us/iter, "
            f"{(t['overlap_fraction'] or 0) * 100:.0f}% overlapped with compute, "
            f"exposed {t['exposed_copy_us_per_iter']} us/iter; compute "
            f"{t['compute_busy_us_per_iter']} us/iter in a {t['gpu_span_us_per_iter']} us/iter "
            f"span (profiled); PtoP {t['ptop_gbps']} GB/s; nccl kernels {t['nccl_kernels']}; "
            f"compute idle {t['compute_gaps']['idle_us_per_iter']} us/iter "
            f"({t['compute_gaps']['idle_with_copy_us_per_iter']} while a copy ran)")
