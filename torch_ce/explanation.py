"""``torch_ce.explain()``: what the passes and binds did, as data and as a readable table.

Per compiled graph, one row per weight (a weight gathered twice in one graph is still one
row), named by its parameter (``layers.0.attention.wqkv.weight``; the placeholder name
only when the graph had no Dynamo frame, NOTE [parameter names] in
passes/param_names.py): its bytes and the window and offset it sits at once bound (read
from the run-time registry, by the name the bind step registered), or why it stays on the
collective backend, and the mesh dim it is gathered over (HSDP: the shard dim; noted from
the DTensor's mesh when the graph's cache key is formed, report.mesh_dims); for a weight embedding
lookups read, its row gather and the bytes it reads per forward, or why it is gathered in
full. Per (group, dtype) pool: its windows and how full they are. The gather
kernel in use per device type, and (in the table's header) the torch it runs on. Graphs
served from the FX graph cache ran no pass in this process, so they have no record here;
their binds still show.

(This module is not called ``explain``: ``import torch_ce.explain`` would rebind the
package attribute ``torch_ce.explain``, the function, to the module.)
"""
from __future__ import annotations

import collections
import dataclasses

from . import report
from .config import config
from .runtime import window_pools as WP
from .runtime import windows as W


@dataclasses.dataclass
class WindowInfo:
    group_ranks: tuple
    dtype: str
    device: str
    index: int
    nbytes: int
    used: int  # bytes filled by slots (the window may be larger: pooling leaves room)
    slots: int
    owner: str = ""  # whose own window (an FSDP2 model: NOTE [windows of one owner]); "": pooled

    @property
    def fill(self) -> float:
        return self.used / self.nbytes if self.nbytes else 0.0


