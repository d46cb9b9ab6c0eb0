"""``bench e2e --trace``: a per-gather account of a forward, from the profiler trace of rank 0.

Why: the trace summary (trace.py) says how much copy time is exposed per forward, not
which weight it belongs to nor what the copies cost the compute beside them. Pure Python
on a compact event list (``compact``), tested on a synthetic trace; ``timeline.py`` draws it.

Definitions (us, per iteration; an iteration is one ``torch_ce_iter`` annotation):

- gather: one gather op on the CPU (``magi::ce_all_gather[_coalesced]`` or
  ``_c10d_functional::all_gather_into_tensor*``), labelled by its weights (the k-th op of
  an iteration is the k-th gather call in the generated code). Its copies are the GPU events
  correlated with the runtime calls made inside the op: CE's peer reads (``Memcpy PtoP``) and
  own rows (``Memcpy DtoD``), or NCCL's kernel.
- bytes: bytes read from peers by this rank: CE the PtoP bytes; NCCL (W-1)/W of the output
  of its ``record_param_comms`` (Out msg nelems x element size). gbps = bytes / copy_us.
- copy_us: the union of its copies' intervals; [start, end]: first start, last end.
- exposed_us: for each idle gap of the compute stream, from a (the previous compute
  kernel's end) to b (the next, "consumer", kernel's start), ``ready`` = max(a, the consumer's
  launch on the CPU): before it the gap is CPU issue. Of the gathers whose last copy ends in
  (ready, b], the one ending last held the consumer: it is charged end - ready. A gap is
  charged to at most one gather; the rest of it stays ``issue_us`` / unattributed.
- idle beside own rows: the part of each idle gap that overlaps this rank's own-row copies
  (CE's ``Memcpy DtoD``), whoever the gap is charged to. A same-device DtoD keeps the
  compute kernels from starting for most of its length (perf-notes section 14), so this is
  idle the copy itself causes, which no launch point hides; NCCL has none.
- compute slowdown: compute kernels are matched to the ``bound`` variant's trace by name and
  occurrence within the iteration. A kernel is under copy if it overlaps a copy of any
  gather. slowdown_under_copy = its matched kernels' time / the same kernels' time in bound;
  slowdown_not_under the same for the others (the control: clocks, other code). Per gather,
  the kernels overlapping its copies (a kernel may count for two gathers).
"""
from __future__ import annotations

import bisect

from .trace import merge_intervals, overlap_length, union_length

GATHER_OPS = ("magi::ce_all_gather", "magi::ce_all_gather_coalesced", "magi::ce_all_gather_dim",
              "magi::ce_all_gather_padded",
              "_c10d_functional::all_gather_into_tensor",
              "_c10d_functional::all_gather_into_tensor_out",
              "_c10d_functional::all_gather_into_tensor_coalesced")
ITER_MARK = "torch_ce_iter"
_ELEM = {"BFloat16": 2, "Half": 2, "Float": 4, "Double": 8, "Byte": 1, "Char": 1, "Int": 4, "Long": 8}


