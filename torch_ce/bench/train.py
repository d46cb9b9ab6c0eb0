"""``torch-ce bench train``: SimpleFSDP training steps, NCCL vs copy-engine weight gathers.

torchtitan's own architecture (``--model llama3_8b``: the zoo's layers, GQA, the
full-vocabulary embedding and LM head; zoo.py says how it is isolated from the zoo's
training imports), the first ``--layers`` blocks, fp32 weights under SimpleFSDP
``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=--param-dtype, reduce_dtype=--reduce-dtype)``,
AdamW (foreach), next-token cross entropy on ``--tokens`` random tokens per rank (batch 1),
compiled with plain ``torch.compile``. Two variants, each a fresh compile of a fresh model
built from the same seed, both with FSDP's reshard after forward (the backward gathers each
weight again; NOTE [reshard after forward] in passes/reshard.py):

  nccl     torch_ce.enable(transport="nccl", reshard_after_forward=True)
  ce       torch_ce.enable(transport="copy_engine")   forward and backward gathers on the
           copy engines, staged slots refreshed between two step fences (runtime/staging.py);
           the gradient reduce-scatters on NCCL
  ce_rs    the same with reduce_scatter="copy_engine": the reduce-scatters pushed into the
           peers' workspaces too (NOTE [copy-engine reduce-scatter]), no NCCL kernel left
  nccl_lc  (``--variants``, torch >= 2.14) NCCL gathers, and Inductor's low-contention
           collectives (``aten_distributed_optimizations.enable_low_contention_collectives``,
           every size): its barrier + copy-engine reduce-scatter

``--variants`` picks (default ``nccl,ce,ce_rs``). Then each again as ``<variant>_det`` under
``torch.use_deterministic_algorithms(True)``: GPU training kernels are not bit-reproducible
by default (two NCCL runs differ in the 5th digit: atomics in the embedding backward, say),
so the loss check compares each deterministic run with ``nccl_det``, step by step, bit for
bit at 2 ranks; the timed runs are in the default mode. Reports ms per training step (median of per-step CUDA events
around forward + backward + optimizer step), CE/NCCL, every step's loss, peak allocated
memory per variant, and the staging
memory (windows reserved and filled) against the statement (one slot per gathered weight in
param_dtype: the local shards' numel x its size). Writes
``<out>/train_<model>_<gpu>_w<world>.json`` and ``.png`` (step times, losses).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from . import common as C
from . import ranks as R
from .e2e_variant import cleanup, fresh_caches
from .zoo import MODELS

VARIANTS = ("nccl", "ce", "ce_rs")  # timed, by default
KNOWN = VARIANTS + ("nccl_lc",)
TARGET = 0.90  # CE/NCCL step time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torch-ce bench train",
                                description="SimpleFSDP training steps: NCCL vs copy-engine weight gathers. "
                                            f"Target: CE/NCCL step time <= {TARGET}")
    p.add_argument("--model", choices=tuple(MODELS), default="llama3_8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=0, help="model width (default: the flavour's)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary (default: the flavour's)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step (batch 1)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--param-dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--reduce-dtype", choices=("bf16", "fp32"), default="fp32",
                   help="gradient reduce-scatter dtype (default fp32, torchtitan's default)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, nccl first (known: {','.join(KNOWN)}; default {','.join(VARIANTS)})")
    C.add_common_args(p, timeout_s=580)
    a = p.parse_args(argv)
    names = [v for v in a.variants.split(",") if v]
    bad = [v for v in names if v not in KNOWN]
    if bad or not names or names[0] != "nccl":
        p.error(f"--variants {a.variants!r}: known {KNOWN}, nccl first (every ratio is against it)")
    a.variants = names
    return a


def _checked(names) -> list:
    """The deterministic runs of ``names`` (the bit-for-bit loss check)."""
    return [f"{n}_det" for n in names]


def main(argv=None) -> int:
    a = parse_args(argv)
    a.out = os.path.abspath(a.out)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (the _det pair)
    return R.launch("torch-ce bench train", _worker, a,
                    banner=f"{a.model}, {a.layers} layers, {a.tokens} tokens, param_dtype {a.param_dtype}, "
                           f"reduce_dtype {a.reduce_dtype}, {a.steps} steps, out {a.out}")


def _staging_statement(model, dtype) -> int:
    """Bytes the staging slots should take: every gathered weight's local shard in
    param_dtype, each slot 512-byte aligned (NOTE [training: staged windows and step fences] in
    runtime/staging.py)."""
    from ..runtime import windows as W

    return sum(W.align_up(p._local_tensor.numel() * dtype.itemsize) for p in model.parameters())


def _windows_bytes() -> tuple[int, int]:
    from ..runtime import window_pools as WP

    ws = [w for pool in WP.pools().values() for w in pool.windows]
    return sum(w.nbytes for w in ws), sum(w.used for w in ws)


def _run(name: str, a: dict, dev, mesh, tokens):
    import torch

    import torch_ce
    from . import zoo

    torch._dynamo.reset()
    # warn_only=False: cuDNN attention's backward picks its deterministic algorithm only then
    # (with warn_only=True it warns and stays non-deterministic).
    torch.use_deterministic_algorithms(name.endswith("_det"), warn_only=False)
    pd = torch.bfloat16 if a["param_dtype"] == "bf16" else None
    rd = torch.bfloat16 if a["reduce_dtype"] == "bf16" else torch.float32
    model = zoo.build_for_training(a, dev, a["seed"], mesh, pd, rd)
    opt = torch.optim.AdamW(model.parameters(), lr=a["lr"], foreach=True)
    base = name.removesuffix("_det")
    lc = _low_contention(torch) if base == "nccl_lc" else None
    if base.startswith("nccl"):
        torch_ce.enable(transport="nccl", reshard_after_forward=True)
    else:
        torch_ce.enable(transport="copy_engine", reduce_scatter="copy_engine" if base == "ce_rs" else "collective")
    if lc is not None:
        lc.__enter__()
    compiled = torch.compile(model)
    if R.is_cuda():
        torch.cuda.reset_peak_memory_stats(dev)
    losses, times = [], []
    t0 = time.monotonic()
    for i in range(a["warmup"] + a["steps"]):
        x = tokens[i % len(tokens)]
        start = torch.cuda.Event(enable_timing=True) if R.is_cuda() else None
        end = torch.cuda.Event(enable_timing=True) if R.is_cuda() else None
        t = time.perf_counter()
        if start is not None:
            start.record()
        loss = zoo.next_token_loss(compiled(x[:, :-1]), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if end is not None:
            end.record()
        value = loss.item()  # syncs
        ms = start.elapsed_time(end) if start is not None else (time.perf_counter() - t) * 1e3
        if i == 0:
            C.log(f"{name}: first step (compile) {time.monotonic() - t0:.0f} s")
        losses.append(value)  # every step, the warm-up ones included
        if i >= a["warmup"]:
            times.append(ms)
    if lc is not None:
        lc.__exit__(None, None, None)
    out = dict(ms=statistics.median(times), ms_all=[round(t, 3) for t in times], losses=losses)
    if R.is_cuda():
        out["peak_alloc_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if name in ("ce", "ce_rs"):  # (before cleanup: it releases the windows)
        reserved, used = _windows_bytes()
        e = torch_ce.explain()
        rs = e.reduce_scatter_coverage()
        out.update(windows_reserved=reserved, windows_used=used,
                   staging_statement=_staging_statement(model, pd or torch.float32),
                   rs_share=rs["share"], rs_workspace_bytes=sum(rs["workspace_bytes"].values()),
                   explain=e.table().splitlines()[:6])
    cleanup(torch, torch_ce)
    torch.use_deterministic_algorithms(False)
    del model, opt, compiled
    return out


def _low_contention(torch):
    """Inductor's low-contention collectives at every size (a config patch), or an error
    naming what this torch lacks."""
    import torch._inductor.config as ic

    opts = getattr(ic, "aten_distributed_optimizations", None)
    if opts is None or not hasattr(opts, "enable_low_contention_collectives"):
        raise RuntimeError(f"nccl_lc: torch {torch.__version__} has no Inductor low-contention collectives "
                           "(aten_distributed_optimizations.enable_low_contention_collectives, torch >= 2.14)")
    return ic.patch({"aten_distributed_optimizations.enable_overlap_scheduling": True,
                     "aten_distributed_optimizations.enable_low_contention_collectives": True,
                     "aten_distributed_optimizations.low_contention_min_bytes_per_rank": 0})


def _worker(rank: int, world: int, a: dict) -> None:
    import warnings

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import torch_ce

    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated.*")
    fresh_caches(rank)
    dev = R.device()
    mesh = init_device_mesh(dev.type, (world,))
    V = a["vocab"] or MODELS[a["model"]]["vocab"]
    g = torch.Generator(device=dev).manual_seed(a["seed"] + 1000 + rank)  # data differs per rank
    tokens = [torch.randint(0, V, (1, a["tokens"] + 1), device=dev, generator=g) for _ in range(4)]
    res = {}
    names, checked = a["variants"], _checked(a["variants"])
    for name in names + checked:
        try:
            res[name] = _run(name, a, dev, mesh, tokens)
        except RuntimeError as e:  # a kernel without a deterministic implementation, say
            if name not in checked:
                raise
            C.log(f"{name}: failed: {C.short_error(e)}")
            res[name] = dict(ms=float("nan"), losses=[], error=C.short_error(e))
            cleanup(torch, torch_ce)
            torch.use_deterministic_algorithms(False)
        C.log(f"{name}: {res[name]['ms']:.2f} ms/step")
    everyone = R.exchange(res, R.status_group())
    if rank != 0:
        return
    others = [n for n in names if n != "nccl"]
    ratios = {n: max(r[n]["ms"] / r["nccl"]["ms"] for r in everyone) for n in others}
    same = {n: all(bool(r[f"{n}_det"]["losses"]) and r[f"{n}_det"]["losses"] == r["nccl_det"]["losses"]
                   for r in everyone) for n in others}
    timed_diff = {n: max(abs(x - y) for r in everyone for x, y in zip(r[n]["losses"], r["nccl"]["losses"], strict=True))
                  for n in others}
    ce0 = everyone[0].get("ce") or everyone[0].get("ce_rs") or {}
    payload = dict(args=a, world=world, per_rank=everyone, over_nccl=ratios,
                   ce_over_nccl=ratios.get("ce"), losses_identical=same,
                   timed_max_loss_diff=timed_diff,
                   targets=[C.target(f"{n}/NCCL training step time", ratios[n], "<=", TARGET)
                            for n in others if n.startswith("ce")])
    tag = C.gpu_tag()
    suffix = "" if (a["tokens"], a["param_dtype"], a["reduce_dtype"]) == (2048, "bf16", "fp32") else \
        f"_{a['tokens']}_{a['param_dtype']}_{a['reduce_dtype']}"
    path = os.path.join(a["out"], f"train_{a['model']}{suffix}_{tag}_w{world}.json")
    C.write_json(path, payload, C.env_info(world))
    C.save_png(path[:-5] + ".png", lambda plt: _draw(plt, everyone, a))
    rows = [[name, f"{everyone[0][name]['ms']:.2f}", f"{everyone[0][name].get('peak_alloc_gib', 0):.2f}",
             f"{everyone[0][name].get('rs_workspace_bytes', 0) / 2**20:.1f}"]
            for name in names + checked]
    print(C.format_table(["variant", "ms/step (rank 0)", "peak alloc GiB", "RS workspace MiB"], rows), flush=True)
    for n in others:
        print(f"{n}/NCCL (worst rank): {ratios[n]:.3f}; {n}_det's losses identical to nccl_det's on every "
              f"rank over {a['warmup'] + a['steps']} steps: {same[n]} (timed: max |diff| {timed_diff[n]:.2e})",
              flush=True)
    if ce0:
        print(f"staging: statement {ce0['staging_statement'] / 2**20:.1f} MiB, windows filled "
              f"{ce0['windows_used'] / 2**20:.1f} MiB, reserved {ce0['windows_reserved'] / 2**20:.1f} MiB; "
              f"peak allocated CE - NCCL {(ce0.get('peak_alloc_gib', 0) - everyone[0]['nccl'].get('peak_alloc_gib', 0)) * 1024:.1f} MiB "
              "(windows and reduce-scatter workspaces are outside the caching allocator)", flush=True)
    for t in payload["targets"]:
        print(C.format_target(t), flush=True)
    print(f"wrote {path}", flush=True)


def _draw(plt, everyone, a):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    r0 = everyone[0]
    names = list(a["variants"])
    ax1.bar(names, [r0[n]["ms"] for n in names], color=["#888888", "#2a7ab9", "#3fa34d", "#c0792a"][:len(names)])
    for i, n in enumerate(names):
        ax1.text(i, r0[n]["ms"], f"{r0[n]['ms']:.1f} ms", ha="center", va="bottom")
    ax1.set_ylabel("ms per training step (median, rank 0)")
    ax1.set_title(f"{a['model']} {a['layers']} layers, {a['tokens']} tokens, {a['param_dtype']}")
    for k, n in enumerate(names + _checked(names)):
        ax2.plot(r0[n]["losses"], ("-", "--", ":", "-.")[k % 4], label=n)
    ax2.set_xlabel("step")
    ax2.set_ylabel("loss (rank 0)")
    ax2.set_title("losses (must coincide)")
    ax2.legend()
    return fig