@dataclasses.dataclass
class WeightRow:
    """One weight of one compiled graph."""

    graph_id: int
    param: str  # the parameter's name (placeholder name as a fallback)
    name: str  # the post-grad placeholder
    # "bound" | "refused" | "fallback" (refused at bind) | "not bound yet" | "collective"
    # (a graph compiled with transport="nccl": the user's choice, not a refusal)
    status: str
    gathers: int = 1  # gathers of this weight in the graph
    bytes: int = 0
    group: str = ""
    window: int | None = None  # run-time window index within its pool
    offset: int | None = None  # byte offset in that window
    reason: str = ""  # why it stays on the collective backend (refused, fallback)
    # The mesh dim ``group`` gathers over ("'dp_shard' (dim 1 of mesh (2, 2))"; "" when
    # the weight is not a DTensor): report.mesh_dims, noted from the DTensor's mesh.
    mesh_dim: str = ""
    # A weight embedding lookups read (NOTE [row gathers] in passes/rows.py): lookups,
    # rows and row_bytes per forward, bytes_per_forward (rows x row_bytes, own rows
    # included; None when an ids shape is dynamic), and reason: "" when its lookups
    # read rows, else why it is gathered in full. Empty for any other weight.
    rows: dict = dataclasses.field(default_factory=dict)
    # A training graph's weight: the dtype of the staging slot its gathers read (NOTE
    # [training: staged windows and step fences] in runtime/staging.py); "" in place.
    staged: str = ""
    # Coverage (NOTE [coverage bytes] in report.py): the bytes this weight's gathers move
    # per call of the graph on the copy engines, and on the collective by reason.
    ce_bytes: int = 0
    collective_bytes: int = 0
    by_reason: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Coverage:
    """Gathered bytes per call: on the copy engines, and on the collective by reason
    (NOTE [coverage bytes] in report.py: a gather counts the bytes it writes, shard x group
    size; a row gather the rows it looks up).

    ``seen`` tells "no weight gather seen yet" from a measured share: ``share`` is None
    until a gather of some bytes was counted, never a percentage of zero bytes.

    ``calls``: a graph's calls counted at run time (None: not counted, the graph has no
    bind or stage step, or nothing ran yet); the total's ``counted`` says whether it sums
    calls (NOTE [calls, not graphs] in report.py) or, before anything ran, one call of
    each graph as compiled."""

    ce_bytes: int = 0
    collective_bytes: int = 0
    by_reason: dict = dataclasses.field(default_factory=dict)  # reason -> collective bytes
    graph_id: int | None = None  # None: the total
    weights: int = 0  # weight rows counted (a weight once per graph that gathers it)
    # Why nothing was seen, when nothing was ("no graph compiled in this process").
    unseen_reason: str = ""
    calls: int | None = None  # per graph: its calls at run time
    counted: bool = False  # total: summed over the calls the run time counted
    eager_ce_bytes: int = 0  # total: of ce_bytes, gathered outside compiled graphs
    eager_collective_bytes: int = 0  # total: of collective_bytes, outside compiled graphs

    @property
    def seen(self) -> bool:
        """True once a weight gather was counted (of any bytes)."""
        return self.weights > 0

    @property
    def share(self) -> float | None:
        """ce / (ce + collective); None when no gathered byte was counted."""
        total = self.ce_bytes + self.collective_bytes
        return self.ce_bytes / total if total else None

    def add(self, ce: int, by_reason: dict, times: int = 1) -> None:
        self.weights += 1
        self.ce_bytes += ce * times
        for why, nb in by_reason.items():
            self.by_reason[why] = self.by_reason.get(why, 0) + nb * times
            self.collective_bytes += nb * times

    def as_dict(self) -> dict:
        return dict(graph_id=self.graph_id, seen=self.seen, weights=self.weights,
                    ce_bytes=self.ce_bytes, collective_bytes=self.collective_bytes,
                    share=self.share, by_reason=dict(self.by_reason),
                    unseen_reason=self.unseen_reason, calls=self.calls, counted=self.counted,
                    eager_ce_bytes=self.eager_ce_bytes, eager_collective_bytes=self.eager_collective_bytes)

    def line(self) -> str:
        label = "total" if self.graph_id is None else f"graph {self.graph_id}"
        if self.graph_id is None and self.counted:
            when = (" at run time (every call of every graph, gathers outside compiled graphs "
                    f"included: {self.eager_ce_bytes + self.eager_collective_bytes:,d} B)")
        elif self.graph_id is not None and self.calls is not None:
            when = f" per call ({self.calls} call(s) ran)"
        else:
            when = ""
        if not self.seen:
            return (f"coverage {label}: no weight gather seen yet"
                    + (f" ({self.unseen_reason})" if self.unseen_reason else ""))
        why = "".join(f"; {nb:,d} B {reason}" for reason, nb in
                      sorted(self.by_reason.items(), key=lambda kv: -kv[1]))
        if self.share is None:
            return (f"coverage {label}: 0 gathered B in {self.weights} weight gather(s) "
                    f"(their shards hold no bytes){why}")
        return (f"coverage {label}: {100 * self.share:.1f}% of {self.ce_bytes + self.collective_bytes:,d} "
                f"gathered B on the copy engines ({self.ce_bytes:,d} B){when}{why}")


