"""Shared helpers for ``torch-ce bench``: logging, timing, results on disk, tables.

    time_ms(fn, iters, warmup)       median of per-iteration CUDA-event timings (ms)
    write_json(path, payload)        results plus environment info (versions, GPU, argv)
    save_png(path, draw)             a matplotlib figure, skipped with a note without it

Launching the ranks and exchanges between them live in ranks.py.
Everything here imports on a CPU-only machine; CUDA and matplotlib are touched lazily.
The benches also run on CPU ranks (``--device cpu``: gloo and torch_ce's host transport)
as a smoke test of the bench code itself; those numbers mean nothing.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
import statistics
import sys
import time
import traceback
from typing import Any, Callable

from .ranks import device, is_cuda

DEFAULT_OUT = os.path.join("bench", "results")

_cycles_per_ms: float | None = None


# ---------------------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------------------


def rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0
    except Exception:
        return 0


def log(*a: Any) -> None:
    """Print on rank 0 only, flushed."""
    if rank() == 0:
        print(*a, flush=True)


def log_all(*a: Any) -> None:
    """Print on every rank with a rank prefix, flushed."""
    print(f"[rank {rank()}]", *a, flush=True)


def short_error(e: BaseException, limit: int = 1500) -> str:
    """``Type: message`` plus the tail of the traceback, bounded (for JSON)."""
    tb = traceback.format_exc()
    head = f"{type(e).__name__}: {e}"
    if len(head) > limit // 2:
        head = head[: limit // 2] + " ..."
    tail = tb[-(limit - len(head)):] if tb and tb != "NoneType: None\n" else ""
    return head + ("\n" + tail if tail else "")


# ---------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------


def sync() -> None:
    if is_cuda():
        import torch

        torch.cuda.synchronize()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def cycles_per_ms() -> float:
    """GPU clock cycles per ms as seen by ``torch.cuda._sleep`` (measured once)."""
    global _cycles_per_ms
    if _cycles_per_ms is None:
        import torch

        n = 2_000_000
        torch.cuda._sleep(n)  # warm
        torch.cuda.synchronize()
        best = 0.0
        for _ in range(3):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            torch.cuda._sleep(n)
            e.record()
            e.synchronize()
            best = max(best, n / max(s.elapsed_time(e), 1e-6))
        _cycles_per_ms = best
    return _cycles_per_ms


def _round(fn: Callable, iters: int, sleep_ms: float) -> tuple[list[float], float]:
    """One timed round: per-iteration event pairs on the current stream, returns
    (samples in ms, CPU ms spent enqueueing)."""
    import torch

    if sleep_ms > 0:
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms()))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    t0 = time.perf_counter()
    for i in range(iters):
        starts[i].record()
        fn()
        ends[i].record()
    cpu_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)], cpu_ms


def time_stats(fn: Callable, iters: int = 50, warmup: int = 5, *, head_start: bool = False,
               do_barrier: bool = True) -> dict:
    """Per-iteration timings of ``fn`` on the current stream: median/min/max/mean in ms.

    CUDA: ``warmup`` calls, ``torch.cuda.synchronize()`` and a ``dist.barrier()``, then one
    CUDA-event pair around each call, all enqueued back to back. ``head_start=True`` first
    parks the stream on a ``torch.cuda._sleep`` long enough for the CPU to enqueue every
    iteration, so the samples are device time (no CPU issue gaps); it runs one unmeasured
    round first to size the sleep and to warm the caching allocator for ``iters`` calls
    in flight. Without it, an issue-bound op's samples include its CPU issue time.
    CPU ranks (smoke runs): ``time.perf_counter`` per call.
    """
    iters = max(int(iters), 1)
    for _ in range(max(int(warmup), 0)):
        fn()
    sync()
    if do_barrier:
        barrier()
    info: dict[str, Any] = dict(iters=iters, head_start=bool(head_start and is_cuda()))
    if not is_cuda():
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    elif head_start:
        _, cpu_ms = _round(fn, iters, max(2.0, 0.25 * iters))
        if do_barrier:
            barrier()
        sleep_ms = 1.5 * cpu_ms + 1.0
        samples, cpu_ms = _round(fn, iters, sleep_ms)
        info.update(sleep_ms=round(sleep_ms, 3), cpu_enqueue_ms=round(cpu_ms, 3),
                    head_start_sufficient=cpu_ms < sleep_ms)
    else:
        samples, cpu_ms = _round(fn, iters, 0.0)
        info.update(cpu_enqueue_ms=round(cpu_ms, 3))
    info.update(median_ms=statistics.median(samples), min_ms=min(samples),
                max_ms=max(samples), mean_ms=statistics.fmean(samples))
    return info


def time_ms(fn: Callable, iters: int = 50, warmup: int = 5, **kw: Any) -> float:
    """Median ms per call of ``fn`` (see ``time_stats``)."""
    return time_stats(fn, iters, warmup, **kw)["median_ms"]


# ---------------------------------------------------------------------------------------
# Results on disk
# ---------------------------------------------------------------------------------------


def gpu_tag(name: str | None = None) -> str:
    """A short file-name tag for the device: 'NVIDIA H200' -> 'h200', CPU -> 'cpu'."""
    if name is None:
        if not is_cuda():
            return "cpu"
        import torch

        name = torch.cuda.get_device_name(device())
    tag = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    tag = re.sub(r"^nvidia_", "", tag)
    return tag or "gpu"


def env_info(world_size: int | None = None) -> dict:
    """Versions, device, world size, date and the command line, for the results JSON."""
    info: dict[str, Any] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        argv=list(sys.argv),
        python=platform.python_version(),
        host=socket.gethostname(),
        world_size=world_size,
    )
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if is_cuda():
            info["gpu"] = torch.cuda.get_device_name(device())
            info["gpu_count"] = torch.cuda.device_count()
            p = torch.cuda.get_device_properties(device())
            info["sms"] = p.multi_processor_count
            info["gpu_mem_gib"] = round(p.total_memory / 2**30, 1)
            try:
                v = torch.cuda.nccl.version()
                info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            except Exception as e:
                info["nccl"] = f"unknown ({e})"
        else:
            info["gpu"] = None
    except Exception as e:  # never fail a results file for its metadata
        info["torch_error"] = repr(e)
    try:
        import torch_ce
        from torch_ce.runtime import native
        from torch_ce.runtime.gather import kernel_path

        info["torch_ce"] = torch_ce.__version__
        info["ce_gather_kernel"] = kernel_path("cuda" if is_cuda() else "cpu")
        info["peer_order"] = list(native.peer_order())  # (order, chunk bytes), NOTE [peer order]
    except Exception as e:
        info["torch_ce_error"] = repr(e)
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "CUDA_VISIBLE_DEVICES",
              "TORCH_CE_PEER_ORDER", "TORCH_CE_PEER_CHUNK_MIB"):
        if k in os.environ:
            info.setdefault("env", {})[k] = os.environ[k]
    return info


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def write_json(path: str, payload: dict, env: dict | None = None) -> str:
    """Write ``payload`` (plus ``"env"``) to ``path`` atomically; returns the path."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    data = dict(payload)
    data["env"] = env if env is not None else env_info()
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(_jsonable(data), f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def save_png(path: str, draw: Callable) -> str | None:
    """``draw(plt)`` must return a figure; saved to ``path``. None (and a note) if
    matplotlib is missing or drawing failed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print(f"torch-ce bench: matplotlib not installed; skipping {path}", flush=True)
        return None
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig = draw(plt)
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        return path
    except Exception as e:
        print(f"torch-ce bench: could not draw {path}: {e!r}", flush=True)
        return None


# ---------------------------------------------------------------------------------------
# Targets and tables
# ---------------------------------------------------------------------------------------


def target(name: str, value: float | None, op: str, limit: float) -> dict:
    """A target check: ``value <op> limit`` with op '<=' or '>='; None value -> not met."""
    if value is None:
        ok = None
    else:
        ok = value <= limit if op == "<=" else value >= limit
    return dict(name=name, value=None if value is None else round(float(value), 4),
                op=op, limit=limit, ok=ok)


def format_target(t: dict) -> str:
    tag = {True: "PASS", False: "MISS", None: "N/A "}[t["ok"]]
    v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
    return f"  [{tag}] {t['name']}: {v} (target {t['op']} {t['limit']})"


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_common_args(p, *, timeout_s: int) -> None:
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"results folder (default {DEFAULT_OUT}, relative to the working dir)")
    p.add_argument("--nprocs", type=int, default=0,
                   help="ranks to spawn (default: every visible GPU; ignored under torchrun)")
    p.add_argument("--timeout", type=float, default=timeout_s,
                   help=f"hard wall-clock limit in s; ranks are killed after it (default {timeout_s})")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: smoke-test the bench code on gloo ranks with the host transport "
                        "(the numbers mean nothing)")


def parse_list(s: str, typ=float) -> list:
    return [typ(x) for x in str(s).replace(" ", "").split(",") if x]
