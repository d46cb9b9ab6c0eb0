"""What a copy beside the compute costs the compute. One GPU, no peer (docs/perf-notes.md section 14).

Run 25's Llama3 account (bench/results/account_llama3_8b_h200_w2.json): in every traced
forward, at 2048 and at 8192 tokens, the compute stream sat idle for ~270 us starting within
a few us of the LM head gather's start, whether or not anything waited for a copy; the first
copy of a gather is this rank's own rows (a 250 MiB DtoD for the LM head, on the local-copy
stream, next to the peer reads). Smaller gaps (16-32 us) sit at other gathers' starts.

This runs a compute chain shaped like a Llama3-8B FFN at 2048 tokens (gate, up, silu-mul,
down: ~1 ms a step) and issues one copy of ``--mib`` MiB at each of 8 step boundaries beside
it, then reports per way of copying:

    copy_ms   the 8 copies alone, back to back (no compute beside them)
    extra_ms  how much longer the compute chain took with the copies beside it
    stall     extra_ms / copy_ms: 1 = the compute stopped for the whole copy, 0 = it cost nothing
    lat_ms    launch-to-done per copy beside the compute (mean): what a consumer would wait

Ways of copying:
    memcpy_high, memcpy_normal  tensor.copy_ (cudaMemcpyAsync DtoD) on a side stream of the
                                highest / the default priority (the C++ kernel's copy streams
                                have the highest)
    kernel_high, kernel_normal  an SM copy kernel (torch.mul(src, 1, out=dst)): the control
    memcpy_once                 the same bytes as one copy at the first boundary (pacing)
    gather, gather_inbatch      magi.ce_all_gather through the C++ kernel on a loopback slot of
                                --mib / 2 MiB (test/cuda_helpers.py: the "peer" copy is a second
                                local tensor, so here both halves are DtoD, unlike a real peer
                                read over NVLink); own rows on the second copy stream (the
                                default), or inside the peer batch (set_split_local_copy(False))

``--profile`` runs the chain once per way under the profiler instead and splits its cost
into the compute stream's idle time (the copy kept the compute kernels from starting) and
its busy time (they ran, slower), with two more ways: ``memcpy2d_64k``/``memcpy2d_4k``
(cudaMemcpy2DAsync DtoD in 64 KiB / 4 KiB rows, through ctypes).

``--clocks`` samples the SM clock and power (nvidia-smi, every 10 ms) over 4 pairs of 300-step
chains without and with one copy per step (is the cost a clock or power limit?).

Usage on the device machine (after ``pip install --no-build-isolation --no-deps -e .``):
    python3 bench/compare/copy_stall.py --mib 256 --out $OUT/copy_stall_256_h200.json
    python3 bench/compare/copy_stall.py --mib 256 --profile --out $OUT/copy_profile_256_h200.json
    python3 bench/compare/copy_stall.py --mib 256 --clocks --out $OUT/copy_clocks_256_h200.json
and the figure, anywhere with matplotlib:
    python3 bench/compare/copy_stall.py --plot bench/results/copy_stall_*_h200.json \
        --out bench/results/copy_stall_h200.png
Results: bench/results/copy_{stall,profile,clocks}_*_h200.json (docs/perf-notes.md section 14).
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import glob
import json
import os
import sys
import tempfile

import torch

STEPS = 12
COPIES_AT = range(2, 10)  # step boundaries where a copy is issued


def _ffn(x, w1, w3, w2):
    return (torch.nn.functional.silu(x @ w1) * (x @ w3)) @ w2 * 0.5 + x


class Bench:
    def __init__(self, mib: int, dev):
        g = torch.Generator(device=dev).manual_seed(0)
        r = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g) * 0.02  # noqa: E731
        self.x = r(2048, 4096)
        self.w1, self.w3, self.w2 = r(4096, 14336), r(4096, 14336), r(14336, 4096)
        n = mib << 19  # bf16 elements
        self.src = [r(n) for _ in COPIES_AT]
        self.dst = [torch.empty_like(s) for s in self.src]
        self.big_src, self.big_dst = torch.cat(self.src), torch.empty(n * len(COPIES_AT), device=dev,
                                                                      dtype=torch.bfloat16)
        self.dev = dev

    def run(self, issue, with_compute=True) -> tuple[float, float, float]:
        """(compute chain ms, mean launch-to-done ms of a copy, first launch to last done ms)."""
        cur = torch.cuda.current_stream(self.dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks = []
        torch.cuda.synchronize(self.dev)
        torch.cuda._sleep(int(2e7))  # the CPU enqueues everything before the GPU starts
        start.record(cur)
        x = self.x
        for i in range(STEPS):
            if issue is not None and i in COPIES_AT:
                launched = torch.cuda.Event(enable_timing=True)
                launched.record(cur)
                done = issue(i - COPIES_AT[0])
                if done is not None:
                    marks.append((launched, done))
            if with_compute:
                x = _ffn(x, self.w1, self.w3, self.w2)
        end.record(cur)
        torch.cuda.synchronize(self.dev)
        lat = [a.elapsed_time(b) for a, b in marks]
        span = marks[0][0].elapsed_time(marks[-1][1]) if marks else 0.0
        return start.elapsed_time(end), (sum(lat) / len(lat) if lat else 0.0), span

    def copier(self, how: str, priority: str = "high"):
        side = torch.cuda.Stream(device=self.dev, priority=-100 if priority == "high" else 0)

        def issue(k):
            if how == "once" and k:
                return None
            side.wait_stream(torch.cuda.current_stream(self.dev))
            with torch.cuda.stream(side):
                if how == "memcpy":
                    self.dst[k].copy_(self.src[k])
                elif how == "once":
                    self.big_dst.copy_(self.big_src)
                else:
                    torch.mul(self.src[k], 1, out=self.dst[k])
                done = torch.cuda.Event(enable_timing=True)
                done.record(side)
            return done
        return issue


def cudart():
    """The CUDA runtime torch loaded (for cudaMemcpy2DAsync, which torch does not expose)."""
    found = [p for d in sys.path for p in glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcudart.so*"))]
    for cand in found + ["libcudart.so"]:
        try:
            rt = ctypes.CDLL(cand)
        except OSError:
            continue
        rt.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        return rt
    return None


def copier_2d(b: Bench, rt, width: int):
    """cudaMemcpy2DAsync (DtoD) of each copy in rows of ``width`` bytes, on a high-priority stream."""
    side = torch.cuda.Stream(device=b.dev, priority=-100)

    def issue(k):
        side.wait_stream(torch.cuda.current_stream(b.dev))
        n = b.src[k].numel() * b.src[k].element_size()
        rc = rt.cudaMemcpy2DAsync(b.dst[k].data_ptr(), width, b.src[k].data_ptr(), width, width, n // width,
                                  3, side.cuda_stream)  # 3: cudaMemcpyDeviceToDevice
        if rc:
            raise RuntimeError(f"cudaMemcpy2DAsync: error {rc}")
        done = torch.cuda.Event(enable_timing=True)
        done.record(side)
        return done
    return issue


def profiled(b: Bench, issue) -> dict:
    """One chain under the profiler: the compute stream's span, busy and idle time (us)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        b.run(issue)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        b.run(issue)
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    streams = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            streams[e.get("args", {}).get("stream")].append(e)
    gemm = lambda e: "nvjet" in e["name"] or "gemm" in e["name"].lower()  # noqa: E731
    compute = max(streams, key=lambda sid: sum(map(gemm, streams[sid])))
    ks = sorted((e for e in streams[compute] if "sleep" not in e["name"].lower()), key=lambda e: e["ts"])
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    busy = sum(e["dur"] for e in ks)
    copies = sorted({e["name"][:40] for sid, es in streams.items() if sid != compute for e in es})
    alone = b.run(issue, with_compute=False)[2] * 1e3 if issue else 0.0
    return dict(span_us=round(span, 1), busy_us=round(busy, 1), idle_us=round(span - busy, 1),
                copy_alone_us=round(alone, 1), copies=copies)


