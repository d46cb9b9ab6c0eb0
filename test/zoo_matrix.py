"""The zoo matrix: its cases, what one case runs on every rank, and how a case's results
are judged. Shared by test/test_zoo_matrix.py (pytest) and test/zoo_matrix_report.py (the
case-by-case table).

One case = a family of test/zoo_models.py x a parallelism mode x inference or training x
fp32 or bf16 ``param_dtype`` x a world size. On every rank it runs twice in one process:

1. plain ``torch.compile`` (torch_ce not enabled): the reference;
2. ``torch_ce.enable(transport="copy_engine")`` (the host transport on CPU), same weights,
   same batches;

and returns both runs' outputs (inference: the logits of two calls, each rank its own
tokens) or losses (training: a few AdamW steps, ``loss.backward()``), plus the coverage of
the torch_ce run (``coverage``). The judge (``failures``) wants every output and loss
bit-identical (``torch.equal``) and ``coverage.total.share >= MIN_SHARE`` on every rank.

``Case.exercises``: what a case takes beyond an even Shard(0) model (uneven shards, an
empty shard, cast slots, a mutated input, Shard(1) experts): the report's column, and
where to look when a case fails. Every case is asserted in full.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time

import torch

MIN_SHARE = 0.99
INFER_CALLS = 2  # a second call: the empty-shard failure shows only there
TRAIN_STEPS = 3
BATCH, SEQ = 2, 17  # tokens per rank: [BATCH, SEQ - 1] in, the next token as the label


@dataclasses.dataclass(frozen=True)
class Case:
    family: str  # zoo_models.FAMILIES
    mode: str  # "fully_shard" | "hsdp" (dp_replicate 2 x fsdp) | "ep" (ep 2)
    phase: str  # "infer" (torch.no_grad, eval) | "train" (AdamW, backward)
    dtype: str  # param_dtype: "fp32" | "bf16" (weights are fp32 either way)
    world: int
    experts: int = 4  # MoE families only

    @property
    def ep(self) -> int:
        return 2 if self.mode == "ep" else 1

    @property
    def id(self) -> str:
        ex = f"-e{self.experts}" if self.family in MOE_FAMILIES else ""
        return f"{self.family}-{self.mode}-w{self.world}-{self.phase}-{self.dtype}{ex}"

    @property
    def param_dtype(self):
        return torch.bfloat16 if self.dtype == "bf16" else None

    @property
    def fsdp(self) -> int:
        """The dense mesh's shard size (fsdp)."""
        return self.world // (2 if self.mode == "hsdp" else 1)

    @property
    def experts_dim1(self) -> bool:
        """graph_trainer shards routed experts on dim 1 when efsdp * ep > num_experts."""
        if self.family not in MOE_FAMILIES:
            return False
        efsdp = self.fsdp // self.ep
        return efsdp * self.ep > self.experts

    @property
    def timeout(self) -> int:
        """Seconds for the whole case (both runs) before the harness dumps stacks and kills:
        meant to catch a hang, not slowness. Compiling dominates a case on CPU (Dynamo,
        Inductor's C++ kernels): ~100 s for a 2-rank inference case on 2 idle cores, 3-4x
        that when the cores are shared, hence the margin."""
        base = 480 if self.phase == "infer" else 720
        return base + 90 * (self.world - 2) + (120 if self.family in MOE_FAMILIES else 0)

    @property
    def exercises(self) -> frozenset:
        return exercises(self)


MOE_FAMILIES = ("qwen3_moe", "deepseek_v3")


def _has_empty_shard(rows: int, ranks: int) -> bool:
    """torch.chunk of ``rows`` into ``ranks`` pieces leaves a rank without rows."""
    return math.ceil(rows / ranks) * (ranks - 1) >= rows


