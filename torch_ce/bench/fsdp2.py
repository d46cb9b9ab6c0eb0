"""``torch-ce bench fsdp2``: FSDP2 (``fully_shard``) with torch_ce's all-gathers (and
reduce-scatter) against FSDP2's own collectives, in one run on every visible GPU.

Models, each the first ``--layers`` / ``--blocks`` of:

  llama3_8b  torchtitan's Llama3 8B (the zoo's layers, GQA, the full-vocabulary embedding
             and LM head; zoo.py), SDPA, next-token cross entropy
  wan_dit    a Wan-style DiT block (``WanBlock``: dim 5120, 40 heads, ffn 13824, RMS q/k norms,
             adaLN modulation from the timestep, cross-attention to a 512-token text context;
             Wan2.1-14B's shapes), a flow-matching MSE

each block ``fully_shard``ed, then the root (embeddings, norm, head), as torchtitan's trainer
shards them. Modes:

  inference  bf16 weights, no grads: ms per forward (median), the output compared bit for
             bit with FSDP2's default on the same weights and input
  training   fp32 weights, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
             AdamW: ms per step (forward + backward + optimizer step, median), every step's
             loss compared with FSDP2's default, bit for bit (under
             ``torch.use_deterministic_algorithms``; ``--no-deterministic``: without)

Variants (``--variants``, fsdp2 first: every ratio is against it, the same run):

  fsdp2     FSDP2's default all-gather and reduce-scatter (NCCL)
  symm_mem  ``FSDPModule.set_symm_mem_for_comm()`` (torch >= 2.12, CUDA): the all-gather output
            in symmetric memory, on an NCCL group with the zero-CTA policy (NCCL's copy-engine
            all-gather); skipped with the reason elsewhere
  ce        ``torch_ce.fsdp2.enable(model)``: the gathers on the copy engines
  ce_rs     ``torch_ce.fsdp2.enable(model, reduce_scatter="copy_engine")`` (training only)

Writes ``<out>/fsdp2_<gpu>_w<world>.json`` and ``.png``; prints a table and each ratio.
``--device cpu`` is a smoke run on 2 gloo ranks (host transport) with the tiny dims it is
given (the numbers mean nothing).

``--loopback`` (one process, one GPU): the host cost per call of torch_ce's FSDP2 all-gather
hook (``torch_ce.fsdp2.comm.CopyEngineAllGather``, called as FSDP2 calls it) on a loopback
slot (the "peer" chunk a second local tensor: symmetric memory refuses two ranks on one
device, and a static call's host work does not depend on where the peer copy lives) next to
NCCL's ``all_gather_into_tensor`` on a one-rank group, per chunk size; on CUDA also the
training hook (the step words' call, NOTE [FSDP2 step words on CUDA]) at a simulated world
of 2 (``loopback_training_comms``). Writes ``<out>/fsdp2_loopback_<gpu>.json``. With
``--device cpu``: the host transport and gloo.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time

from . import common as C
from . import ranks as R

MODELS = ("llama3_8b", "wan_dit")
MODES = ("inference", "training")
VARIANTS = ("fsdp2", "symm_mem", "ce", "ce_rs")
# Wan2.1-14B's block (its config: dim 5120, ffn 13824, 40 heads; text context 512 tokens)
WAN = dict(dim=5120, heads=40, ffn=13824, ctx=512, in_dim=64)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torch-ce bench fsdp2",
                                description="FSDP2 (fully_shard): FSDP2's default vs set_symm_mem_for_comm vs "
                                            "torch_ce's gathers (and reduce-scatter), inference and training")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated ({','.join(MODELS)})")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated ({','.join(MODES)})")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, fsdp2 first (known: {','.join(VARIANTS)})")
    p.add_argument("--layers", type=int, default=4, help="Llama3 blocks (default 4)")
    p.add_argument("--blocks", type=int, default=4, help="DiT blocks (default 4)")
    p.add_argument("--dim", type=int, default=0, help="model width, both models (default: the real one)")
    p.add_argument("--vocab", type=int, default=0, help="Llama3 vocabulary (default: the flavour's)")
    p.add_argument("--ctx", type=int, default=WAN["ctx"], help="DiT text-context tokens (default 512)")
    p.add_argument("--tokens", type=int, default=4096,
                   help="tokens per rank per forward (Llama3: sequence length; DiT: video tokens)")
    p.add_argument("--steps", type=int, default=10, help="timed forwards / steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed ones first")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                   help="training without torch.use_deterministic_algorithms (GPU backward kernels are "
                        "then not bit-reproducible, and losses cannot be compared bit for bit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loopback", action="store_true",
                   help="one GPU: host cost per call of the all-gather hook vs NCCL's (module doc)")
    p.add_argument("--sizes-mib", default="0.0625,1,4",
                   help="--loopback chunk sizes, MiB (small: the timed loop must stay host-bound)")
    p.add_argument("--calls", type=int, default=500, help="--loopback calls timed per size")
    C.add_common_args(p, timeout_s=580)
    a = p.parse_args(argv)
    for field, known in (("models", MODELS), ("modes", MODES), ("variants", VARIANTS)):
        names = [v for v in getattr(a, field).split(",") if v]
        bad = [v for v in names if v not in known]
        if bad or not names:
            p.error(f"--{field} {getattr(a, field)!r}: known {','.join(known)}")
        setattr(a, field, names)
    if a.variants[0] != "fsdp2":
        p.error(f"--variants {','.join(a.variants)}: fsdp2 first (every ratio is against it)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    a.out = os.path.abspath(a.out)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (training)
    if a.loopback:
        return loopback(a)
    return R.launch("torch-ce bench fsdp2", _worker, a,
                    banner=f"{','.join(a.models)} x {','.join(a.modes)}: {','.join(a.variants)}; "
                           f"{a.tokens} tokens, {a.steps} steps, out {a.out}")


# ---------------------------------------------------------------------------------------
# The Wan-style DiT block
# ---------------------------------------------------------------------------------------


def _dit_classes():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, dim, heads, kv_dim=None):
            super().__init__()
            self.heads = heads
            self.q, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.k, self.v = nn.Linear(kv_dim or dim, dim), nn.Linear(kv_dim or dim, dim)
            self.norm_q, self.norm_k = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)

        def forward(self, x, ctx):
            b, n, d = x.shape
            split = lambda t: t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
            q, k = split(self.norm_q(self.q(x))), split(self.norm_k(self.k(ctx)))
            out = F.scaled_dot_product_attention(q, k, split(self.v(ctx)))
            return self.o(out.transpose(1, 2).reshape(b, n, d))

    class WanBlock(nn.Module):
        """Wan's attention block: adaLN (6 x dim from the timestep embedding plus a learned
        table) around self-attention, cross-attention to the text context, a GELU FFN."""

        def __init__(self, dim, heads, ffn):
            super().__init__()
            self.norm1 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
            self.self_attn = Attention(dim, heads)
            self.norm3 = nn.LayerNorm(dim, eps=1e-6)
            self.cross_attn = Attention(dim, heads)
            self.norm2 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
            self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, dim))
            self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)

        def forward(self, x, ctx, e):
            shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation + e).chunk(6, dim=1)
            h = self.norm1(x) * (1 + scale1) + shift1
            x = x + gate1 * self.self_attn(h, h)
            x = x + self.cross_attn(self.norm3(x), ctx)
            h = self.norm2(x) * (1 + scale2) + shift2
            return x + gate2 * self.ffn(h)

    class WanDiT(nn.Module):
        """Patch embedding, the timestep's 6 x dim modulation, ``blocks`` WanBlocks, a head."""

        def __init__(self, dim, heads, ffn, blocks, in_dim):
            super().__init__()
            self.patch = nn.Linear(in_dim, dim)
            self.time = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, 6 * dim))
            self.blocks = nn.ModuleList(WanBlock(dim, heads, ffn) for _ in range(blocks))
            self.head = nn.Linear(dim, in_dim)

        def forward(self, x, ctx, t):
            freqs = torch.exp(-math.log(10000.0) * torch.arange(128, device=t.device) / 128)
            emb = torch.cat([torch.cos(t[:, None] * freqs), torch.sin(t[:, None] * freqs)], dim=1)
            e = self.time(emb.to(self.patch.weight.dtype)).unflatten(1, (6, -1))
            h = self.patch(x)
            for b in self.blocks:
                h = b(h, ctx, e)
            return self.head(h)

    return WanBlock, WanDiT


