"""``torch-ce bench e2e``: a compiled SimpleFSDP model, NCCL vs copy engine vs no-comm bound.

``--model decoder`` (the default) is the model of shared/probes/e2e_baseline.py
(``torch_ce.simple_fsdp.Decoder``): ``--layers`` decoder layers (RMSNorm, fused QKV, SDPA,
SwiGLU FFN), bf16, every Linear weight a Shard(0) DTensor over all ranks, gathered in the
forward by a ``redistribute(Replicate()).to_local()`` parametrization, compiled with plain
``torch.compile`` for inference (``torch.no_grad()``). ``--model llama3_8b`` / ``qwen3_8b``
is torchtitan's own architecture (zoo.py says how it is isolated from the zoo's training
imports): the first ``--layers`` blocks of the 8B flavour (GQA,
full-vocabulary embedding and LM head), bf16, wrapped with torchtitan's SimpleFSDP
``data_parallel(mode="fully_shard")`` (every parameter Shard(0)), fed token ids. Per token
count, four variants, each a fresh compile (``torch._dynamo.reset()``) of a fresh model built
from the same seed, so all compute the same function:

  nccl          torch_ce.enable(transport="nccl")            our reorder, gathers on NCCL
  ce            torch_ce.enable(transport="copy_engine")     gathers on the copy engines
  ce_noreorder  torch_ce.enable(transport="copy_engine", reorder=False)
  bound         the same model replicated on every GPU (no DTensor, no communication)

and, not in the default set: ``ce_fullrows``, the ce variant with embeddings gathered in
full (``row_gathers=False``: the A/B of the row gather); ``ce_fixed`` and ``ce_chunk``, the ce variant with its peer
reads in the fixed order (every rank reads rank 0 first) or in chunked
interleave (``--peer-chunk-mib``; NOTE [peer order] in csrc/ce_copy.h); ``ce_inbatch``, the ce
variant with this rank's own rows copied inside the peer batch instead of on the second copy
stream (docs/perf-notes.md section 14); ``ce_prefetch``, the ce variant prefetching the next forward's
first weights at the end of each forward (``prefetch_next_call_mib``, NOTE [cross-call
prefetch] in torch_ce/runtime/prefetch.py; ``--prefetch-mib``, by default one decoder layer), and
``*_cg``, a variant compiled for CUDA graphs. Every variant starts from the default config.

Reports ms per forward (median of per-iteration CUDA events), CE/NCCL and CE/bound, the
CE output against the NCCL output, whether the generated code calls the magi ops, and the
reorder summary. ``--trace`` profiles 3 iterations of the nccl, ce, ce_inbatch and bound variants on
rank 0 and summarises the copy-engine activity, its overlap with compute, and the compute
stream's idle gaps (no trace file is kept), and writes the per-gather account of each
traced variant against bound (account.py: bytes, copy time, GB/s, exposed time, idle beside
this rank's own-row copies, compute slowdown)
as ``account_<model>_<world>.json`` and ``timeline_<model>_<world>.png`` (timeline.py).

Writes ``<out>/e2e_<gpu>_w<world>.json`` (``e2e_<model>_<gpu>_w<world>.json`` for a zoo
model; after every variant) and the same name with ``.png``.

This module holds the command and the per-rank loop; one variant's build, compile and
timing are in e2e_variant.py, the trace summary in trace.py, checks, ratios, targets,
table and figure in e2e_report.py.
"""
from __future__ import annotations

import argparse
import gc
import os
import time

from . import common as C
from . import ranks as R
from .e2e_report import (TARGETS_TEXT, describe, draw, local_checks, merge_previous, print_summary,
                         score)
from .e2e_variant import cleanup, fresh_caches, model_input, peer_order_of, run_variant, split_local_of
from .timeline import short_label
from .timeline import write as write_account
from .trace import trace_line
from .zoo import MODELS