def exercises(c: Case) -> frozenset:
    """What ``c`` takes beyond an even Shard(0) model (module docstring); empty: nothing.

    - uneven: dims not divisible by the dense mesh (world 3): padded slots, and in training
      the reshard that decides alike on every rank (the case that hung);
    - cast slots: bf16 ``param_dtype`` inference of fp32 weights;
    - empty shard: the MoE router gate ``[experts, dim]`` on a dense mesh larger than
      ``experts``;
    - mutation: MoE training with the experts on the dense mesh (``tokens_per_expert.add_``
      mutates a graph input; the gate refuses only that input's gathers);
    - dim1: routed experts sharded on dim 1 (graph_trainer, ``efsdp * ep > num_experts``).
    """
    out = set()
    if c.fsdp == 3:
        out.add("uneven")
    if c.phase == "infer" and c.dtype == "bf16":
        out.add("cast slots")
    if c.family in MOE_FAMILIES:
        if _has_empty_shard(c.experts, c.fsdp):
            out.add("empty shard")
        if c.phase == "train" and c.mode != "ep":
            out.add("mutation")
        if c.experts_dim1:
            out.add("dim1")
    return frozenset(out)


def _matrix() -> list[Case]:
    """The full matrix (test_zoo_matrix's slow cases, zoo_matrix_report's table)."""
    cases = []
    both = [(p, d) for p in ("infer", "train") for d in ("fp32", "bf16")]
    for fam in ("llama3", "qwen3"):
        cases += [Case(fam, "fully_shard", p, d, 2) for p, d in both]
        cases += [Case(fam, "fully_shard", p, d, 3) for p, d in (("infer", "fp32"), ("train", "fp32"),
                                                                  ("train", "bf16"))]
        cases += [Case(fam, "fully_shard", p, d, 4) for p, d in (("infer", "fp32"), ("train", "bf16"))]
        cases += [Case(fam, "hsdp", p, d, 4) for p, d in (("infer", "fp32"), ("infer", "bf16"),
                                                          ("train", "bf16"))]
    for fam in MOE_FAMILIES:
        cases += [Case(fam, "fully_shard", p, d, 2) for p, d in both]
        cases += [Case(fam, "fully_shard", p, d, 4) for p, d in (("infer", "fp32"), ("train", "bf16"))]
        cases += [Case(fam, "fully_shard", "train", "fp32", 3)]
        cases += [Case(fam, "hsdp", p, d, 4) for p, d in (("infer", "fp32"), ("train", "bf16"))]
        cases += [Case(fam, "ep", p, d, 4) for p, d in both]
        cases += [Case(fam, "ep", p, d, 4, experts=2) for p, d in (("infer", "fp32"), ("train", "bf16"))]
    return cases


CASES = {c.id: c for c in _matrix()}

# The default CI subset: the case that hung (uneven shards on 3 ranks, bf16 training,
# reshard after forward: rank-independent reshard, padded slots, staging), about three
# minutes on 2 cores. Every other axis has a cheaper default test of its own (EP and
# Shard(1) experts: test_dim1_host.py; mutation: test_mutation.py; empty shards and the
# fuzz: test_no_hang.py; cast slots: test_uneven_host.py); the whole matrix is slow-marked.
DEFAULT = (
    "llama3-fully_shard-w3-train-bf16",
)
assert set(DEFAULT) <= set(CASES), sorted(set(DEFAULT) - set(CASES))


# ---------------------------------------------------------------------------------------
# Coverage: explain().coverage() when torch_ce has it, else the same numbers from here
# ---------------------------------------------------------------------------------------


def _root_name(n):
    """The placeholder a gather's input comes from (through casts and views), or None."""
    import torch.fx as fx

    while isinstance(n, fx.Node) and n.op == "call_function" and n.args:
        n = n.args[0]
    return n.name if isinstance(n, fx.Node) and n.op == "placeholder" else None


class GatherCensus:
    """Per graph torch_ce's passes ran on: the gathers left on the collective afterwards
    (input bytes and the placeholder each reads), for ``coverage`` when ``explain()`` has no
    ``coverage()`` yet. An observer of the pass manager (``manager.observing``)."""

    def __init__(self):
        from torch_ce import report

        self.graphs: list[dict] = []
        self._seen = len(report.graphs)

    def __call__(self, graph) -> None:
        from torch_ce import report

        gid = report.graphs[-1].graph_id if len(report.graphs) > self._seen else None
        self._seen = len(report.graphs)
        c10d = torch.ops._c10d_functional
        left = []
        for n in graph.nodes:
            if n.op != "call_function":
                continue
            if n.target is c10d.all_gather_into_tensor.default:
                srcs = [n.args[0]]
            elif n.target is c10d.all_gather_into_tensor_coalesced.default:
                srcs = list(n.args[0])
            else:
                continue
            for s in srcs:
                v = s.meta.get("val")
                left.append((_root_name(s), int(v.numel()) * v.element_size() if v is not None else 0))
        self.graphs.append(dict(graph_id=gid, left=left))

    def __enter__(self):
        from torch_ce.passes import manager

        self._obs = manager.observing(self)
        self._obs.__enter__()
        return self

    def __exit__(self, *exc):
        self._obs.__exit__(*exc)