def compact(trace: dict) -> dict:
    """What the account needs from a Chrome trace (torch.profiler export), small enough to
    keep: iteration ranges, gather ops (+ NCCL's comms records), launches, GPU events."""
    out: dict = dict(iters=[], ops=[], comms=[], launch={}, gpu=[])
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name, args = str(e.get("cat", "")).lower(), str(e.get("name", "")), e.get("args") or {}
        ts, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if cat == "user_annotation" and name.startswith(ITER_MARK):
            out["iters"].append([ts, end])
        elif cat == "cpu_op" and name in GATHER_OPS:
            out["ops"].append(dict(name=name, ts=ts, end=end, tid=e.get("tid")))
        elif cat == "cpu_op" and name == "record_param_comms":
            n, es = args.get("Out msg nelems"), _ELEM.get(str(args.get("dtype")))
            W = int(args.get("Group size") or 0)
            if n and es and W:
                out["comms"].append(dict(ts=ts, tid=e.get("tid"), bytes=int(n) * es * (W - 1) // W))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            out["launch"][int(args["correlation"])] = [ts, e.get("tid")]
        elif cat in ("kernel", "gpu_memcpy"):
            out["gpu"].append(dict(name=name, ts=ts, dur=float(e["dur"]), stream=args.get("stream", e.get("tid")),
                                   corr=args.get("correlation"), bytes=int(args.get("bytes", 0) or 0),
                                   copy=cat == "gpu_memcpy"))
    out["iters"].sort()
    return out


def _is_nccl(g: dict) -> bool:
    return not g["copy"] and "nccl" in g["name"].lower()


def _iter_index(starts: list, ts: float) -> int:
    return max(bisect.bisect_right(starts, ts) - 1, 0)


def _per_iter_compute(c: dict) -> tuple[object, list[list[dict]]]:
    """The compute stream (most non-NCCL kernel time) and its kernels, per iteration (by
    the CPU time of their launch; by their own start if the launch is not in the trace)."""
    busy: dict = {}
    for g in c["gpu"]:
        if not g["copy"] and not _is_nccl(g):
            busy[str(g["stream"])] = busy.get(str(g["stream"]), 0.0) + g["dur"]
    stream = max(busy, key=busy.get) if busy else None
    starts = [s for s, _ in c["iters"]] or [float("-inf")]
    per: list[list[dict]] = [[] for _ in starts]
    for g in c["gpu"]:
        if not g["copy"] and not _is_nccl(g) and str(g["stream"]) == stream:
            lt = c["launch"].get(g["corr"], [g["ts"]])[0]
            per[_iter_index(starts, lt)].append(dict(g, launch=c["launch"].get(g["corr"], [None])[0]))
    for ks in per:
        ks.sort(key=lambda k: k["ts"])
    return stream, per


def gathers(c: dict, labels: list[str] | None = None) -> list[list[dict]]:
    """Per iteration, each gather op with its copies (see the module's definitions)."""
    starts = [s for s, _ in c["iters"]] or [float("-inf")]
    by_corr: dict = {}
    for g in c["gpu"]:
        if g["copy"] or _is_nccl(g):
            by_corr.setdefault(g["corr"], []).append(g)
    per: list[list[dict]] = [[] for _ in starts]
    for op in sorted(c["ops"], key=lambda o: o["ts"]):
        corrs = [k for k, (ts, tid) in c["launch"].items() if tid == op["tid"] and op["ts"] <= ts <= op["end"]]
        evs = [g for k in corrs for g in by_corr.get(k, [])]
        iv = [(g["ts"], g["ts"] + g["dur"]) for g in evs]
        comms = [m["bytes"] for m in c["comms"] if m["tid"] == op["tid"] and op["ts"] <= m["ts"] <= op["end"]]
        nbytes = sum(g["bytes"] for g in evs if "PtoP" in g["name"]) if op["name"].startswith("magi") else sum(comms)
        copy = union_length(iv)
        i = _iter_index(starts, op["ts"])
        per[i].append(dict(op=op["name"], label=None, bytes=nbytes, copy_us=round(copy, 1),
                           gbps=round(nbytes / copy / 1e3, 1) if copy and nbytes else None,
                           start=min((s for s, _ in iv), default=None), end=max((e for _, e in iv), default=None),
                           intervals=merge_intervals(iv), exposed_us=0.0, consumer=None,
                           own=merge_intervals((g["ts"], g["ts"] + g["dur"]) for g in evs if "DtoD" in g["name"])))
    for gs in per:
        for k, g in enumerate(gs):
            g["k"] = k
            g["label"] = labels[k] if labels and len(labels) == len(gs) else f"gather {k}"
    return per


def _match_bound(kernels: list[dict], bound: list[dict]) -> list:
    """Each kernel's duration in the bound trace: same name, same occurrence (or None)."""
    seen: dict = {}
    by_name: dict = {}
    for k in bound:
        by_name.setdefault(k["name"], []).append(k["dur"])
    out = []
    for k in kernels:
        n = seen.get(k["name"], 0)
        seen[k["name"]] = n + 1
        durs = by_name.get(k["name"], [])
        out.append(durs[n] if n < len(durs) else None)
    return out


def account(c: dict, labels: list[str] | None = None, bound: dict | None = None) -> dict:
    """The per-gather account of one variant's compact trace, against ``bound``'s if given."""
    stream, comp = _per_iter_compute(c)
    gs = gathers(c, labels)
    bcomp = _per_iter_compute(bound)[1] if bound else []
    iters, gaps_all = [], []
    for i, ks in enumerate(comp):
        G = gs[i] if i < len(gs) else []
        t0 = c["iters"][i][0] if i < len(c["iters"]) else (ks[0]["ts"] if ks else 0.0)
        own_iv = [iv for g in G for iv in g["own"]]
        gaps, a = [], (comp[i - 1][-1]["ts"] + comp[i - 1][-1]["dur"]) if i and comp[i - 1] else t0
        for k in ks:
            b = k["ts"]
            if b > a:
                ready = min(max(a, k["launch"] if k["launch"] is not None else a), b)
                held = [g for g in G if g["end"] is not None and ready < g["end"] <= b]
                g = max(held, key=lambda g: g["end"]) if held else None
                wait = g["end"] - ready if g else 0.0
                if g:
                    g["exposed_us"] += wait
                    g["consumer"] = g["consumer"] or k["name"][:60]
                gaps.append(dict(at_us=round(a - t0, 1), us=round(b - a, 1), issue_us=round(ready - a, 1),
                                 wait_us=round(wait, 1), gather=g["label"] if g else None, after=k["name"][:60],
                                 beside_own_rows_us=round(overlap_length([(a, b)], own_iv), 1)))
            a = max(a, k["ts"] + k["dur"])
        copy_iv = [iv for g in G for iv in g["intervals"]]
        under = [overlap_length([(k["ts"], k["ts"] + k["dur"])], copy_iv) > 0 for k in ks]
        ref = _match_bound(ks, bcomp[i]) if i < len(bcomp) else [None] * len(ks)
        for g in G:
            sel = [(k["dur"], r) for k, r in zip(ks, ref, strict=True)
                   if r is not None and overlap_length([(k["ts"], k["ts"] + k["dur"])], g["intervals"]) > 0]
            g["compute_under_us"] = round(sum(d for d, _ in sel), 1)
            g["compute_under_bound_us"] = round(sum(r for _, r in sel), 1)
            g["slowdown"] = round(g["compute_under_us"] / g["compute_under_bound_us"], 4) if sel else None
            g["exposed_us"] = round(g["exposed_us"], 1)
            g["start_us"] = None if g["start"] is None else round(g["start"] - t0, 1)
            g["end_us"] = None if g["end"] is None else round(g["end"] - t0, 1)
        mu = [(k["dur"], r) for k, r, u in zip(ks, ref, under, strict=True) if r is not None and u]
        mn = [(k["dur"], r) for k, r, u in zip(ks, ref, under, strict=True) if r is not None and not u]
        iters.append(dict(
            t0=t0, span_us=round((ks[-1]["ts"] + ks[-1]["dur"] - t0) if ks else 0.0, 1),
            compute_us=round(sum(k["dur"] for k in ks), 1), copy_us=round(union_length(copy_iv), 1),
            idle_us=round(sum(g["us"] for g in gaps), 1), issue_us=round(sum(g["issue_us"] for g in gaps), 1),
            exposed_us=round(sum(g["wait_us"] for g in gaps), 1),
            idle_beside_own_rows_us=round(sum(g["beside_own_rows_us"] for g in gaps), 1),
            under_copy_us=round(sum(d for d, _ in mu), 1), under_copy_bound_us=round(sum(r for _, r in mu), 1),
            slowdown_under_copy=round(sum(d for d, _ in mu) / sum(r for _, r in mu), 4) if mu else None,
            slowdown_not_under=round(sum(d for d, _ in mn) / sum(r for _, r in mn), 4) if mn else None,
            kernels=len(ks), kernels_unmatched=sum(r is None for r in ref) if bound else None))
        gaps_all.append(gaps)
    for G in gs:
        for g in G:
            for k in ("start", "end", "intervals", "own"):
                g.pop(k, None)
    return dict(compute_stream=stream, iterations=iters, gathers=gs, gaps=gaps_all,
                uncorrelated_copies=_uncorrelated(c))


def _uncorrelated(c: dict) -> int:
    """Copies (and NCCL kernels) whose launch is not in the trace: not in any gather."""
    return sum(1 for g in c["gpu"] if (g["copy"] or _is_nccl(g)) and g["corr"] not in c["launch"])


def timeline_rows(c: dict, acct: dict, iteration: int) -> dict:
    """What timeline.py draws for one iteration: compute kernels, copies per lane (peer
    reads, own rows, NCCL), gathers with labels, exposed stretches; us from its start."""
    t0 = acct["iterations"][iteration]["t0"]
    _, comp = _per_iter_compute(c)
    starts = [s for s, _ in c["iters"]] or [float("-inf")]
    lanes: dict = {"peer reads": [], "own rows": [], "NCCL": []}
    for g in c["gpu"]:
        if g["copy"] or _is_nccl(g):
            lt = c["launch"].get(g["corr"], [g["ts"]])[0]
            if _iter_index(starts, lt) == iteration:
                lane = "NCCL" if _is_nccl(g) else ("peer reads" if "PtoP" in g["name"] else "own rows")
                lanes[lane].append((g["ts"] - t0, g["dur"]))
    return dict(compute=[(k["ts"] - t0, k["dur"]) for k in comp[iteration]],
                lanes={k: v for k, v in lanes.items() if v},
                gathers=[(g["label"], g["start_us"], g["end_us"], g["exposed_us"])
                         for g in acct["gathers"][iteration] if g["start_us"] is not None],
                exposed=[(gp["at_us"] + gp["issue_us"], gp["wait_us"]) for gp in acct["gaps"][iteration]
                         if gp["wait_us"] > 0])