@dataclasses.dataclass
class CoverageReport:
    """``explain().coverage()``: ``per_graph`` in the order of ``explain().graphs`` (bytes
    per call); ``total`` summed over the calls that ran (``total.counted``; NOTE [calls,
    not graphs] in report.py), gathers outside compiled graphs included; ``eager`` lists
    those, one dict per (weight, path, reason, where) with its gathers and bytes."""

    total: Coverage
    per_graph: list
    eager: list = dataclasses.field(default_factory=list)

    @property
    def seen(self) -> bool:
        """False in a process that has counted no weight gather yet ("nothing seen", which
        is not "100%")."""
        return self.total.seen

    def as_dict(self) -> dict:
        return dict(total=self.total.as_dict(), per_graph=[c.as_dict() for c in self.per_graph],
                    eager=[dict(e) for e in self.eager])

    def eager_lines(self, names: int = 4) -> list[str]:
        """The gathers outside compiled graphs, one line per (path, reason, where)."""
        groups: dict = {}
        for e in self.eager:
            g = groups.setdefault((e["path"], e["reason"], e["where"]), [0, 0, []])
            g[0] += e["gathers"]
            g[1] += e["bytes"]
            g[2].append(e["weight"])
        out = []
        for (path, reason, at), (n, nb, ws) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
            on = "on the copy engines" if path == "ce" else f"on the collective: {reason}"
            shown = ", ".join(ws[:names]) + (f", ... ({len(ws)} weights)" if len(ws) > names else "")
            out.append(f"eager    {at}: {n} gather(s), {nb:,d} B {on} [{shown}]")
        return out