def _share(ce: int, coll: int):
    return ce / (ce + coll) if ce + coll else None


def _plain(obj):
    """A dataclass / object with attributes / dict, as plain dicts and lists."""
    if callable(getattr(obj, "as_dict", None)):  # explain()'s records (share is a property)
        return _plain(obj.as_dict())
    if dataclasses.is_dataclass(obj):
        return {k: _plain(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "ce_bytes"):
        return {k: _plain(getattr(obj, k)) for k in ("ce_bytes", "collective_bytes", "share", "by_reason")
                if hasattr(obj, k)}
    return obj


def coverage(census: GatherCensus | None) -> dict:
    """``{"total": {...}, "per_graph": {graph_id: {...}}, "source": ...}``, each entry with
    ce_bytes, collective_bytes, share (None when nothing was gathered) and by_reason
    (collective bytes per reason): ``torch_ce.explain().coverage()`` when present, else
    computed here from ``explain().as_dict()`` (bound weights' bytes, per gather; run-time
    fallbacks by their reason) and the census (gathers left on the collective, named by
    the refused weight's reason where the gather reads one)."""
    import torch_ce

    e = torch_ce.explain()
    if callable(getattr(e, "coverage", None)):
        c = e.coverage()
        out = {"total": _plain(c.total), "per_graph": _plain(getattr(c, "per_graph", {})),
               "source": "explain().coverage()"}
        return out
    d = e.as_dict()
    per: dict = {}

    def entry(gid):
        return per.setdefault(str(gid), {"ce_bytes": 0, "collective_bytes": 0, "by_reason": {}})

    def coll(gid, why, nbytes):
        g = entry(gid)
        g["collective_bytes"] += nbytes
        g["by_reason"][why] = g["by_reason"].get(why, 0) + nbytes

    refused_reason = {}
    for w in d["weights"]:
        gid = w["graph_id"]
        if w["status"] == "refused":
            refused_reason[(gid, w["name"])] = w["reason"]
            entry(gid)
            continue
        n = w["gathers"]
        if w["status"] == "bound":
            entry(gid)["ce_bytes"] += w["bytes"] * n
        else:  # a run-time fallback, or a graph that never ran
            coll(gid, w["reason"] or w["status"], w["bytes"] * n)
    for g in (census.graphs if census else []):
        gid = g["graph_id"]
        for name, nbytes in g["left"]:
            why = refused_reason.get((gid, name))
            if why is None:
                why = "collective gather beside bound ones" if gid is not None else "graph not seen by torch_ce"
            coll(gid, why, nbytes)
    total = {"ce_bytes": 0, "collective_bytes": 0, "by_reason": {}}
    for g in per.values():
        g["share"] = _share(g["ce_bytes"], g["collective_bytes"])
        total["ce_bytes"] += g["ce_bytes"]
        total["collective_bytes"] += g["collective_bytes"]
        for k, v in g["by_reason"].items():
            total["by_reason"][k] = total["by_reason"].get(k, 0) + v
    total["share"] = _share(total["ce_bytes"], total["collective_bytes"])
    return {"total": total, "per_graph": per, "source": "test adapter (explain().as_dict() + census)"}


# ---------------------------------------------------------------------------------------
# Rank side
# ---------------------------------------------------------------------------------------


def _one_run(c: Case, pdims, batches, seed: int, label: str) -> tuple[list, dict]:
    """Build, compile and run ``c`` once: inference logits per call, or training losses;
    and the model's parameter placements."""
    import zoo_models as zm

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    net = zm.build(c.family, pdims, c.param_dtype, train=c.phase == "train", seed=seed,
                   d=zm.Dims(experts=c.experts))
    compiled = torch.compile(net)
    out = []
    if c.phase == "infer":
        with torch.no_grad():
            for i, b in enumerate(batches):
                out.append(compiled(b[:, :-1]))
                _progress(f"{label}: call {i} done")
        return out, zm.placements(net)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    for i, b in enumerate(batches):
        loss = zm.next_token_loss(compiled(b[:, :-1]), b)
        _progress(f"{label}: step {i} forward done")
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.detach())
        _progress(f"{label}: step {i} done")
    return out, zm.placements(net)