VARIANTS = ("nccl", "ce", "ce_fixed", "ce_chunk", "ce_inbatch", "ce_fullrows", "ce_noreorder", "ce_prefetch", "bound", "nccl_cg",
            "ce_cg", "bound_cg")
DEFAULT_VARIANTS = ("nccl", "ce", "ce_noreorder", "bound")
TRACED = ("nccl", "ce", "ce_inbatch", "bound")
# *_cg: the same variant compiled with mode="reduce-overhead" (CUDA graphs): no per-op
# CPU issue cost at replay.


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="torch-ce bench e2e",
        description="Compiled SimpleFSDP model inference on all GPUs: NCCL gathers vs "
                    "copy-engine gathers (with and without torch_ce's reorder) vs the "
                    "replicated no-communication bound. Targets: " + TARGETS_TEXT,
    )
    p.add_argument("--model", choices=("decoder", *MODELS), default="decoder",
                   help="the in-house decoder (default) or torchtitan's architecture (first --layers blocks)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=None,
                   help="model width (default 4096; for a zoo model a smaller one scales heads and FFN)")
    p.add_argument("--vocab", type=int, default=0, help="zoo model vocabulary (default: the flavour's)")
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=0, help="attention heads (default dim // 128)")
    p.add_argument("--tokens", default="1024,4096", help="token counts, comma-separated (batch 1)")
    p.add_argument("--iters", type=int, default=20, help="timed forwards per variant (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards first (default 3)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"subset of {','.join(VARIANTS)} (default all)")
    p.add_argument("--trace", action="store_true",
                   help="profile 3 iterations of nccl, ce and bound on rank 0: copy/compute overlap, "
                        "idle gaps, per-gather account and timeline")
    p.add_argument("--budget", type=float, default=200.0,
                   help="soft time budget in s: no new variant starts after it (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefetch-mib", type=float, default=0.0,
                   help="prefetch_next_call_mib of the ce_prefetch variant (default 0: one "
                        "decoder layer's gathered weights)")
    p.add_argument("--peer-chunk-mib", type=float, default=1.0,
                   help="piece size of the ce_chunk variant's peer reads (default 1)")
    p.add_argument("--save-code", action="store_true",
                   help="also write rank 0's generated code of the CE variant (first token "
                        "count) to <out>/e2e_code_ce.py")
    C.add_common_args(p, timeout_s=300)
    a = p.parse_args(argv)
    if a.dim is None:
        a.dim = MODELS[a.model]["dim"] if a.model in MODELS else 4096
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out = os.path.abspath(args.out)
    bad = set(C.parse_list(args.variants, str)) - set(VARIANTS)
    if bad:
        print(f"torch-ce bench e2e: unknown variants {sorted(bad)}; known {VARIANTS}", flush=True)
        return 2
    return R.launch("torch-ce bench e2e", _worker, args,
                    banner=f"{describe(vars(args))}, tokens {args.tokens}, out {args.out}")


def name_gathers(traced: dict) -> None:
    """Each traced variant's gathers named by their weights: the placeholders of the code's
    gather calls through the CE variant's placeholder -> parameter map (the same graph
    inputs in every sharded variant; without it, the placeholder names)."""
    for per in traced.values():
        param_of = (per.get("ce") or {}).get("param_of") or {}
        for d in per.values():
            d["labels"] = [short_label([param_of.get(p, p) for p in args]) for args in d.get("args", [])]


def _worker(rank: int, world: int, a: dict) -> None:
    import warnings

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import torch_ce
    from torch_ce.runtime import native

    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated.*")
    cache_dir = fresh_caches(rank)
    dev = R.device()
    sg = R.status_group()
    mesh = init_device_mesh(dev.type, (world,))
    tag = C.gpu_tag()
    model = "" if a["model"] == "decoder" else f"{a['model']}_"
    path = os.path.join(a["out"], f"e2e_{model}{tag}_w{world}.json")
    env = C.env_info(world) if rank == 0 else None
    variants = [v for v in VARIANTS if v in C.parse_list(a["variants"], str)]
    tokens = C.parse_list(a["tokens"], int)
    C.log(f"[e2e] world {world}, device {env.get('gpu') if env else ''}, torch {torch.__version__}; "
          f"variants {variants}; inductor cache {cache_dir} (per rank); results -> {path}")
    result: dict = dict(bench="e2e", args=a, world_size=world, targets_text=TARGETS_TEXT, results={})
    if rank == 0:
        merge_previous(path, result, tokens)

    def save():
        if rank == 0:
            C.write_json(path, result, env)

    t_start = time.monotonic()
    traced: dict = {}  # rank 0: T -> variant -> compact trace and gather names (account.py)
    for T in tokens:
        a["_first_T"] = T == tokens[0]
        per: dict = dict(tokens=T)
        result["results"][str(T)] = per
        x = model_input(a, T, dev, a["seed"] + 17 * T)
        outs: dict = {}
        traced[T] = {}
        for name in variants:
            over = R.exchange(time.monotonic() - t_start > a["budget"], sg)
            if any(over):
                per[name] = dict(skipped=f"soft time budget of {a['budget']:.0f} s used up")
                C.log(f"[e2e] T={T} {name}: skipped (budget)")
                save()
                continue
            C.log(f"[e2e] T={T} {name}: building and compiling ...")
            err, rec, y = None, {}, None
            try:
                with native.peer_order_as(**peer_order_of(name, a)), \
                        native.split_local_copy_as(split_local_of(name)):
                    y = run_variant(name, a, x, mesh, rank, world, a["trace"] and name in TRACED, rec,
                                    traced[T].setdefault(name, {}))
            except Exception as e:  # noqa: BLE001
                err = C.short_error(e)
                C.log_all(f"[e2e] T={T} {name} FAILED: {e!r}")
            try:
                cleanup(torch, torch_ce)
            except Exception as e:  # noqa: BLE001
                C.log_all(f"[e2e] cleanup after {name} failed: {e!r}")
            err = R.agree_errors(err, sg)
            if err:
                rec = dict(rec, error=err)
            else:
                outs[name] = y
                all_ms = R.exchange(rec.get("ms"), sg)
                rec["ms_per_rank"] = all_ms
                # Ranks of a job step together: the slowest rank's median is the step time.
                rec["ms"] = max(all_ms)
                rec["cpu_issue_ms_per_rank"] = R.exchange(rec.get("cpu_issue_ms_per_forward"), sg)
                C.log(f"[e2e] T={T} {name}: {rec['ms']:.3f} ms / forward (slowest rank; per rank "
                      f"{rec['ms_per_rank']}, CPU issue {rec['cpu_issue_ms_per_rank']} ms)"
                      + (f"; reorder {rec['reorder']}" if rec.get("reorder") else ""))
                if rec.get("trace") and "error" in rec["trace"]:
                    C.log(f"[e2e]   trace FAILED: {rec['trace']['error'][:300]}")
                elif rec.get("trace"):
                    C.log(trace_line(rec["trace"]))
            per[name] = rec
            save()
        # Correctness: every output against the NCCL variant's (and the bound's), all ranks.
        checks = local_checks(outs)
        score(per, T, variants, checks, R.exchange(checks, sg))
        save()
        del x, outs
        gc.collect()
    import shutil

    shutil.rmtree(cache_dir, ignore_errors=True)
    if rank == 0 and any(d.get("events") for per in traced.values() for d in per.values()):
        name_gathers(traced)
        acct, png = write_account(a["out"], traced, world, a["model"])
        C.log(f"[e2e] per-gather account: {acct}" + (f", timeline {png}" if png else ""))
    if rank == 0:
        print_summary(result, variants)
        png = C.save_png(path[:-5] + ".png", lambda plt: draw(plt, result, variants, tag, world))
        if png:
            result["png"] = png
            save()
        print(f"[e2e] wrote {path}" + (f" and {png}" if png else ""), flush=True)
