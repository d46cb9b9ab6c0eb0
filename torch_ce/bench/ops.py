"""``torch-ce bench ops``: copy-engine gathers vs NCCL, op level.

For each per-rank size (MiB, bf16) on every GPU of the machine (or the torchrun ranks):

  nccl   ``dist.all_gather_into_tensor(out, shard)``
  ce1    ``magi.ce_all_gather_coalesced([shard])``: one bound member of that size
  ce8    ``magi.ce_all_gather_coalesced(members)``: eight bound members totalling it

and, with the C++ kernel, A/B variants of the peer-read order (NOTE [peer order] in
csrc/ce_copy.h; ce1 and ce8 use the library's order, rotated unless TORCH_CE_PEER_ORDER
says otherwise):

  ce1_fixed, ce8_fixed   the fixed order (every rank reads rank 0 first)
  ce8_member             rotated, member-major (ce8 is peer-major)
  ce1_chunk, ce8_chunk   rotated, chunked interleave of ``--peer-chunk-mib`` pieces
  ce1_inbatch            ce1 with this rank's own rows inside the peer batch

each timed as wait(launch()) on the current stream (the op, then ``wait_tensor`` on every
output), CUDA events around each call, median. Two timings per variant: ``us`` is device
time (the stream is parked on a sleep kernel while the CPU enqueues every call, so CPU
issue cost is hidden, as inside a compiled model that runs ahead); ``us_issue`` is the same
loop without the head start (what an issue-bound eager loop sees). GB/s = bytes read from
peers per rank, (world - 1) * size / time. Every size checks once that the CE outputs
(every variant) equal NCCL's exactly.

Then SM contention: a bf16 8192^3 matmul alone, beside a loop of NCCL all-gathers and
beside a loop of CE gathers (256 MiB per rank) on a side stream (shared/probes/p2p_probe.py).

Writes ``<out>/ops_<gpu>_w<world>.json`` (after every size, so a killed run keeps what it
measured) and ``ops_<gpu>_w<world>.png``; targets, table and figure are in ops_report.py.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics

from . import common as C
from . import ranks as R
from .ops_report import TARGETS_TEXT, draw, print_summary, targets


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="torch-ce bench ops",
        description="Copy-engine (magi.ce_all_gather_coalesced) vs NCCL all-gather: latency, "
                    "bandwidth, exactness, and SM contention against a bf16 matmul. "
                    "Targets: " + TARGETS_TEXT,
    )
    p.add_argument("--sizes", default="1,4,16,64,256", help="per-rank sizes in MiB (default 1,4,16,64,256)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per variant and size (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    p.add_argument("--members", type=int, default=8, help="members of the coalesced CE variant (default 8)")
    p.add_argument("--peer-chunk-mib", type=float, default=1.0,
                   help="piece size of the ce1_chunk / ce8_chunk variants (default 1; 0: no "
                        "chunk variants)")
    p.add_argument("--no-contention", action="store_true", help="skip the matmul SM-contention test")
    p.add_argument("--mm-size", type=int, default=8192, help="square bf16 matmul size (default 8192)")
    p.add_argument("--contention-mib", type=float, default=256.0,
                   help="per-rank gather size in the contention loops (default 256)")
    p.add_argument("--bg-gathers", type=int, default=80, help="background gathers per contention round")
    p.add_argument("--mm-iters", type=int, default=30, help="timed matmuls per contention round")
    C.add_common_args(p, timeout_s=300)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out = os.path.abspath(args.out)
    return R.launch("torch-ce bench ops", _worker, args,
                    banner=f"sizes {args.sizes} MiB, iters {args.iters}, out {args.out}")


# ---------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------


def _gbps(world: int, nbytes: int, us: float | None) -> float | None:
    if not us:
        return None
    return (world - 1) * nbytes / (us * 1e-6) / 1e9


def order_variants(chunk_mib: float) -> dict:
    """The peer-order A/B variants: name -> (the bucket it gathers, ``ce1`` or ``ce8``;
    ``native.peer_order_as`` arguments)."""
    v = {"ce1_fixed": ("ce1", dict(order="fixed", chunk_mib=0)),
         "ce8_fixed": ("ce8", dict(order="fixed", chunk_mib=0)),
         "ce8_member": ("ce8", dict(order="rotated-member", chunk_mib=0))}
    if chunk_mib > 0:
        v["ce1_chunk"] = ("ce1", dict(order="rotated", chunk_mib=chunk_mib))
        v["ce8_chunk"] = ("ce8", dict(order="rotated", chunk_mib=chunk_mib))
    return v


def _iters_for(nbytes: int, world: int, iters: int) -> int:
    # With the head start every CE output of the round is in flight at once (the caching
    # allocator cannot reuse a block the copy stream may still write): cap that at ~8 GiB.
    cap = int(8 * 2**30 // max(world * nbytes, 1))
    return max(5, min(iters, cap))


def _worker(rank: int, world: int, a: dict) -> None:
    import warnings

    import torch

    import torch_ce

    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated.*")
    # Op-level numbers only: no cost calibration (it would run inside the first bind and
    # cache a curve fitted on this bench's small windows for later compiles to pick up).
    torch_ce.config.cost_mode = "default"

    dev = R.device()
    sg = R.status_group()
    sizes = C.parse_list(a["sizes"], float)
    tag = C.gpu_tag()
    path = os.path.join(a["out"], f"ops_{tag}_w{world}.json")
    env = C.env_info(world) if rank == 0 else None
    C.log(f"[ops] world {world}, device {env.get('gpu') if env else ''}, torch "
          f"{torch.__version__}, results -> {path}")
    result: dict = dict(bench="ops", args=a, world_size=world, sizes=[], contention=None,
                        targets_text=TARGETS_TEXT, targets=[], errors=[])

    def save():
        if rank == 0:
            C.write_json(path, result, env)

    for mib in sizes:
        try:
            entry = _one_size(mib, world, rank, a, sg)
        except Exception as e:  # noqa: BLE001  (an unexpected failure: record, go on)
            entry = dict(mib=mib, errors=dict(size=C.short_error(e)))
            C.log_all(f"[ops] {mib:g} MiB FAILED: {e!r}")
        result["sizes"].append(entry)
        save()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    if a["no_contention"]:
        result["contention"] = dict(skipped="--no-contention")
    elif dev.type != "cuda":
        result["contention"] = dict(skipped="needs CUDA streams (cpu smoke run)")
    else:
        try:
            result["contention"] = _contention(world, rank, a)
        except Exception as e:  # noqa: BLE001
            result["contention"] = dict(error=C.short_error(e))
            C.log(f"[ops] contention FAILED: {e!r}")
    gc.collect()

    result["targets"] = targets(result)
    save()
    if rank == 0:
        print_summary(result, world)
        png = C.save_png(path[:-5] + ".png", lambda plt: draw(plt, result, world, tag))
        if png:
            result["png"] = png
            save()
        print(f"[ops] wrote {path}" + (f" and {png}" if png else ""), flush=True)


def _one_size(mib: float, world: int, rank: int, a: dict, sg) -> dict:
    """Bind fresh shards of ``mib`` per rank, check exactness, time nccl / ce1 / ce8."""
    import torch
    import torch.distributed as dist

    import torch_ce
    from torch_ce.runtime import native

    wait = torch.ops._c10d_functional.wait_tensor
    dev = R.device()
    group = dist.group.WORLD
    gname = group.group_name
    entry: dict = dict(mib=mib, errors={})
    bf16 = torch.bfloat16
    n = int(mib * 2**20) // 2
    m = a["members"]
    nm = max(256, (n // m) // 256 * 256)  # member elements, whole 512-byte multiples
    nbytes = n * 2
    entry.update(bytes_per_rank=nbytes, member_bytes=nm * 2, members=m)
    C.log(f"[ops] {mib:g} MiB per rank: binding 1 + {m} shards ...")
    state: dict = {}
    err = None
    try:
        g = torch.Generator(device=dev).manual_seed(int(1000 * mib) * 7 + rank)
        big = torch.randn(n, dtype=bf16, device=dev, generator=g)
        members = [torch.randn(nm, dtype=bf16, device=dev, generator=g) for _ in range(m)]
        res = torch_ce.bind([big] + members, group=group)
        if len(res.bound) + len(res.already_bound) != m + 1:
            raise RuntimeError(f"bind did not bind every shard: {res!r}")
        entry["bind"] = dict(bound=len(res.bound), windows_opened=res.windows_opened,
                             bytes_bound=res.bytes_bound)
        state.update(big=big, members=members, out=torch.empty(world * n, dtype=bf16, device=dev))
    except Exception as e:  # noqa: BLE001
        err = C.short_error(e)
    err = R.agree_errors(err, sg)
    if err:
        entry["errors"]["bind"] = err
        C.log(f"[ops] {mib:g} MiB: bind FAILED on some rank:\n{err}")
        return entry

    big, members, out = state["big"], state["members"], state["out"]

    def nccl():
        dist.all_gather_into_tensor(out, big)

    def ce1():
        for o in torch.ops.magi.ce_all_gather_coalesced([big], world, gname):
            wait(o)

    def ce8():
        for o in torch.ops.magi.ce_all_gather_coalesced(members, world, gname):
            wait(o)

    def ce1_inbatch():
        """ce1 with this rank's own rows inside the peer batch (C++ kernel only)."""
        with native.split_local_copy_as(False):
            ce1()

    ordered = order_variants(a["peer_chunk_mib"]) if native.loaded() else {}

    # Exactness: CE outputs vs NCCL's, once per size (every rank checks; all must agree).
    exact: dict = {}
    err = None
    try:
        refs = {}
        for key, shards in (("ce1", [big]), ("ce8", members)):
            refs[key] = [torch.empty(world * s.numel(), dtype=bf16, device=dev) for s in shards]
            for r, s in zip(refs[key], shards, strict=True):
                dist.all_gather_into_tensor(r, s)
        C.sync()
        for name, (key, kw) in [("ce1", ("ce1", {})), ("ce8", ("ce8", {}))] + list(ordered.items()):
            with native.peer_order_as(**kw):
                outs = [wait(o) for o in torch.ops.magi.ce_all_gather_coalesced(
                    [big] if key == "ce1" else members, world, gname)]
            C.sync()
            exact[name] = all(bool(torch.equal(o, r)) for o, r in zip(outs, refs[key], strict=True))
        del refs, outs
    except Exception as e:  # noqa: BLE001
        err = C.short_error(e)
    err = R.agree_errors(err, sg)
    all_exact = R.exchange(exact, sg)
    if err:
        entry["errors"]["exactness"] = err
        entry["exact"] = False
        C.log(f"[ops] {mib:g} MiB: exactness check FAILED:\n{err}")
    else:
        entry["exact_by_variant"] = {k: all(d.get(k, False) for d in all_exact) for k in exact}
        entry["exact"] = all(entry["exact_by_variant"].values())

    iters = _iters_for(nbytes, world, a["iters"])
    entry["iters"] = iters
    entry["peer_order"] = list(native.peer_order())  # of ce1 and ce8
    variants = [("nccl", nccl, {}), ("ce1", ce1, {}), ("ce8", ce8, {})]
    if native.loaded():
        variants.append(("ce1_inbatch", ce1_inbatch, {}))
    variants += [(name, ce1 if key == "ce1" else ce8, kw) for name, (key, kw) in ordered.items()]
    entry["kernel"] = "C++" if native.loaded() else "Python"
    for name, fn, kw in variants:
        if err and name != "nccl":
            entry["errors"][name] = "skipped: the exactness run failed"
            continue
        rec: dict = {}
        verr = None
        try:
            with native.peer_order_as(**kw):
                dev_t = C.time_stats(fn, iters, a["warmup"], head_start=True)
                iss_t = C.time_stats(fn, iters, 2, head_start=False)
            us, us_issue = dev_t["median_ms"] * 1e3, iss_t["median_ms"] * 1e3
            rec = dict(us=round(us, 2), gbps=_r(_gbps(world, nbytes, us)),
                       us_min=round(dev_t["min_ms"] * 1e3, 2),
                       us_issue=round(us_issue, 2), gbps_issue=_r(_gbps(world, nbytes, us_issue)),
                       head_start_sufficient=dev_t.get("head_start_sufficient"),
                       cpu_enqueue_us_per_call=_r(iss_t.get("cpu_enqueue_ms", 0) * 1e3 / iters))
        except Exception as e:  # noqa: BLE001
            verr = C.short_error(e)
        verr = R.agree_errors(verr, sg)
        if verr:
            entry["errors"][name] = verr
            C.log(f"[ops] {mib:g} MiB {name}: FAILED:\n{verr}")
            continue
        # Rank 0 reports its own timings; the slowest rank's median goes beside it.
        all_us = R.exchange(rec["us"], sg)
        rec["us_max_rank"] = max(all_us)
        entry[name] = rec
        C.log(f"[ops] {mib:6g} MiB {name:>11}: {rec['us']:9.1f} us {rec['gbps'] or 0:7.1f} GB/s"
              f"   (issue-bound {rec['us_issue']:.1f} us)")
    if "nccl" in entry and "ce1" in entry:
        entry["ce1_over_nccl_latency"] = _r(entry["ce1"]["us"] / entry["nccl"]["us"])
        entry["ce1_over_nccl_bw"] = _r(entry["nccl"]["us"] / entry["ce1"]["us"])
    for key in ("ce1", "ce8"):  # the rotation's gain: bandwidth, library order over fixed
        if key in entry and f"{key}_fixed" in entry:
            entry[f"{key}_over_fixed_bw"] = _r(entry[f"{key}_fixed"]["us"] / entry[key]["us"])
    C.log(f"[ops] {mib:g} MiB: exact {entry.get('exact')}")
    # Drop every reference to the bound shards; forget the windows (memory goes with them).
    big = members = out = None  # the closures above share these cells
    state.clear()
    torch_ce.release_all()
    C.barrier()
    return entry