def measure(b: Bench, issue, reps: int) -> dict:
    for _ in range(2):
        b.run(issue)
    base = sorted(b.run(None)[0] for _ in range(reps))[reps // 2]
    chain_ms, lat_ms, _ = sorted(b.run(issue) for _ in range(reps))[reps // 2]
    # Alone, the copies go back to back: the span is their total time.
    alone = sorted(b.run(issue, with_compute=False)[2] for _ in range(reps))[reps // 2]
    extra = chain_ms - base
    return dict(base_ms=round(base, 3), chain_ms=round(chain_ms, 3), copy_ms=round(alone, 3),
                extra_ms=round(extra, 3), stall=round(extra / alone, 3) if alone else None,
                lat_ms=round(lat_ms, 3))


def gatherer(b: Bench, dev):
    """magi.ce_all_gather of --mib / 2 MiB loopback shards (a gather reads --mib)."""
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "test"))
    from cuda_helpers import register_loopback
    from torch_ce.runtime import native
    from torch_ce.runtime.gather import kernel_path

    if not native.load():
        raise SystemExit(f"copy_stall: {kernel_path('cuda')}")
    g = dist.group.WORLD
    shards = [s.view(2, -1)[0].clone() for s in b.src]
    for s in shards:
        register_loopback(s, torch.randn_like(s), g, 0)
    probe = torch.cuda.Stream(device=dev)

    def issue(k):
        out = torch.ops.magi.ce_all_gather(shards[k], 2, g.group_name)
        # Waited on a probe stream (which also unregisters the work), not on the compute.
        probe.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(probe):
            torch.ops._c10d_functional.wait_tensor(out)
            done = torch.cuda.Event(enable_timing=True)
            done.record(probe)
        return done
    return issue, native


def plot(paths: list[str], png: str) -> int:
    """One bar per way of copying and copy size: the stall (extra compute time / copy time)."""
    from torch_ce.bench.common import save_png

    docs = sorted((d for d in map(lambda p: json.load(open(p)), paths) if "mode" not in d),
                  key=lambda d: -d["mib"])
    ways = list(docs[0]["rows"])

    def draw(plt):
        fig, ax = plt.subplots(figsize=(9, 3.8))
        w = 0.8 / len(docs)
        for j, d in enumerate(docs):
            xs = [i + (j - (len(docs) - 1) / 2) * w for i in range(len(ways))]
            ys = [d["rows"][k]["stall"] for k in ways]
            bars = ax.bar(xs, ys, w, label=f"{d['mib']} MiB per copy")
            for b, k in zip(bars, ways):
                ax.annotate(f"{d['rows'][k]['copy_ms']:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(ways)), ways, rotation=20, fontsize=8)
        ax.set_ylabel("compute time lost / copy time")
        ax.set_title(f"Compute time lost per unit of DtoD copy time beside a bf16 FFN chain ({docs[0]['gpu']}, "
                     "one GPU)\n8 copies per run; memcpy_once: their bytes as one copy; labels: ms of the copies "
                     "alone", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        return fig
    return 0 if save_png(png, draw) else 1


def write(a, dev, rows: dict, **extra) -> None:
    doc = dict(bench="copy_stall", mib=a.mib, steps=STEPS, copies=len(COPIES_AT), torch=torch.__version__,
               gpu=torch.cuda.get_device_name(dev), priority_range=list(torch.cuda.Stream.priority_range()),
               rows=rows, **extra)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


def profile_main(a, b: Bench, dev) -> int:
    rt = cudart()
    ways = {"none": None, "memcpy_high": b.copier("memcpy", "high"), "kernel_normal": b.copier("kernel", "normal")}
    if rt is not None:
        ways.update(memcpy2d_64k=copier_2d(b, rt, 65536), memcpy2d_4k=copier_2d(b, rt, 4096))
    rows = {name: profiled(b, issue) for name, issue in ways.items()}
    issue, native = gatherer(b, dev)
    rows["gather"] = profiled(b, issue)
    with native.split_local_copy_as(False):
        rows["gather_inbatch"] = profiled(b, issue)
    base = rows["none"]
    for r in rows.values():
        r["extra_idle_us"] = round(r["idle_us"] - base["idle_us"], 1)
        r["extra_busy_us"] = round(r["busy_us"] - base["busy_us"], 1)
    write(a, dev, rows, mode="profile")
    print(f"copy_stall --profile: {a.mib} MiB x {len(COPIES_AT)} copies, one profiled chain per way (us)")
    print(f"{'way':<16}{'span':>8}{'busy':>8}{'idle':>7}{'+busy':>7}{'+idle':>7}{'copies alone':>13}{'+idle/copy':>11}")
    for k, r in rows.items():
        c = r["copy_alone_us"]
        print(f"{k:<16}{r['span_us']:>8.0f}{r['busy_us']:>8.0f}{r['idle_us']:>7.0f}{r['extra_busy_us']:>7.0f}"
              f"{r['extra_idle_us']:>7.0f}{c:>13.0f}{(r['extra_idle_us'] / c if c else 0):>11.2f}")
    return 0


def clocks_main(a, b: Bench, dev) -> int:
    import datetime
    import subprocess
    import time

    side = torch.cuda.Stream(device=dev, priority=-100)
    csv = tempfile.mktemp(suffix=".csv")
    with open(csv, "w") as f:
        smi = subprocess.Popen(["nvidia-smi", "-i", str(dev.index), "-lms", "10", "--format=csv,noheader,nounits",
                                "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu"], stdout=f)
        time.sleep(1.0)
        phases = []
        for _ in range(4):
            for copies in (False, True):
                x = b.x
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(dev)
                t0 = time.time()
                s.record()
                for i in range(300):
                    if copies:
                        side.wait_stream(torch.cuda.current_stream(dev))
                        with torch.cuda.stream(side):
                            b.dst[i % len(b.dst)].copy_(b.src[i % len(b.src)])
                    x = _ffn(x, b.w1, b.w3, b.w2)
                e.record()
                torch.cuda.synchronize(dev)
                phases.append(dict(copies=copies, t0=t0, t1=time.time(), ms_per_step=s.elapsed_time(e) / 300))
                time.sleep(0.3)
        smi.terminate()
        smi.wait()
    samples = []
    for line in open(csv):
        p = [v.strip() for v in line.split(",")]
        try:  # nvidia-smi stamps local time, as time.time() does after mktime
            t = time.mktime(datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timetuple()) + \
                float("0." + p[0].rsplit(".", 1)[1])
            samples.append((t, float(p[1]), float(p[2]), float(p[3])))
        except (ValueError, IndexError):
            continue
    for ph in phases:
        inside = [r for r in samples if ph["t0"] + 0.05 <= r[0] <= ph["t1"]]
        ph["samples"] = len(inside)
        if inside:
            ph["sm_mhz"] = round(sum(r[1] for r in inside) / len(inside), 1)
            ph["power_w"] = round(sum(r[2] for r in inside) / len(inside), 1)
            ph["temp_c"] = max(r[3] for r in inside)
    write(a, dev, {"phases": phases}, mode="clocks")
    for ph in phases:
        print(f"copies={ph['copies']!s:<5} ms/step {ph['ms_per_step']:.4f}  SM {ph.get('sm_mhz')} MHz  "
              f"power {ph.get('power_w')} W  max temp {ph.get('temp_c')} C  ({ph['samples']} samples)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB per copy (a gather reads this much)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", action="store_true", help="split the cost into idle and busy compute time")
    ap.add_argument("--clocks", action="store_true", help="SM clock and power with and without copies")
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="plot these results (no GPU) into --out")
    a = ap.parse_args(argv)
    if a.plot:
        return plot(a.plot, a.out or "copy_stall.png")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    b = Bench(a.mib, dev)
    if a.profile:
        return profile_main(a, b, dev)
    if a.clocks:
        return clocks_main(a, b, dev)
    rows = {}
    for how in ("memcpy", "kernel"):
        for pr in ("high", "normal"):
            rows[f"{how}_{pr}"] = measure(b, b.copier(how, pr), a.reps)
    rows["memcpy_once"] = measure(b, b.copier("once"), a.reps)
    issue, native = gatherer(b, dev)
    rows["gather"] = measure(b, issue, a.reps)
    with native.split_local_copy_as(False):
        rows["gather_inbatch"] = measure(b, issue, a.reps)
    from torch_ce.runtime.gather import kernel_path

    rows["gather"]["kernel"] = kernel_path("cuda")
    write(a, dev, rows)
    print(f"copy_stall: {a.mib} MiB x {len(COPIES_AT)} copies beside a {STEPS}-step FFN chain "
          f"(memcpy_once: one copy of all those bytes)")
    print(f"{'way':<16}{'base ms':>9}{'chain ms':>10}{'copy ms':>9}{'extra ms':>10}{'stall':>7}{'lat ms':>8}")
    for k, r in rows.items():
        print(f"{k:<16}{r['base_ms']:>9.3f}{r['chain_ms']:>10.3f}{r['copy_ms']:>9.3f}{r['extra_ms']:>10.3f}"
              f"{r['stall']:>7.2f}{r['lat_ms']:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
