"""Targets, table and figure of ``torch-ce bench ops`` (pure Python: tested on CPU)."""
from __future__ import annotations

from . import common as C

TARGETS_TEXT = (
    "CE latency <= 0.65x NCCL at 1-4 MiB; CE >= 1.2x NCCL bandwidth and >= 320 GB/s at "
    ">= 64 MiB; matmul slowdown beside CE <= 1.03x (NCCL measured 1.26x)"
)


def targets(result: dict) -> list[dict]:
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


def print_summary(result: dict, world: int) -> None:
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
    ab = [v for v in ("ce1", "ce1_fixed", "ce1_chunk", "ce8", "ce8_fixed", "ce8_member", "ce8_chunk")
          if any(e.get(v) for e in result["sizes"])]
    if any(v.endswith(("_fixed", "_member", "_chunk")) for v in ab):
        order = next((e["peer_order"] for e in result["sizes"] if e.get("peer_order")), None)
        print(f"[ops] peer order A/B (NOTE [peer order]): us / GB/s; ce1, ce8 in the library's "
              f"order {order}; fixed: every rank reads rank 0 first; member: rotated member-major; "
              f"chunk: {result['args'].get('peer_chunk_mib')} MiB pieces", flush=True)
        rows = [[f"{e['mib']:g}"] + [f"{e[v]['us']:.1f} / {e[v]['gbps'] or 0:.0f}" if e.get(v) else "-" for v in ab]
                + [e.get("ce1_over_fixed_bw", "-"), e.get("ce8_over_fixed_bw", "-")] for e in result["sizes"]]
        print(C.format_table(["MiB", *ab, "ce1/fixed bw", "ce8/fixed bw"], rows), flush=True)
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


def draw(plt, result: dict, world: int, tag: str):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = dict(nccl="NCCL all_gather", ce1="CE, 1 member", ce8=f"CE, {result['args']['members']} members",
                  ce1_fixed="CE, 1 member, fixed peer order")
    for v, style in (("nccl", "o-"), ("ce1", "s-"), ("ce8", "^--"), ("ce1_fixed", "s:")):
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