def _r(x, nd=3):
    return None if x is None else round(float(x), nd)


def _contention(world: int, rank: int, a: dict) -> dict:
    """Matmul alone, beside an NCCL all-gather loop, beside a CE gather loop (p2p_probe.py)."""
    import torch
    import torch.distributed as dist

    import torch_ce

    wait = torch.ops._c10d_functional.wait_tensor
    dev = R.device()
    group = dist.group.WORLD
    gname = group.group_name

    bf16 = torch.bfloat16
    k = a["mm_size"]
    n = int(a["contention_mib"] * 2**20) // 2
    C.log(f"[ops] contention: {k}^3 bf16 matmul vs {a['contention_mib']:g} MiB gathers ...")
    g = torch.Generator(device=dev).manual_seed(4242 + rank)
    A = torch.randn(k, k, dtype=bf16, device=dev, generator=g)
    B = torch.randn(k, k, dtype=bf16, device=dev, generator=g)
    shard = torch.randn(n, dtype=bf16, device=dev, generator=g)
    res = torch_ce.bind([shard], group=group)
    if len(res.bound) != 1:
        raise RuntimeError(f"bind failed for the contention shard: {res!r}")
    out = torch.empty(world * n, dtype=bf16, device=dev)
    comm = torch.cuda.Stream()
    nbg, nmm = a["bg_gathers"], a["mm_iters"]

    def bg_nccl():
        dist.all_gather_into_tensor(out, shard)

    def bg_ce():
        for o in torch.ops.magi.ce_all_gather_coalesced([shard], world, gname):
            wait(o)

    def mm_time(bg=None):
        torch.cuda.synchronize()
        dist.barrier()
        cs, ce_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if bg:
            comm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(comm):
                cs.record()
                for _ in range(nbg):
                    bg()
                ce_.record()
        for _ in range(5):  # same untimed lead-in for every variant (clocks, cuBLAS)
            torch.mm(A, B)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(nmm):
            torch.mm(A, B)
        e.record()
        torch.cuda.synchronize()
        r = dict(mm_ms=s.elapsed_time(e) / nmm)
        if bg:
            r["gather_ms"] = cs.elapsed_time(ce_) / nbg
            # The background loop must still be running when the last matmul ends.
            r["bg_covers_mm"] = cs.elapsed_time(e) <= cs.elapsed_time(ce_)
        return r

    variants = (("alone", None), ("nccl", bg_nccl), ("ce", bg_ce))
    for _ in range(2):  # warm (allocator blocks for the CE outputs in flight, NCCL, cuBLAS)
        for _, bg in variants:
            mm_time(bg)
    runs: dict = {name: [] for name, _ in variants}
    for _ in range(3):
        for name, bg in variants:
            runs[name].append(mm_time(bg))
    out_d: dict = dict(mm_size=k, gather_mib=a["contention_mib"], bg_gathers=nbg, mm_iters=nmm)
    alone = statistics.median(r["mm_ms"] for r in runs["alone"])
    out_d["alone_ms"] = round(alone, 4)
    out_d["alone_tflops"] = round(2 * k**3 / (alone * 1e-3) / 1e12, 1)
    for name in ("nccl", "ce"):
        mm = statistics.median(r["mm_ms"] for r in runs[name])
        out_d[name] = dict(
            mm_ms=round(mm, 4), slowdown=round(mm / alone, 4),
            gather_ms_contended=round(statistics.median(r["gather_ms"] for r in runs[name]), 4),
            bg_covers_mm=all(r["bg_covers_mm"] for r in runs[name]),
        )
        C.log(f"[ops] matmul beside {name:>4}: {mm:.3f} ms vs {alone:.3f} ms alone -> "
              f"slowdown {mm / alone:.3f}x (gather {out_d[name]['gather_ms_contended']:.3f} ms, "
              f"covers the matmuls: {out_d[name]['bg_covers_mm']})")
    A = B = shard = out = None  # the closures above share these cells
    torch_ce.release_all()
    torch.cuda.empty_cache()
    return out_d
