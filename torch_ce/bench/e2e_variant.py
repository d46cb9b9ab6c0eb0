"""One variant of ``torch-ce bench e2e`` on one rank: the model, the config, the compile,
the timing (and the trace), plus torch_ce's own record of what it did.

The model is shared/probes/e2e_baseline.py's decoder (``torch_ce.simple_fsdp``) or one of
torchtitan's (zoo.py, ``--model``); every variant builds it afresh from the same seed, so
all variants compute the same function.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import re
import tempfile
import time

from . import common as C
from . import ranks as R
from . import zoo
from .trace import trace_ce


# ---------------------------------------------------------------------------------------
# The model (torch_ce.simple_fsdp: shared/probes/e2e_baseline.py's decoder)
# ---------------------------------------------------------------------------------------


def prefetch_mib(a: dict) -> float:
    """ce_prefetch's prefetch_next_call_mib: ``--prefetch-mib``, or by default one decoder
    layer's gathered weights (fused QKV, output, SwiGLU's three) plus 1 MiB of slack."""
    if a.get("prefetch_mib", 0.0) > 0:
        return float(a["prefetch_mib"])
    d, f = a["dim"], a["ffn"]
    return (4 * d * d + 3 * d * f) * 2 / 2**20 + 1.0


def build_full(a: dict, dev, seed: int):
    """The full bf16 decoder, initialised on ``dev`` (same weights for the same seed on
    every rank and in every variant)."""
    import torch

    from torch_ce.simple_fsdp import Decoder

    heads = a["heads"] or max(1, a["dim"] // 128)
    torch.manual_seed(seed)
    if dev.type == "cuda":
        torch.cuda.manual_seed(seed)
    with torch.device(dev):
        net = Decoder(layers=a["layers"], dim=a["dim"], ffn=a["ffn"], heads=heads)
    net = net.to(torch.bfloat16)
    for p in net.parameters():
        p.requires_grad_(False)
    return net.eval()


def build_sharded(a: dict, dev, seed: int, mesh, rank: int, world: int):
    """The same decoder with every Linear weight a Shard(0) DTensor gathered by a
    ``redistribute(Replicate()).to_local()`` parametrization (SimpleFSDP style). Each rank
    keeps a contiguous clone of its rows of the full weight (no communication)."""
    import torch
    import torch.nn as nn
    import torch.nn.utils.parametrize as P
    from torch.distributed.tensor import DTensor, Shard

    from torch_ce.simple_fsdp import GatherWeight

    net = build_full(a, dev, seed)
    for m in list(net.modules()):
        if isinstance(m, nn.Linear):
            w = m.weight.detach()
            if w.shape[0] % world:
                raise ValueError(f"weight rows {w.shape[0]} not divisible by world {world}")
            local = w.chunk(world, 0)[rank].clone()
            dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            m.weight = nn.Parameter(dt, requires_grad=False)
            P.register_parametrization(m, "weight", GatherWeight(), unsafe=True)
            del w
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return net


def build(a: dict, dev, seed: int, mesh, rank: int, world: int, sharded: bool):
    """The variant's model: ``--model``, replicated (bound) or sharded over ``mesh``."""
    if a["model"] == "decoder":
        return build_sharded(a, dev, seed, mesh, rank, world) if sharded else build_full(a, dev, seed)
    return zoo.build_sharded(a, dev, seed, mesh) if sharded else zoo.build_full(a, dev, seed)


def model_input(a: dict, T: int, dev, seed: int):
    """Batch 1 of ``T`` tokens: hidden states for the decoder, token ids for a zoo model."""
    import torch

    if a["model"] != "decoder":
        return zoo.tokens(a, T, dev, seed)
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(1, T, a["dim"], dtype=torch.bfloat16, device=dev, generator=g)


_GATHER_CALL = re.compile(r"torch\.ops\.(?:magi\.ce_all_gather(?:_coalesced|_dim|_padded)?|_c10d_functional\."
                          r"all_gather_into_tensor\w*)\.default\((\[[^\]]*\]|\w+)")


def gather_args(code: str) -> list[list[str]]:
    """The shard arguments (graph placeholders) of each gather call, in code order: the
    order the gather ops run in, so the account can name them (account.py)."""
    return [re.findall(r"\w+", m.group(1)) for m in _GATHER_CALL.finditer(code)]


_CALLS = dict(
    code_magi_ce_all_gather_calls=r"magi\.ce_all_gather(?:_coalesced|_dim|_padded)?\.default\(",
    code_magi_ce_bind_calls=r"magi\.ce_bind\.default\(",
    code_nccl_all_gather_calls=r"_c10d_functional\.all_gather_into_tensor\w*\.default\(",
)


def code_call_counts(code: str) -> dict:
    """Calls (not comments) of the magi ops and of NCCL all-gathers in generated code."""
    return {k: len(re.findall(p, code)) for k, p in _CALLS.items()}


