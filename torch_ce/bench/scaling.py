"""``torch-ce bench plot-scaling``: gather bandwidth against size, one line per (world
size, transport), from the ``ops_<gpu>_w<world>.json`` files that ``torch-ce bench ops``
wrote into a results folder (one per world size: run it with ``--nprocs 2``, ``--nprocs 4``
... into the same ``--out``). Writes ``<results>/ops_scaling_<gpu>.png``.

The transports are NCCL and CE (``ce1``: one member, the library's peer order), plus
the peer-order A/B variants when the JSON has them (NOTE [peer order] in csrc/ce_copy.h).
Pure Python but for matplotlib, which is optional as elsewhere in the bench.
"""
from __future__ import annotations

import argparse
import json
import os
import re

from . import common as C

# ops variant -> legend label, line style; colours tell the world sizes apart.
TRANSPORTS = {"nccl": ("NCCL", "o-"), "ce1": ("CE", "s-"),
              "ce1_fixed": ("CE, fixed peer order", "s:"), "ce1_chunk": ("CE, chunked", "s--")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="torch-ce bench plot-scaling",
        description="GB/s against MiB per rank, one line per (world size, transport), from the "
                    "ops_<gpu>_w<world>.json files of `torch-ce bench ops` in a results folder.")
    p.add_argument("--results", default=C.DEFAULT_OUT, help=f"results folder (default {C.DEFAULT_OUT})")
    p.add_argument("--gpu", default="h200", help="GPU tag of the file names (default h200)")
    p.add_argument("--out", default="", help="figure path (default <results>/ops_scaling_<gpu>.png)")
    return p.parse_args(argv)


def load(results_dir: str, gpu: str) -> dict[int, dict]:
    """World size -> that world's ops results (``ops_<gpu>_w<N>.json`` only: the runN_
    copies of older runs are left out)."""
    pat = re.compile(rf"^ops_{re.escape(gpu)}_w(\d+)\.json$")
    out = {}
    for name in sorted(os.listdir(results_dir)):
        m = pat.match(name)
        if m:
            with open(os.path.join(results_dir, name)) as f:
                d = json.load(f)
            out[int(d.get("world_size") or m.group(1))] = d
    return out


def series(results: dict[int, dict]) -> list[dict]:
    """One line per (world, transport) that has at least one measured size: world,
    transport, label, style, and the (MiB, GB/s) points in size order."""
    lines = []
    for world in sorted(results):
        for v, (label, style) in TRANSPORTS.items():
            pts = sorted((e["mib"], e[v]["gbps"]) for e in results[world].get("sizes", [])
                         if isinstance(e.get(v), dict) and e[v].get("gbps"))
            if pts:
                lines.append(dict(world=world, transport=v, label=f"w{world} {label}", style=style,
                                  mib=[p[0] for p in pts], gbps=[p[1] for p in pts]))
    return lines


def draw(plt, lines: list[dict], gpu: str):
    fig, ax = plt.subplots(figsize=(8, 4.8))
    worlds = sorted({ln["world"] for ln in lines})
    colour = {w: f"C{i}" for i, w in enumerate(worlds)}
    for ln in lines:
        ax.plot(ln["mib"], ln["gbps"], ln["style"], color=colour[ln["world"]], label=ln["label"])
    sizes = sorted({m for ln in lines for m in ln["mib"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([f"{m:g}" for m in sizes])
    ax.set_xlabel("MiB per rank (bf16)")
    ax.set_ylabel("GB/s read from peers per rank")
    # One GPU's NVLink ingress: 18 links x 26.5 GB/s (docs/DESIGN.md, scaling model).
    ax.axhline(477, color="gray", ls=":", lw=1)
    ax.annotate("NVLink 477 GB/s", (sizes[0], 482), fontsize=8, color="gray")
    ax.set_ylim(0, max(520, 1.1 * max(g for ln in lines for g in ln["gbps"])))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(f"torch_ce gather bandwidth vs world size, {gpu}")
    return fig


def main(argv=None) -> int:
    args = parse_args(argv)
    lines = series(load(args.results, args.gpu))
    if not lines:
        print(f"torch-ce bench plot-scaling: no ops_{args.gpu}_w<N>.json with measured sizes in "
              f"{args.results}", flush=True)
        return 1
    path = args.out or os.path.join(args.results, f"ops_scaling_{args.gpu}.png")
    png = C.save_png(path, lambda plt: draw(plt, lines, args.gpu))
    print(f"[plot-scaling] {len(lines)} lines ({', '.join(ln['label'] for ln in lines)})"
          + (f" -> {png}" if png else ": no figure"), flush=True)
    return 0 if png else 1
