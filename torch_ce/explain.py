"""``torch_ce.explain()``: what the passes and binds did, as data and as a readable table.

Per compiled graph: the gathers bound (bytes, predicted window and offset, bucket), those
refused and why, the overlap placement summary. Per (group, dtype) pool: its windows and
their fill. Graphs served from the FX graph cache ran no pass in this process, so they have
no record here; their binds still show.
"""
from __future__ import annotations

import collections
import dataclasses

from . import report
from .runtime import windows as W
from .config import config


@dataclasses.dataclass
class WindowInfo:
    group_ranks: tuple
    dtype: str
    device: str
    index: int
    nbytes: int
    used: int
    slots: int

    @property
    def fill(self) -> float:
        return self.used / self.nbytes if self.nbytes else 0.0


@dataclasses.dataclass
class Explanation:
    config: dict
    graphs: list  # report.GraphRecord
    binds: list  # binding.BindResult
    windows: list[WindowInfo]

    def as_dict(self) -> dict:
        return dict(
            config=self.config,
            graphs=[dataclasses.asdict(g) for g in self.graphs],
            binds=[dataclasses.asdict(b) for b in self.binds],
            windows=[dict(dataclasses.asdict(w), fill=w.fill) for w in self.windows],
        )

    def table(self) -> str:
        out = [f"torch_ce explain (transport={self.config['transport']})"]
        if not self.graphs:
            out.append("  no graph compiled in this process (or all served from the FX graph cache)")
        for g in self.graphs:
            mib = sum(b["bytes"] for b in g.bound) / 2**20
            out.append(f"graph {g.graph_id}: {len(g.bound)} gather(s) on the copy engine "
                       f"({mib:.2f} MiB/rank), {len(g.refused)} refused")
            for b in g.bound:
                out.append(f"  bound    {b['name']:<24} {b['bytes']:>12,d} B  group {b['group']}"
                           f"  window {b['window']} @ {b['offset']}")
            for reason, n in collections.Counter(r["reason"] for r in g.refused).items():
                names = [r["name"] for r in g.refused if r["reason"] == reason]
                out.append(f"  refused  {n} x {reason}: {', '.join(names[:6])}"
                           + (" ..." if len(names) > 6 else ""))
            for b in g.buckets:
                if len(b["members"]) > 1:
                    out.append(f"  bucket   {b['kind']:<10} {len(b['members'])} members, {b['bytes']:,d} B")
            if g.reorder:
                r = g.reorder
                out.append(f"  overlap  {r['launches']} launch(es), {r['compute_limited']} compute-limited"
                           + ("" if r["valid"] else " (order rejected: unchanged)"))
        for i, b in enumerate(self.binds):
            out.append(f"bind {i}: {len(b.bound)} moved into windows ({b.bytes_bound / 2**20:.2f} MiB), "
                       f"{len(b.already_bound)} already bound, {len(b.skipped)} skipped, "
                       f"{b.windows_opened} window(s) opened")
            for name, why in list(b.skipped.items())[:8]:
                out.append(f"  skipped  {name}: {why}")
        for w in self.windows:
            out.append(f"window {w.dtype}/{w.device} group {list(w.group_ranks)} #{w.index}: "
                       f"{w.slots} slot(s), {w.used:,d} / {w.nbytes:,d} B ({100 * w.fill:.0f}% full)")
        return "\n".join(out)


def explain(print_table: bool = False) -> Explanation:
    slots_per = collections.Counter(id(s.window) for s in W.bound_slots())
    wins = []
    for key, pool in W.pools().items():
        for w in pool.windows:
            wins.append(WindowInfo(key[0], key[1], key[2], w.index, w.nbytes, w.used, slots_per[id(w)]))
    e = Explanation(dataclasses.asdict(config), list(report.graphs), list(report.binds), wins)
    if print_table:
        print(e.table())
    return e
