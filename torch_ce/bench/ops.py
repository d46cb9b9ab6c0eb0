"""``torch-ce bench ops``: copy-engine gathers vs NCCL, op level.

For each per-rank size (MiB, bf16) on every GPU of the machine (or the torchrun ranks):

  nccl   ``dist.all_gather_into_tensor(out, shard)``
  ce1    ``magi.ce_all_gather_coalesced([shard])``: one bound member of that size
  ce8    ``magi.ce_all_gather_coalesced(members)``: eight bound members totalling it

each timed as wait(launch()) on the current stream (the op, then ``wait_tensor`` on every
output), CUDA events around each call, median. Two timings per variant: ``us`` is device
time (the stream is parked on a sleep kernel while the CPU enqueues every call, so CPU
issue cost is hidden, as inside a compiled model that runs ahead); ``us_issue`` is the same
loop without the head start (what an issue-bound eager loop sees). GB/s = bytes read from
peers per rank, (world - 1) * size / time. Every size checks once that the CE outputs
equal NCCL's exactly.

Then SM contention: a bf16 8192^3 matmul alone, beside a loop of NCCL all-gathers and
beside a loop of CE gathers (256 MiB per rank) on a side stream (shared/probes/p2p_probe.py).

Writes ``<out>/ops_<gpu>_w<world>.json`` (after every size, so a killed run keeps what it
measured) and ``ops_<gpu>_w<world>.png``.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

from . import common as C

TARGETS_TEXT = (
    "CE latency <= 0.65x NCCL at 1-4 MiB; CE >= 1.2x NCCL bandwidth and >= 320 GB/s at "
    ">= 64 MiB; matmul slowdown beside CE <= 1.03x (NCCL measured 1.26x)"
)


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
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(f"torch-ce bench ops: sizes {args.sizes} MiB, iters {args.iters}, out {args.out}", flush=True)
    t0 = time.monotonic()
    rc = C.spawn_ranks(_worker, args.nprocs, vars(args), backend=backend, timeout_s=args.timeout)
    print(f"torch-ce bench ops: done in {time.monotonic() - t0:.0f} s (exit code {rc})", flush=True)
    return rc


# ---------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------


def _gbps(world: int, nbytes: int, us: float | None) -> float | None:
    if not us:
        return None
    return (world - 1) * nbytes / (us * 1e-6) / 1e9


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

    dev = C.device()
    sg = C.status_group()
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

    result["targets"] = _targets(result)
    save()
    if rank == 0:
        _print_summary(result, world)
        png = C.save_png(path[:-5] + ".png", lambda plt: _draw(plt, result, world, tag))
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
    dev = C.device()
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
    err = C.agree_errors(err, sg)
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
        native.set_split_local_copy(False)
        try:
            ce1()
        finally:
            native.set_split_local_copy(True)

    # Exactness: CE outputs vs NCCL's, once per size (every rank checks; all must agree).
    exact: dict = {}
    err = None
    try:
        ref = torch.empty(world * n, dtype=bf16, device=dev)
        dist.all_gather_into_tensor(ref, big)
        o1 = [wait(o) for o in torch.ops.magi.ce_all_gather_coalesced([big], world, gname)]
        C.sync()
        exact["ce1"] = bool(torch.equal(o1[0], ref))
        outs8 = [wait(o) for o in torch.ops.magi.ce_all_gather_coalesced(members, world, gname)]
        ok8 = True
        refm = torch.empty(world * nm, dtype=bf16, device=dev)
        for mem, o in zip(members, outs8):
            dist.all_gather_into_tensor(refm, mem)
            C.sync()
            ok8 = ok8 and bool(torch.equal(o, refm))
        exact["ce8"] = ok8
        del ref, o1, outs8, refm
    except Exception as e:  # noqa: BLE001
        err = C.short_error(e)
    err = C.agree_errors(err, sg)
    all_exact = C.exchange(exact, sg)
    if err:
        entry["errors"]["exactness"] = err
        entry["exact"] = False
        C.log(f"[ops] {mib:g} MiB: exactness check FAILED:\n{err}")
    else:
        entry["exact_by_variant"] = {k: all(d.get(k, False) for d in all_exact) for k in ("ce1", "ce8")}
        entry["exact"] = all(entry["exact_by_variant"].values())

    iters = _iters_for(nbytes, world, a["iters"])
    entry["iters"] = iters
    variants = [("nccl", nccl), ("ce1", ce1), ("ce8", ce8)]
    if native.loaded():
        variants.append(("ce1_inbatch", ce1_inbatch))
    entry["kernel"] = "C++" if native.loaded() else "Python"
    for name, fn in variants:
        if err and name != "nccl":
            entry["errors"][name] = "skipped: the exactness run failed"
            continue
        rec: dict = {}
        verr = None
        try:
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
        verr = C.agree_errors(verr, sg)
        if verr:
            entry["errors"][name] = verr
            C.log(f"[ops] {mib:g} MiB {name}: FAILED:\n{verr}")
            continue
        # Rank 0 reports its own timings; the slowest rank's median goes beside it.
        all_us = C.exchange(rec["us"], sg)
        rec["us_max_rank"] = max(all_us)
        entry[name] = rec
        C.log(f"[ops] {mib:6g} MiB {name:>4}: {rec['us']:9.1f} us {rec['gbps'] or 0:7.1f} GB/s"
              f"   (issue-bound {rec['us_issue']:.1f} us)")
    if "nccl" in entry and "ce1" in entry:
        entry["ce1_over_nccl_latency"] = _r(entry["ce1"]["us"] / entry["nccl"]["us"])
        entry["ce1_over_nccl_bw"] = _r(entry["nccl"]["us"] / entry["ce1"]["us"])
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
    dev = C.device()
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


# ---------------------------------------------------------------------------------------
# Targets, table, figure
# ---------------------------------------------------------------------------------------


def _targets(result: dict) -> list[dict]:
    t = []
    by = {e["mib"]: e for e in result["sizes"]}
    for mib in (1, 4):
        e = by.get(mib)
        if e is not None:
            t.append(C.target(f"CE1/NCCL latency @ {mib:g} MiB", e.get("ce1_over_nccl_latency"), "<=", 0.65))
    for mib, e in sorted(by.items()):
        if mib >= 64:
            t.append(C.target(f"CE1/NCCL bandwidth @ {mib:g} MiB", e.get("ce1_over_nccl_bw"), ">=", 1.2))
            t.append(C.target(f"CE1 GB/s @ {mib:g} MiB", (e.get("ce1") or {}).get("gbps"), ">=", 320.0))
    c = result.get("contention") or {}
    if "ce" in c or "error" in c:
        t.append(C.target("matmul slowdown beside CE", (c.get("ce") or {}).get("slowdown"), "<=", 1.03))
    for mib, e in sorted(by.items()):
        t.append(C.target(f"CE exact vs NCCL @ {mib:g} MiB", 1.0 if e.get("exact") else 0.0, ">=", 1.0))
    return t


def _print_summary(result: dict, world: int) -> None:
    rows = []
    for e in result["sizes"]:
        def cell(v):
            d = e.get(v)
            if d is None and v == "ce1_inbatch" and e.get("kernel") != "C++":
                return "-"
            return "FAILED" if not d else f"{d['us']:.1f} / {d['gbps'] or 0:.0f}"

        def issue(v):
            d = e.get(v)
            return "-" if not d else f"{d['us_issue']:.0f} / {d['cpu_enqueue_us_per_call'] or 0:.0f}"

        rows.append([f"{e['mib']:g}", cell("nccl"), cell("ce1"), cell("ce8"), cell("ce1_inbatch"),
                     e.get("ce1_over_nccl_latency", "-"), issue("nccl"), issue("ce1"), issue("ce8"),
                     e.get("exact")])
    print(f"\n[ops] world {world}: device-time latency (us) / GB/s read from peers per rank; "
          f"issue-bound loop: latency / CPU us per call", flush=True)
    print(f"[ops] CE kernel: {result['sizes'][0].get('kernel', '?') if result['sizes'] else '?'}; "
          "CE1 in-batch: own rows inside the peer batch (else on a second copy stream)", flush=True)
    print(C.format_table(["MiB", "NCCL us/GBps", "CE1 us/GBps", "CE8 us/GBps", "CE1 in-batch", "CE1/NCCL",
                          "NCCL issue/CPU", "CE1 issue/CPU", "CE8 issue/CPU", "exact"], rows), flush=True)
    c = result.get("contention") or {}
    if "alone_ms" in c:
        print(f"[ops] matmul {c['mm_size']}^3 bf16: alone {c['alone_ms']:.3f} ms "
              f"({c['alone_tflops']} TFLOP/s); beside NCCL {c['nccl']['slowdown']:.3f}x; "
              f"beside CE {c['ce']['slowdown']:.3f}x", flush=True)
    elif c:
        print(f"[ops] contention: {c.get('skipped') or c.get('error', '')[:300]}", flush=True)
    print(f"[ops] targets ({TARGETS_TEXT}):", flush=True)
    for t in result["targets"]:
        print(C.format_target(t), flush=True)
    errs = [(e["mib"], k) for e in result["sizes"] for k in e.get("errors", {})]
    if errs:
        print(f"[ops] failures (details in the JSON): {errs}", flush=True)


def _draw(plt, result: dict, world: int, tag: str):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = dict(nccl="NCCL all_gather", ce1="CE, 1 member", ce8=f"CE, {result['args']['members']} members")
    for v, style in (("nccl", "o-"), ("ce1", "s-"), ("ce8", "^--")):
        pts = [(e["mib"], e[v]) for e in result["sizes"] if e.get(v)]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ax1.plot(xs, [p[1]["us"] for p in pts], style, label=labels[v])
        ax2.plot(xs, [p[1]["gbps"] or 0 for p in pts], style, label=labels[v])
    sizes = sorted({e["mib"] for e in result["sizes"]})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        if sizes:
            ax.set_xticks(sizes)
            ax.set_xticklabels([f"{m:g}" for m in sizes])
        ax.set_xlabel("MiB per rank (bf16)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax1.set_yscale("log")
    ax1.set_ylabel("latency, wait(launch()) (us)")
    ax2.set_ylabel("GB/s read from peers per rank")
    ax2.axhline(320, color="gray", ls=":", lw=1)
    ax2.annotate("320 GB/s target", (sizes[0] if sizes else 1, 322), fontsize=8, color="gray")
    top = max([e[v]["gbps"] or 0 for e in result["sizes"] for v in ("nccl", "ce1", "ce8") if e.get(v)] or [0])
    ax2.set_ylim(0, max(350.0, 1.1 * top))
    fig.suptitle(f"torch_ce gather vs NCCL, {tag}, world {world}")
    return fig