# ---------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------


def fresh_caches(rank: int) -> str:
    """A fresh absolute Inductor cache dir for this process; FX graph / AOT caches off."""
    d = tempfile.mkdtemp(prefix=f"torch_ce_bench_inductor_r{rank}_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
    os.environ.pop("TRITON_CACHE_DIR", None)
    import torch._functorch.config as fc
    import torch._inductor.config as ic

    ic.fx_graph_cache = False
    if hasattr(fc, "enable_autograd_cache"):
        fc.enable_autograd_cache = False
    return d


def cleanup(torch, torch_ce) -> None:
    torch._dynamo.reset()
    torch_ce.disable()
    # No rank frees its windows while a peer may still read them (the last forward's
    # prefetch runs past its return).
    C.sync()
    C.barrier()
    torch_ce.release_all()
    gc.collect()
    if R.is_cuda():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def base_of(name: str) -> str:
    """The variant a ``*_cg`` variant compiles for CUDA graphs (the name itself otherwise)."""
    return name[:-3] if name.endswith("_cg") else name


def peer_order_of(name: str, a: dict) -> dict:
    """``native.peer_order_as`` arguments of a variant: ce_fixed reads in the fixed
    order, ce_chunk in ``--peer-chunk-mib`` pieces (NOTE [peer order] in
    csrc/ce_copy.h); every other variant keeps the library's order."""
    base = base_of(name)
    if base == "ce_fixed":
        return dict(order="fixed", chunk_mib=0)
    if base == "ce_chunk":
        return dict(order="rotated", chunk_mib=a["peer_chunk_mib"])
    return {}


def split_local_of(name: str) -> bool:
    """``native.split_local_copy_as`` argument of a variant: ce_inbatch copies this rank's
    own rows inside the peer batch (the A/B of docs/perf-notes.md section 14); every other
    variant on the second copy stream, the library's default."""
    base = base_of(name)
    return base != "ce_inbatch"


def run_variant(name: str, a: dict, x, mesh, rank: int, world: int, trace: bool, rec: dict,
                traced: dict | None = None):
    """Build, compile and time one variant, filling ``rec`` as it goes (so a failure keeps
    what was measured); returns this rank's output of the first call. With ``trace``, rank 0
    also leaves in ``traced`` the compact trace, the gathers' arguments in code order and
    the placeholder -> parameter names the CE passes saw (for the account)."""
    import torch
    from torch._inductor.utils import run_and_get_code

    import torch_ce
    from torch_ce import report
    from torch_ce.config import from_env

    cleanup(torch, torch_ce)
    report.clear()
    rec["wall_start"] = round(time.time(), 3)  # to line up with run_gpu.sh's gpu_clocks.csv
    # Every variant starts from the defaults (and TORCH_CE_* variables): enable() only sets
    # what it is given, so a previous variant's options would otherwise carry over.
    torch_ce.config.update(**dataclasses.asdict(from_env()))
    graphs = name.endswith("_cg")
    base = base_of(name)
    if base == "nccl":
        torch_ce.enable(transport="nccl", reorder=True)
    elif base in ("ce", "ce_fixed", "ce_chunk", "ce_inbatch"):  # the rest: peer_order_of, split_local_of
        torch_ce.enable(transport="copy_engine", reorder=True)
    elif base == "ce_fullrows":  # the embedding gathered in full (no row gather), for the A/B
        torch_ce.enable(transport="copy_engine", reorder=True, row_gathers=False)
    elif base == "ce_noreorder":
        torch_ce.enable(transport="copy_engine", reorder=False)
    elif base == "ce_prefetch":
        torch_ce.enable(transport="copy_engine", reorder=True, prefetch_next_call_mib=prefetch_mib(a))
    dev = R.device()
    torch_ce.runtime.prefetch.reset_stats()
    if name.startswith("ce"):
        rec["ce_cost_curve_at_compile"] = _curve(dev, world)
    t0 = time.perf_counter()
    model = build(a, dev, a["seed"], mesh, rank, world, sharded=base != "bound")
    rec["build_s"] = round(time.perf_counter() - t0, 2)
    compiled = torch.compile(model, dynamic=False, mode="reduce-overhead" if graphs else None)
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            y, codes = run_and_get_code(compiled, x)
            C.sync()
            rec["compile_s"] = round(time.perf_counter() - t0, 1)
            code = "\n".join(codes)
            if a.get("save_code") and rank == 0 and a.get("_first_T") and name == "ce":
                p = os.path.join(a["out"], f"e2e_code_{name}.py")
                os.makedirs(a["out"], exist_ok=True)
                with open(p, "w") as f:
                    f.write(code)
            rec.update(code_call_counts(code))
            args = gather_args(code)
            rec["magi_in_code"] = rec["code_magi_ce_all_gather_calls"] > 0
            out = y.detach().clone()
            del y
            C.log(f"[e2e]   compiled + first run in {rec['compile_s']} s; generated code calls "
                  f"magi.ce_all_gather* {rec['code_magi_ce_all_gather_calls']}x, NCCL "
                  f"all_gather_into_tensor* {rec['code_nccl_all_gather_calls']}x")
            st = C.time_stats(lambda: compiled(x), a["iters"], a["warmup"])
            rec["ms_rank0"] = rec["ms"] = round(st["median_ms"], 3)  # "ms": slowest rank, below
            rec["ms_min"] = round(st["min_ms"], 3)
            rec["ms_max"] = round(st["max_ms"], 3)
            # CPU time to enqueue one forward: close to ms means the forward is issue-bound.
            rec["cpu_issue_ms_per_forward"] = round(st.get("cpu_enqueue_ms", 0.0) / st["iters"], 3)
            if trace:
                C.barrier()
                if rank == 0:
                    C.log("[e2e]   tracing 3 iterations on rank 0 ...")
                    try:
                        keep: dict = {}
                        rec["trace"] = trace_ce(lambda: compiled(x), 3, keep)
                        if traced is not None:
                            traced.update(keep, args=args, param_of={
                                b["name"]: b["param"] for gr in report.graphs for b in gr.bound + gr.refused})
                    except Exception as e:  # noqa: BLE001  (the timing stands without it)
                        rec["trace"] = dict(error=C.short_error(e))
                else:  # the peer runs the same iterations (its copies load the links too)
                    for _ in range(3):
                        compiled(x)
                    C.sync()
                C.barrier()
    finally:
        rec["wall_end"] = round(time.time(), 3)
        compiled = model = None  # drop the references (the closures above see None)
        _summarize_report(rec, report)
        if name.startswith("ce"):
            rec["ce_cost_curve_after_run"] = _curve(dev, world)
            rec["prefetch_stats"] = dict(torch_ce.runtime.prefetch.stats)
    return out


def _summarize_report(rec: dict, report) -> None:
    """torch_ce's own record of the compile: reorder, bound gathers, refusals, binds."""
    try:
        if report.graphs:
            ro = dict(report.graphs[-1].reorder or {})
            if report.graphs[-1].prefetch:
                rec["prefetch_plan"] = dict(weights=len(report.graphs[-1].prefetch["members"]),
                                            what=report.graphs[-1].prefetch["what"])
            rec["reorder"] = {k: ro.get(k) for k in ("valid", "launches", "compute_limited")}
            pl = ro.get("placements") or []
            if pl:
                rec["reorder"]["need_us_total"] = round(sum(p.get("need_us", 0) for p in pl), 1)
                rec["reorder"]["covered_us_total"] = round(sum(p.get("covered_us", 0) for p in pl), 1)
                # [name, original unit index, target slot, need us, covered us, compute-limited]
                rec["reorder_placements"] = [
                    [p.get("name"), p.get("cur"), p.get("target"), round(p.get("need_us", 0), 1),
                     round(p.get("covered_us", 0), 1), p.get("compute_limited")] for p in pl]
            bound = [b for gr in report.graphs for b in gr.bound]
            refused: dict = {}
            for gr in report.graphs:
                for k, v in gr.refusal_counts.items():
                    refused[k] = refused.get(k, 0) + v
            rec["graphs"] = len(report.graphs)
            rec["bound_gathers"] = len(bound)
            rec["bound_mib"] = round(sum(b.get("bytes", 0) for b in bound) / 2**20, 1)
            rec["ce_buckets"] = sum(1 for gr in report.graphs for b in gr.buckets if b.get("kind") == "ce")
            if refused:
                rec["refused"] = refused
                rec["refused_sample"] = [dataclasses.asdict(r) for gr in report.graphs for r in gr.refused][:10]
        if report.binds:
            rec["binds"] = [dict(bound=len(b.bound), skipped=len(b.skipped), windows_opened=b.windows_opened,
                                 bytes_bound=b.bytes_bound) for b in report.binds]
            skipped = {k: v for b in report.binds for k, v in b.skipped.items()}
            if skipped:
                rec["bind_skipped_sample"] = dict(list(skipped.items())[:5])
    except Exception as e:  # noqa: BLE001
        rec["report_error"] = repr(e)


def _curve(dev, world: int):
    """The CE cost curve the reorder would use now (default, on-disk or calibrated)."""
    try:
        from torch_ce.runtime import cost_model as cost

        c = cost.curve_for(dev.type, world)
        return dict(latency_us=round(c.latency_us, 2), gbps=round(c.gbps, 1), source=c.source)
    except Exception as e:  # noqa: BLE001
        return f"error: {e}"