@dataclasses.dataclass
class Explanation:
    config: dict
    graphs: list  # report.GraphRecord
    binds: list  # binding.BindResult
    windows: list[WindowInfo]
    weights: list[WeightRow]
    kernel_paths: dict  # device type -> gather kernel path in use (when the runtime says)
    torch: str = ""  # the torch it runs on (torch.__version__: "2.13.0+cpu", "2.11.0+cu130")
    # One row per FSDP2 param group of every enabled model (torch_ce/fsdp2/report.py).
    fsdp2: list = dataclasses.field(default_factory=list)

    def coverage(self) -> CoverageReport:
        """The share of gathered bytes on the copy engines, per graph and in total, and
        what stayed on the collective by reason (from the weight rows: the run-time verdict,
        a bind's fallback included)."""
        per = {g.graph_id: Coverage(graph_id=g.graph_id) for g in self.graphs}
        calls, eager = dict(report.calls), dict(report.eager)
        counted = bool(calls or eager)
        # NOTE [calls, not graphs] in report.py: a key's calls go to its latest record.
        latest = {g.step_key: g.graph_id for g in self.graphs if g.step_key is not None}
        ncalls = {gid: calls.get(key, 0) for key, gid in latest.items()}
        for g in self.graphs:
            if counted and g.step_key is not None:
                per[g.graph_id].calls = ncalls.get(g.graph_id, 0)
        total = Coverage(counted=counted)
        for w in self.weights:
            c = per.get(w.graph_id)
            if c is not None:
                c.add(w.ce_bytes, w.by_reason)
            # counted: times its graph ran (a graph without a step: once, as compiled)
            times = 1 if c is None or c.calls is None else c.calls
            total.add(w.ce_bytes, w.by_reason, times)
        rows = []
        for (name, path, reason, at), (n, nb) in sorted(eager.items()):
            rows.append(dict(weight=name, path=path, reason=reason, where=at, gathers=n, bytes=nb))
            if path == "ce":
                total.add(nb, {})
                total.eager_ce_bytes += nb
            else:
                total.add(0, {f"{reason} (outside compiled graphs: {at})": nb})
                total.eager_collective_bytes += nb
        if not total.seen:
            total.unseen_reason = (
                "no graph compiled in this process" if not self.graphs else
                f"{len(self.graphs)} graph(s) compiled, none gathers a weight")
        for c in per.values():
            if not c.seen:
                c.unseen_reason = "this graph gathers no weight"
        return CoverageReport(total, [per[g.graph_id] for g in self.graphs], rows)

    def reduce_scatter_coverage(self) -> dict:
        """Gradient reduce-scatter bytes per call (inputs) on the copy engines and on the
        collective by reason, as compiled; what the run time then did (a bucket over the
        workspace cap runs the collective) under ``served``; the workspaces' bytes."""
        ce, coll, by_reason = 0, 0, collections.Counter()
        for g in self.graphs:
            for r in getattr(g, "reduce_scatters", ()):
                if r["kind"] == "ce":
                    ce += r["bytes"]
                else:
                    coll += r["bytes"]
                    by_reason[r["reason"]] += r["bytes"]
        from .runtime import reduce_scatter as RS
        from .runtime.reduce_scatter import workspace as RW

        return dict(ce_bytes=ce, collective_bytes=coll, by_reason=dict(by_reason),
                    share=ce / (ce + coll) if ce + coll else None,
                    served={k: dataclasses.asdict(v) for k, v in RS.served.items()},
                    workspace_bytes={f"{list(k[0])}/{k[1]}/{k[2]}": w.nbytes for k, w in RW.pools().items()})

    def as_dict(self) -> dict:
        return dict(
            coverage=self.coverage().as_dict(),
            reduce_scatter_coverage=self.reduce_scatter_coverage(),
            config=self.config,
            graphs=[dataclasses.asdict(g) for g in self.graphs],
            binds=[dataclasses.asdict(b) for b in self.binds],
            windows=[dict(dataclasses.asdict(w), fill=w.fill) for w in self.windows],
            weights=[dataclasses.asdict(w) for w in self.weights],
            kernel_paths=dict(self.kernel_paths),
            torch=self.torch,
            fsdp2=[dataclasses.asdict(r) for r in self.fsdp2],
            fsdp2_totals=self.fsdp2_totals(),
            fsdp2_hint=self.fsdp2_hint(),
        )

    def fsdp2_hint(self) -> str:
        """One line where training groups were gathered only with grad off (what to set for
        inference: fsdp2/report.py ``inference_hint``), or ""."""
        if not self.fsdp2:
            return ""
        from .fsdp2.report import inference_hint

        return inference_hint(self.fsdp2)

    def fsdp2_totals(self) -> dict:
        """What the FSDP2 groups' calls moved since enable(): all-gather output and
        reduce-scatter input bytes, on the copy engines and on the collective by reason
        (NOTE [FSDP2 bytes as run] in torch_ce/fsdp2/report.py)."""
        if not self.fsdp2:
            return {}
        from .fsdp2.report import totals

        return totals(self.fsdp2)

    def table(self) -> str:
        out = [f"torch_ce explain (transport={self.config['transport']}, torch {self.torch})"]
        for dev, path in self.kernel_paths.items():
            out.append(f"gather kernel ({dev}): {path}")
        if not self.graphs:
            out.append("  no graph compiled in this process (or all served from the FX graph cache)")
        by_graph = collections.defaultdict(list)
        for w in self.weights:
            by_graph[w.graph_id].append(w)
        for g in self.graphs:
            rows = by_graph[g.graph_id]
            width = max([24] + [len(w.param) for w in rows])
            if g.transport != "copy_engine":
                out.append(f"graph {g.graph_id} (transport={g.transport}): {len(rows)} weight(s) "
                           "on the collective")
            else:
                bound = [w for w in rows if w.status != "refused"]
                mib = sum(w.bytes for w in bound) / 2**20
                out.append(f"graph {g.graph_id}: {len(bound)} weight(s) on the copy engine "
                           f"({mib:.2f} MiB/rank), {len(rows) - len(bound)} refused")
            for w in rows:
                many = f"  ({w.gathers} gathers)" if w.gathers > 1 else ""
                if w.status in ("refused", "collective"):
                    label = "refused" if w.status == "refused" else "nccl"
                    out.append(f"  {label:<8} {w.param:<{width}} {w.reason}{many}")
                    continue
                where = {"bound": f"window {w.window} @ {w.offset}"
                                  + (f" (staging slot, {w.staged})" if w.staged else ""),
                         "fallback": f"stays on the collective backend: {w.reason}"}.get(w.status, w.status)
                label = w.status if w.status in ("bound", "fallback") else "planned"
                over = f"  over {w.mesh_dim}" if w.mesh_dim else ""
                out.append(f"  {label:<8} {w.param:<{width}} {w.bytes:>12,d} B  {where}{over}{many}")
                if w.rows:
                    out.append(f"           {_rows_text(w.rows)}")
            for b in g.buckets:
                if len(b["members"]) > 1:
                    out.append(f"  bucket   {b['kind']:<10} {len(b['members'])} members, {b['bytes']:,d} B")
            if g.reorder:
                r = g.reorder
                if r.get("kept"):
                    out.append(f"  overlap  {r['kept']}")
                else:
                    out.append(f"  overlap  {r['launches']} launch(es), {r['compute_limited']} compute-limited"
                               + ("" if r["valid"] else " (order rejected: unchanged)"))
            rs = getattr(g, "reduce_scatters", [])
            if rs:
                on = [r for r in rs if r["kind"] == "ce"]
                why = collections.Counter()
                for r in rs:
                    if r["kind"] != "ce":
                        why[r["reason"]] += r["bytes"]
                out.append(f"  reduce-scatter {len(on)} of {len(rs)} on the copy engines "
                           f"({sum(r['bytes'] for r in on):,d} of {sum(r['bytes'] for r in rs):,d} B per call)"
                           + "".join(f"; {nb:,d} B {reason}" for reason, nb in why.most_common()))
        cov = self.coverage()
        for c in cov.per_graph:
            out.append(c.line())
        out.extend(cov.eager_lines())
        out.append(cov.total.line())
        rsc = self.reduce_scatter_coverage()
        if rsc["share"] is not None:
            out.append(f"reduce-scatter coverage total: {100 * rsc['share']:.1f}% of "
                       f"{rsc['ce_bytes'] + rsc['collective_bytes']:,d} reduced B on the copy engines "
                       f"({rsc['ce_bytes']:,d} B)" + "".join(
                           f"; {nb:,d} B {reason}" for reason, nb in
                           sorted(rsc["by_reason"].items(), key=lambda kv: -kv[1])))
        for name, sv in rsc["served"].items():
            if sv["collective_bytes"]:
                out.append(f"  reduce-scatter {name}: {sv['collective_bytes']:,d} B of {sv['calls']} call(s) "
                           f"ran on the collective: {sv['reason']}")
        for key, nb in rsc["workspace_bytes"].items():
            out.append(f"reduce-scatter workspace {key}: {nb:,d} B")
        for i, b in enumerate(self.binds):
            out.append(f"bind {i}: {len(b.bound)} moved into windows ({b.bytes_bound / 2**20:.2f} MiB), "
                       f"{len(b.already_bound)} already bound, {len(b.skipped)} skipped, "
                       f"{b.windows_opened} window(s) opened"
                       + (f", cast slots {getattr(b, 'cast_slot_bytes', 0):,d} B (param_dtype copies "
                          "held beside the weights)" if getattr(b, "cast_slot_bytes", 0) else ""))
            for name, why in list(b.skipped.items())[:8]:
                out.append(f"  skipped  {name}: {why}")
            unwatched = getattr(b, "no_version_counter", None) or []
            if unwatched:  # NOTE [inference tensors at bind] in runtime/inference_tensors.py
                out.append(f"  note     {len(unwatched)} weight(s) without a version counter (inference "
                           f"tensors: {', '.join(unwatched[:8])}"
                           + (f" and {len(unwatched) - 8} more" if len(unwatched) > 8 else "")
                           + "): write them only inside torch_ce.updating_weights")
        out.extend(_fsdp2_lines(self.fsdp2))
        for w in self.windows:
            out.append(f"window {w.dtype}/{w.device} group {list(w.group_ranks)} #{w.index}"
                       + (f" ({w.owner})" if w.owner else "") + ": "
                       f"{w.slots} slot(s), {w.used:,d} / {w.nbytes:,d} B ({100 * w.fill:.0f}% full)")
        return "\n".join(out)