_T0 = [0.0]


def _progress(msg: str) -> None:
    """One line per call / step on stderr (the report's case log; pytest shows it with
    -s): where a slow or hung case got to, and how many graphs Dynamo compiled so far."""
    import torch.distributed as dist

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"[rank {dist.get_rank()} +{time.monotonic() - _T0[0]:.0f}s] {msg} ({graphs} graph(s) compiled)",
          file=sys.stderr, flush=True)


def run_case(rank: int, world: int, case: dict, seed: int, cache: str) -> dict:
    """One case on one rank (module docstring): both runs, outputs and coverage.

    ``cache``: the root of this rank's Inductor cache (mp_harness.setup_compile), shared by
    the cases of one session: compiled kernels are content-addressed and reused, compiled
    graphs never are (no FX graph cache), so torch_ce's passes run in every case."""
    from mp_harness import setup_compile

    setup_compile(cache, rank)
    import torch_ce
    import zoo_models as zm
    from torch_ce import report

    c = Case(**case)
    pdims = zm.parallel_dims(world, c.mode, c.ep)
    n = INFER_CALLS if c.phase == "infer" else TRAIN_STEPS
    batches = [zm.tokens(zm.Dims().vocab, BATCH, SEQ, seed + 7919 * rank + i) for i in range(n)]
    _T0[0] = time.monotonic()
    ref, _ = _one_run(c, pdims, batches, seed, "plain")
    report.clear()
    torch_ce.enable(transport="copy_engine")
    try:
        with GatherCensus() as census:
            ce, placements = _one_run(c, pdims, batches, seed, "torch_ce")
    finally:
        torch_ce.disable()
    return dict(ref=ref, ce=ce, coverage=coverage(census), table=torch_ce.explain().table(),
                placements=placements if rank == 0 else {})


def failures(c: Case, res: list) -> list[str]:
    """What is wrong with a case's per-rank results (empty: it passes)."""
    bad = []
    for rank, r in enumerate(res):
        what = "logits of call" if c.phase == "infer" else "loss of step"
        for i, (a, b) in enumerate(zip(r["ref"], r["ce"])):
            if not torch.equal(a, b):
                diff = float((a.float() - b.float()).abs().max())
                bad.append(f"rank {rank}: {what} {i} differs from the plain compiled run (max |diff| {diff:g})")
        if len(r["ref"]) != len(r["ce"]):
            bad.append(f"rank {rank}: {len(r['ce'])} results, the plain run has {len(r['ref'])}")
        tot = r["coverage"]["total"]
        share = tot["share"]
        if share is None or share < MIN_SHARE:
            bad.append(f"rank {rank}: copy-engine share {share if share is None else round(share, 4)} < {MIN_SHARE} "
                       f"({tot['ce_bytes']} B on the copy engines, {tot['collective_bytes']} B on the collective: "
                       f"{tot['by_reason']})")
    if c.phase == "train" and all(len({float(x) for x in r["ref"]}) < 2 for r in res):
        bad.append("the loss does not change over the steps: nothing trains")
    return bad


def shape_checks(c: Case, placements: dict) -> list[str]:
    """The case is what it says: experts on the edp mesh under EP, on dim 1 when
    efsdp * ep > num_experts, the dense weights on fsdp (or dp_replicate x fsdp)."""
    bad = []
    dense_mesh = ("dp_replicate", "fsdp") if c.mode == "hsdp" else ("fsdp",)
    for name, (mesh, pl) in placements.items():
        is_expert = ".inner_experts." in name
        if is_expert and c.mode == "ep":
            if mesh != ("efsdp", "ep"):
                bad.append(f"{name}: on mesh {mesh}, expected ('efsdp', 'ep')")
            want = "1" if c.experts_dim1 else "0"
            if not (pl[0].startswith(f"S({want}") or pl[0].startswith(f"_S({want}")):
                bad.append(f"{name}: efsdp placement {pl[0]}, expected a shard of dim {want}")
        elif mesh != dense_mesh:
            bad.append(f"{name}: on mesh {mesh}, expected {dense_mesh}")
    return bad