def dit_dims(a: dict) -> dict:
    """Wan's dims, or ``--dim``'s: heads of 128 (at least one), the FFN scaled alike."""
    d = a["dim"] or WAN["dim"]
    if d == WAN["dim"]:
        return dict(dim=d, heads=WAN["heads"], ffn=WAN["ffn"])
    return dict(dim=d, heads=max(1, d // 128), ffn=max(16, int(WAN["ffn"] * d / WAN["dim"]) // 16 * 16))


# ---------------------------------------------------------------------------------------
# One variant of one (model, mode)
# ---------------------------------------------------------------------------------------


def _build(model: str, mode: str, a: dict, dev, mesh):
    """The model from ``a["seed"]`` (the same weights in every variant and on every rank),
    ``fully_shard``ed block by block, then the root."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(a["seed"])
    if dev.type == "cuda":
        torch.cuda.manual_seed(a["seed"])
    if model == "llama3_8b":
        from . import zoo

        net = zoo._initialised(dict(model=model, layers=a["layers"], dim=a["dim"], vocab=a["vocab"]), dev, a["seed"])
        blocks = list(net.layers.values())
    else:
        _, WanDiT = _dit_classes()
        with torch.device(dev):
            net = WanDiT(blocks=a["blocks"], in_dim=WAN["in_dim"], **dit_dims(a))
        blocks = list(net.blocks)
    mp = None
    if mode == "inference":
        for p in net.parameters():  # stored in the compute dtype (not net.to(): Llama's RoPE is complex)
            p.data = p.data.to(torch.bfloat16)
            p.requires_grad_(False)
        net.eval()
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        net.train()
    for b in blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    fully_shard(net, mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    return net


def _inputs(model: str, a: dict, dev, rank: int, count: int) -> list:
    """``count`` inputs of this rank (each rank its own), and a target for the DiT."""
    import torch

    g = torch.Generator(device=dev).manual_seed(a["seed"] + 1000 + rank)
    out = []
    for _ in range(count):
        if model == "llama3_8b":
            from .zoo import MODELS as ZOO

            V = a["vocab"] or ZOO[model]["vocab"]
            out.append((torch.randint(0, V, (1, a["tokens"] + 1), device=dev, generator=g),))
        else:
            d = dit_dims(a)["dim"]
            out.append((torch.randn(1, a["tokens"], WAN["in_dim"], device=dev, generator=g),
                        torch.randn(1, a["ctx"], d, device=dev, generator=g),
                        torch.rand(1, device=dev, generator=g) * 1000,
                        torch.randn(1, a["tokens"], WAN["in_dim"], device=dev, generator=g)))
    return out


def _forward(model: str, net, inp, dtype):
    if model == "llama3_8b":
        return net(inp[0][:, :-1])
    x, ctx, t, _ = inp
    return net(x.to(dtype), ctx.to(dtype), t)


def _loss(model: str, out, inp):
    if model == "llama3_8b":
        from .zoo import next_token_loss

        return next_token_loss(out, inp[0])
    return (out.float() - inp[3]).pow(2).mean()


def symm_mem_refusal(torch, dev) -> str:
    """Why ``set_symm_mem_for_comm`` cannot run here ("" where it can)."""
    from torch.distributed.fsdp import FSDPModule

    if dev.type != "cuda":
        return "set_symm_mem_for_comm needs CUDA and NCCL"
    if not hasattr(FSDPModule, "set_symm_mem_for_comm"):
        return f"torch {torch.__version__} has no FSDPModule.set_symm_mem_for_comm (torch >= 2.12)"
    return ""


def _symm_mem_mesh(torch, dev):
    """A 1-D mesh over an NCCL group with the zero-CTA policy (NCCL's copy-engine
    all-gather, as ``set_symm_mem_for_comm``'s docstring asks), where this torch has it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    opts = dist.ProcessGroupNCCL.Options()
    zero = getattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO", None)
    if zero is not None:
        opts.config.cta_policy = zero
    pg = dist.new_group(backend="nccl", pg_options=opts)
    return DeviceMesh.from_group(pg, dev.type), zero is not None


def _run(model: str, mode: str, name: str, a: dict, dev, mesh, inputs) -> dict:
    import torch
    from torch.distributed.fsdp import FSDPModule

    import torch_ce
    from .e2e_variant import cleanup

    out: dict = {}
    if name == "symm_mem":
        why = symm_mem_refusal(torch, dev)
        if why:
            return dict(skipped=why)
        mesh, zero_cta = _symm_mem_mesh(torch, dev)
        out["zero_cta"] = zero_cta
    if name == "ce_rs" and mode != "training":
        return dict(skipped="no reduce-scatter in inference")
    net = _build(model, mode, a, dev, mesh)
    if name == "symm_mem":
        for m in net.modules():
            if isinstance(m, FSDPModule):
                m.set_symm_mem_for_comm()
    elif name in ("ce", "ce_rs"):
        from ..runtime import reduce_scatter as RS

        before = {k: (v.ce_bytes, v.collective_bytes) for k, v in RS.served.items()}
        rows = torch_ce.fsdp2.enable(net, reduce_scatter="copy_engine" if name == "ce_rs" else "collective")
    opt = torch.optim.AdamW(net.parameters(), lr=a["lr"], foreach=dev.type == "cuda") if mode == "training" else None
    dtype = torch.bfloat16 if mode == "inference" else torch.float32
    # Training: deterministic kernels (warn_only=False: cuDNN attention's backward picks its
    # deterministic algorithm only then), so every variant's losses can equal FSDP2's bit for bit.
    torch.use_deterministic_algorithms(opt is not None and a["deterministic"], warn_only=False)
    times, losses, first = [], [], None
    for i in range(a["warmup"] + a["steps"]):
        inp = inputs[i % len(inputs)]
        cuda = dev.type == "cuda"
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        t = time.perf_counter()
        if start is not None:
            start.record()
        if opt is None:
            with torch.no_grad():
                y = _forward(model, net, inp, dtype)
        else:
            loss = _loss(model, _forward(model, net, inp, dtype), inp)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if end is not None:
            end.record()
            end.synchronize()
        ms = start.elapsed_time(end) if start is not None else (time.perf_counter() - t) * 1e3
        if opt is None:
            if i == 0:
                first = y.detach().clone()
        else:
            losses.append(loss.item())
        if i >= a["warmup"]:
            times.append(ms)
    out.update(ms=statistics.median(times), ms_all=[round(t, 3) for t in times])
    if opt is None:
        out["output"] = first
    else:
        out["losses"] = losses
    if dev.type == "cuda":
        out["peak_alloc_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if name in ("ce", "ce_rs"):
        rows = torch_ce.fsdp2.rows()[-len(rows):]
        cov = torch_ce.fsdp2.coverage(rows)
        out.update(gather_share=cov["share"], refused={r.module: r.reason for r in rows if r.reason},
                   reduce_scatter=sorted({r.reduce_scatter for r in rows if r.reduce_scatter}))
        if name == "ce_rs":
            rs = {k: v for k, v in torch_ce.explain().reduce_scatter_coverage()["served"].items()
                  if k.startswith("fsdp2 ")}  # this run's: less what earlier runs left
            out["rs_ce_bytes"] = sum(v["ce_bytes"] - before.get(k, (0, 0))[0] for k, v in rs.items())
            out["rs_collective_bytes"] = sum(v["collective_bytes"] - before.get(k, (0, 0))[1] for k, v in rs.items())
            out["rs_reasons"] = sorted({v["reason"] for v in rs.values() if v["reason"]})
        torch_ce.fsdp2.disable(net)
    del net, opt
    torch.use_deterministic_algorithms(False)
    cleanup(torch, torch_ce)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    return out


def _worker(rank: int, world: int, a: dict) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .e2e_variant import fresh_caches

    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated.*")
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # the head's output: read only
    fresh_caches(rank)
    dev = R.device()
    mesh = init_device_mesh(dev.type, (world,))
    res: dict = {}
    for model in a["models"]:
        inputs = _inputs(model, a, dev, rank, 3)
        for mode in a["modes"]:
            key = f"{model}/{mode}"
            res[key] = {}
            ref = None
            for name in a["variants"]:
                try:
                    r = _run(model, mode, name, a, dev, mesh, inputs)
                except Exception as e:  # noqa: BLE001 (one variant's failure is a row, the rest run)
                    r = dict(error=C.short_error(e))
                    torch.use_deterministic_algorithms(False)
                    dist.barrier()
                if "output" in r:  # compared here: tensors do not travel
                    out = r.pop("output")
                    if name == "fsdp2":
                        ref = out
                    r["exact"] = ref is not None and bool(torch.equal(out, ref))
                    r["max_abs_diff"] = float((out.float() - ref.float()).abs().max()) if ref is not None else None
                res[key][name] = r
                what = f"{r['ms']:.2f} ms" if "ms" in r else r.get("skipped") or r.get("error", "")
                C.log(f"{key} {name}: {what}")
    everyone = R.exchange(res, R.status_group())
    if rank != 0:
        return
    _report(a, world, everyone)


def summarize(a: dict, everyone: list) -> dict:
    """Per (model/mode, variant): rank 0's ms, the worst rank's ratio to fsdp2, whether every
    rank's results equal fsdp2's (outputs bit for bit; losses step by step)."""
    out = {}
    for key, per in everyone[0].items():
        for name, r0 in per.items():
            row = dict(ms=r0.get("ms"), skipped=r0.get("skipped", ""), error=r0.get("error", ""))
            base = [r[key].get("fsdp2", {}) for r in everyone]
            if "ms" in r0 and all("ms" in b for b in base):
                row["over_fsdp2"] = max(r[key][name]["ms"] / b["ms"] for r, b in zip(everyone, base, strict=True))
            if "exact" in r0:
                row["equal"] = all(r[key][name].get("exact") for r in everyone)
            elif "losses" in r0:
                row["equal"] = all(r[key][name].get("losses") == b.get("losses")
                                   for r, b in zip(everyone, base, strict=True))
                row["max_loss_diff"] = max((abs(x - y) for r, b in zip(everyone, base, strict=True)
                                            for x, y in zip(r[key][name]["losses"], b.get("losses", []))), default=None)
            for k in ("gather_share", "rs_ce_bytes", "rs_collective_bytes", "rs_reasons", "refused", "zero_cta"):
                if k in r0:
                    row[k] = r0[k]
            out[f"{key}/{name}"] = row
    return out


def _report(a: dict, world: int, everyone: list) -> None:
    rows = summarize(a, everyone)
    payload = dict(args=a, world=world, per_rank=everyone, summary=rows)
    path = os.path.join(a["out"], f"fsdp2_{C.gpu_tag()}_w{world}.json")
    C.write_json(path, payload, C.env_info(world))
    C.save_png(path[:-5] + ".png", lambda plt: _draw(plt, rows))
    table = []
    for k, r in rows.items():
        ms = "" if r["ms"] is None else f"{r['ms']:.2f}"
        ratio = "" if r.get("over_fsdp2") is None else f"{r['over_fsdp2']:.3f}"
        note = r["skipped"] or r["error"][:60]
        if "gather_share" in r:
            note = f"gathers {100 * (r['gather_share'] or 0):.0f}% CE" + (
                f", RS {r['rs_ce_bytes']:,d} B CE / {r['rs_collective_bytes']:,d} B coll" if "rs_ce_bytes" in r else "")
            if r.get("refused"):  # why a group kept FSDP2's all-gather (one reason shown)
                note += f"; kept: {sorted(set(r['refused'].values()))[0][:70]}"
        table.append([k, ms, ratio, {True: "yes", False: "NO", None: ""}[r.get("equal")], note])
    print(C.format_table(["model/mode/variant", "ms (rank 0)", "/fsdp2 (worst rank)", "equal", "notes"], table),
          flush=True)
    print(f"wrote {path}", flush=True)


def _draw(plt, rows: dict):
    keys = sorted({k.rsplit("/", 1)[0] for k in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        names = [k.rsplit("/", 1)[1] for k in rows if k.startswith(key + "/") and rows[k]["ms"] is not None]
        ms = [rows[f"{key}/{n}"]["ms"] for n in names]
        ax.bar(names, ms, color=["#888888", "#c0792a", "#2a7ab9", "#3fa34d"][:len(names)])
        for i, v in enumerate(ms):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom")
        ax.set_title(key)
        ax.set_ylabel("ms (median, rank 0)")
    return fig


# ---------------------------------------------------------------------------------------
# --loopback: host cost per call on one device
# ---------------------------------------------------------------------------------------


def loopback_comm(mine, peer):
    """torch_ce's FSDP2 all-gather over a loopback slot: a 2-rank window whose other rank's
    copy is the local tensor ``peer`` (test/cuda_helpers.register_loopback's construction),
    static (no signal per call). Its ranks are the one-rank group's (the group FSDP2 would
    pass cannot be the pair the slot names); the rest of its checks run per call."""
    import torch
    import torch.distributed as dist

    from ..fsdp2.chunks import Bound
    from ..fsdp2.comm import CopyEngineAllGather
    from ..fsdp2.groups import Group
    from ..runtime import windows as W

    group = dist.group.WORLD
    nbytes = mine.numel() * mine.element_size()
    w = W.Window(("loopback", group.group_name), 0, nbytes, group, (0, 1), 0, mine.device,
                 mine.view(-1).view(torch.uint8), used=nbytes)
    slot = W.Slot(w, 0, nbytes, tuple(mine.shape), mine.dtype, "loopback")
    slot.peer_ptrs = [mine.data_ptr(), peer.data_ptr()]
    slot.peer_views = [mine, peer]
    g = Group("loopback", None, None, mode="static", numel=mine.numel(), dtype=mine.dtype)

    comm = CopyEngineAllGather(g, Bound(slot, mine), 60.0)
    comm.ranks = tuple(dist.get_process_group_ranks(group))  # the one-rank group FSDP2 would pass
    return comm


def loopback_training_comms(buffers: list, words: list | None = None) -> list:
    """torch_ce's FSDP2 all-gather of a training group, one comm per simulated rank of a
    ``len(buffers)``-rank group on one device (NOTE [FSDP2 training: step words]): rank
    i's staging buffer is ``buffers[i]``, its peers read the others; the step words are
    ``words[i]`` (int32 [2] each; default: pinned host memory, which a CUDA stream can
    wait on at its own address). Call them as FSDP2 would, each rank on a stream of its
    own: the steps' waits then order them as they order ranks."""
    import types

    import torch
    import torch.distributed as dist

    from ..fsdp2.chunks import Bound
    from ..fsdp2.comm import CopyEngineAllGather
    from ..fsdp2.groups import Group
    from ..runtime import windows as W

    world, x = len(buffers), buffers[0]
    if words is None:
        words = [torch.zeros(2, dtype=torch.int32, pin_memory=x.is_cuda) for _ in range(world)]
    group = dist.group.WORLD
    nbytes = x.numel() * x.element_size()
    comms = []
    for i, mine in enumerate(buffers):
        w = W.Window(("loopback", group.group_name), 0, nbytes, group, tuple(range(world)), i, mine.device,
                     mine.view(-1).view(torch.uint8), used=nbytes)
        slot = W.Slot(w, 0, nbytes, tuple(mine.shape), mine.dtype, "loopback")
        slot.peer_views = list(buffers)
        g = Group("loopback training", None, None, mode="staged", numel=mine.numel(), dtype=mine.dtype)
        comm = CopyEngineAllGather(g, Bound(slot, mine, types.SimpleNamespace(peer_views=words)), 60.0)
        comm._group_ok = group  # the one-rank group FSDP2 would pass cannot be the simulated one
        comms.append(comm)
    return comms


def _per_call_us(fn, calls: int, cuda: bool) -> float:
    import torch

    for _ in range(20):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6  # host time: the loop does not wait for the device
    if cuda:
        torch.cuda.synchronize()
    return us


def _training_loopback(n: int, dev, calls: int, group) -> tuple:
    """Host time per call of the training hook (NOTE [FSDP2 step words on CUDA]) at a
    simulated world of 2 on one GPU: the two ranks' calls alternate, each on its own
    stream, as FSDP2 calls them; then the last gathers checked exact. The simulated ranks'
    stream switches are timed alone too: FSDP2 calls every hook, NCCL's included, inside
    its all-gather stream already, so the comparison with NCCL's call takes them out.
    (us with the switches, the switches' us, exact)."""
    import torch

    bufs = [torch.empty(n, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    comms = loopback_training_comms(bufs)
    chunks = [torch.randn(n, device=dev).to(torch.bfloat16) for _ in range(2)]
    outs = [c.allocate((2 * n,), dtype=torch.bfloat16, device=dev) for c in comms]
    streams = [torch.cuda.Stream(dev) for _ in comms]
    for i, o in enumerate(outs):
        o[i * n:(i + 1) * n].copy_(chunks[i])
    torch.cuda.synchronize()

    def pair():
        for i, c in enumerate(comms):
            with torch.cuda.stream(streams[i]):
                c(output_tensor=outs[i], input_tensor=outs[i][i * n:(i + 1) * n], group=group, async_op=False)

    def switches():
        for s in streams:
            with torch.cuda.stream(s):
                pass

    # Host time: at most ~100 pairs per timed loop, so the streams' queues never fill and
    # block the host on the device (each step's waits cross the two streams).
    rounds = max(calls // 200, 1)
    us = min(_per_call_us(pair, 100, True) for _ in range(rounds)) / 2
    switch_us = min(_per_call_us(switches, 100, True) for _ in range(rounds)) / 2
    torch.cuda.synchronize()
    want = torch.cat(chunks)
    return us, switch_us, all(bool(torch.equal(o, want)) for o in outs)


def loopback(a) -> int:
    """``--loopback`` (module doc); 0, or 2 with one line where it cannot run."""
    import warnings

    import torch
    import torch.distributed as dist

    from torch_ce._net import free_port

    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated.*")
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("torch-ce bench fsdp2 --loopback: skipped: needs a CUDA GPU (--device cpu: the host transport)",
              file=sys.stderr, flush=True)
        return 2
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(dev)
        R._device = dev  # this process is the one rank (the results' env names its GPU)
    kw = dict(device_id=dev) if cuda else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **kw)
    rows, res = [], {}
    try:
        group = dist.group.WORLD
        for mib in C.parse_list(a.sizes_mib):
            n = int(mib * 2**20) // 2
            mine = torch.randn(n, device=dev).to(torch.bfloat16)
            peer = torch.randn(n, device=dev).to(torch.bfloat16)
            comm = loopback_comm(mine, peer)
            out = comm.allocate((2 * n,), dtype=torch.bfloat16, device=dev)
            out[:n].copy_(mine)  # FSDP2's copy-in
            ce = lambda: comm(output_tensor=out, input_tensor=out[:n], group=group, async_op=False)  # noqa: E731
            py_comm = loopback_comm(mine, peer)
            py_comm._native = False  # the Python reads (a library without the C++ peer copy)
            ce_py = lambda: py_comm(output_tensor=out, input_tensor=out[:n], group=group, async_op=False)  # noqa: E731
            ce()
            if cuda:
                torch.cuda.synchronize()
            exact = bool(torch.equal(out, torch.cat([mine, peer])))
            one = torch.empty(n, dtype=torch.bfloat16, device=dev)
            coll = lambda: dist.all_gather_into_tensor(one, mine, group=group)  # noqa: E731
            ce_us = _per_call_us(ce, a.calls, cuda)
            py_us = _per_call_us(ce_py, a.calls, cuda) if cuda else ce_us
            coll_us = _per_call_us(coll, a.calls, cuda)
            if cuda:
                torch.cuda.synchronize()
                exact = exact and bool(torch.equal(out, torch.cat([mine, peer])))
            raw_us, switch_us, train_exact = (_training_loopback(n, dev, a.calls, group) if cuda
                                              else (None, None, None))
            train_us = None if raw_us is None else raw_us - switch_us
            if train_exact is not None:
                exact = exact and train_exact
            res[str(mib)] = dict(ce_us=ce_us, ce_python_us=py_us, collective_us=coll_us, exact=exact,
                                 ce_native=bool(comm._native), ce_training_us=train_us,
                                 ce_training_with_switch_us=raw_us, stream_switch_us=switch_us,
                                 training_exact=train_exact)
            rows.append([f"{mib:g}", f"{ce_us:.1f}", f"{py_us:.1f}",
                         "-" if train_us is None else f"{train_us:.1f}", f"{coll_us:.1f}", f"{ce_us / coll_us:.2f}",
                         "-" if train_us is None else f"{train_us / coll_us:.2f}", "yes" if exact else "NO"])
            del mine, peer, out, one, comm, py_comm
    finally:
        dist.destroy_process_group()
    path = os.path.join(a.out, f"fsdp2_loopback_{C.gpu_tag(torch.cuda.get_device_name(dev)) if cuda else 'cpu'}.json")
    C.write_json(path, dict(args=vars(a), per_size=res, collective="nccl" if cuda else "gloo"), C.env_info(1))
    print(C.format_table(["chunk MiB", "static hook us/call", "(Python reads)", "training hook us/call (switches out)",
                          f"{backend} all_gather us/call (1 rank)", "static ratio", "training ratio", "exact"],
                         rows), flush=True)
    print(f"wrote {path}", flush=True)
    return 0 if all(r["exact"] for r in res.values()) else 1