def _rows_text(r: dict) -> str:
    if r["reason"]:
        return r["reason"]
    per = ("? B (dynamic ids shape)" if r["bytes_per_forward"] is None
           else f"{r['rows']:,d} x {r['row_bytes']:,d} B = {r['bytes_per_forward']:,d} B")
    return f"row gather: {r['lookups']} lookup(s), {per} read per forward"


def _weights(graphs, binds) -> list[WeightRow]:
    """Per graph and weight: the record's verdict, completed from the run-time registry."""
    slots = {}  # the bind step registers the param name; a staging slot also its dtype
    for s in W.bound_slots():
        slots[s.name] = s
        slots[(s.name, str(s.dtype).removeprefix("torch."))] = s
    skipped = {}
    for b in binds:
        skipped.update(b.skipped)
    rows = []
    for g in graphs:
        for b in g.bound:
            key = b.get("param") or b["name"]
            row = WeightRow(g.graph_id, key, b["name"], "not bound yet", b.get("gathers", 1),
                            b["bytes"], str(b.get("group", "")),
                            mesh_dim=report.mesh_dims.get(str(b.get("group", "")), ""),
                            rows=dict(b.get("rows") or {}), staged=b.get("staged") or "")
            slot = slots.get((key, row.staged)) or (slots.get(key) if not row.staged else None)
            ce, by = b.get("ce_gathered_bytes", 0), dict(b.get("collective_bytes") or {})
            if slot is not None:
                row.status, row.window, row.offset = "bound", slot.window.index, slot.offset
            elif key in skipped:
                row.status, row.reason = "fallback", skipped[key]
            if slot is None and ce:  # refused at bind, or planned and no bind has run here
                why = row.reason or "not bound yet (its graph has not run here)"
                by[why] = by.get(why, 0) + ce
                ce = 0
            row.ce_bytes, row.by_reason, row.collective_bytes = ce, by, sum(by.values())
            rows.append(row)
        for r in g.refused:
            by = dict(r.get("collective_bytes") or {})
            status = "refused" if g.transport == "copy_engine" else "collective"
            rows.append(WeightRow(g.graph_id, r.get("param") or r["name"], r["name"], status,
                                  r.get("gathers", 1), reason=r["reason"],
                                  collective_bytes=sum(by.values()), by_reason=by))
    return rows


def _fsdp2_rows() -> list:
    """FSDP2 groups' rows, when torch_ce.fsdp2 was used in this process."""
    import sys

    mod = sys.modules.get("torch_ce.fsdp2")
    return mod.rows() if mod is not None else []


def _fsdp2_lines(rows) -> list:
    if not rows:
        return []
    from .fsdp2 import lines

    return lines(rows)


def _kernel_paths(device_types) -> dict:
    from .runtime.gather import kernel_path

    out = {}
    for dev in sorted(device_types):
        try:
            out[dev] = kernel_path(dev)
        except Exception as e:  # noqa: BLE001 (a report must not raise)
            out[dev] = f"unknown ({e})"
    return out


def explain(print_table: bool = False) -> Explanation:
    """What torch_ce did in this process: per graph and weight, per bind, per window."""
    slots_per = collections.Counter(id(s.window) for s in W.bound_slots())
    wins = []
    for key, pool in WP.pools().items():
        for w in pool.windows:
            wins.append(WindowInfo(key[0], key[1], key[2], w.index, w.nbytes, w.used, slots_per[id(w)],
                                   key[3] if len(key) > 3 else ""))
    import torch

    graphs, binds = list(report.graphs), list(report.binds)
    devices = {w.device for w in wins}
    if not devices:  # nothing bound yet: the kernels a bind would use here
        devices = {"cpu", "cuda"} if torch.cuda.is_available() else {"cpu"}
    e = Explanation(dataclasses.asdict(config), graphs, binds, wins, _weights(graphs, binds),
                    _kernel_paths(devices), torch.__version__, _fsdp2_rows())
    if print_table:
        print(e.table())
    return e
