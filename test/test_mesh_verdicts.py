"""``torch_ce.bind`` and the compiled path accept the same DTensor meshes and placements.

For each (mesh, placements) case, one weight: the compiled path's verdict is whether the
bind step of a compiled forward left that weight's shard in a window; the bind API's is
whether ``torch_ce.bind`` moved an identical fresh weight. A mesh dim of size 1 issues no
gather in the compiled graph, so e.g. ``[Shard(0), Shard(0)]`` on a (1, N) mesh is a plain
gather over the size-N dim: both paths must bind it. ``[Shard(0), Shard(0)]`` on (2, 2) is
a gather of a gathered tensor: both must refuse it. Each bound weight sits in a window of
its shard dim's group only (pools keyed by that group's ranks), and ``explain()``'s record
names that mesh dim (HSDP meshes with named dims, the shard dim first or second). One spawn per world size (2 and 4
gloo ranks), one compile each: every case is a weight of the same model.
"""
from __future__ import annotations

import random

import pytest
import torch

from mp_harness import run_ranks, setup_compile

TIMEOUT = 180
ROWS, COLS = 8, 4

# world size -> [(case name, mesh shape, mesh dim names or None)]
MESHES = {
    2: [("m2", (2,), None), ("m12", (1, 2), None), ("m21", (2, 1), None),
        ("n12", (1, 2), ("dp_rep", "dp_shard"))],
    4: [("m22", (2, 2), None), ("m14", (1, 4), None), ("m41", (4, 1), ("a", "b")),
        # HSDP meshes as torchtitan names them, the shard dim second and first.
        ("h22", (2, 2), ("dp_replicate", "dp_shard")), ("f22", (2, 2), ("dp_shard", "dp_replicate"))],
}
PLACEMENTS = {"S": "S", "RS": "RS", "SR": "SR", "SS": "SS"}
# Which placements apply to a mesh of ndim 1 / 2.
BY_NDIM = {1: ["S"], 2: ["RS", "SR", "SS"]}
# What both paths must say, where a case is certain: True binds, False refuses.
EXPECTED = {
    "m2_S": True,
    "m12_RS": True, "m12_SS": True, "m12_SR": False,  # SR: Shard(0) on the size-1 dim only
    "m21_SR": True, "m21_SS": True, "m21_RS": False,
    "n12_RS": True, "n12_SS": True, "n12_SR": False,
    "m22_RS": True, "m22_SR": True, "m22_SS": False,  # SS on (2, 2): gather of a gathered tensor
    "m14_RS": True, "m14_SS": True, "m14_SR": False,
    "m41_SR": True, "m41_SS": True, "m41_RS": False,
    "h22_RS": True, "h22_SR": True, "h22_SS": False,
    "f22_RS": True, "f22_SR": True, "f22_SS": False,
}


def _placements(code):
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(0) if c == "S" else Replicate() for c in code]


class _Cases(torch.nn.Module):
    """One weight per (mesh, placements) case; the forward gathers each (SimpleFSDP)."""

    def __init__(self, cases, fulls):
        from torch.distributed.tensor import distribute_tensor

        super().__init__()
        for name, (mesh, code) in cases.items():
            w = distribute_tensor(fulls[name], mesh, _placements(code))
            self.register_parameter(name, torch.nn.Parameter(w, requires_grad=False))

    def forward(self, x):
        from torch.distributed.tensor import Replicate

        return {name: x @ p.redistribute(placements=[Replicate()] * p.device_mesh.ndim).to_local().t()
                for name, p in self.named_parameters()}


def _rank(rank, ws, seed, cache_root):
    setup_compile(cache_root, rank)
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch_ce.runtime import windows as W

    cases, fulls = {}, {}
    gen = torch.Generator().manual_seed(seed)  # the same full weights on every rank
    for mname, shape, names in MESHES[ws]:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for code in BY_NDIM[len(shape)]:
            cases[f"{mname}_{code}"] = (mesh, code)
            fulls[f"{mname}_{code}"] = torch.randn(ROWS, COLS, generator=gen)
    model = _Cases(cases, fulls)
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(seed + 1 + rank))

    torch_ce.enable(transport="copy_engine")
    try:
        with torch.no_grad():
            out = torch.compile(model, fullgraph=True)(x)
        compiled = {n: isinstance(W.lookup(p._local_tensor), W.Slot) for n, p in model.named_parameters()}
        from torch_ce import report

        # Per bound weight: (window's group ranks, its shard dim's group ranks, mesh-dim note).
        where = {}
        for n, p in model.named_parameters():
            if compiled[n]:
                mesh, code = cases[n]
                dims = [d for d in range(mesh.ndim) if code[d] == "S" and mesh.size(d) > 1]
                pg = mesh.get_group(dims[0])
                where[n] = (W.lookup(p._local_tensor).window.group_ranks,
                            tuple(torch.distributed.get_process_group_ranks(pg)),
                            report.mesh_dims.get(pg.group_name, ""), dims[0], mesh.mesh_dim_names)
        exact = {n: torch.equal(out[n], x @ fulls[n].t()) for n in cases}
        # The bind API on identical fresh weights (nothing bound yet).
        fresh = {n: torch.nn.Parameter(distribute_tensor(fulls[n], m, _placements(c)), requires_grad=False)
                 for n, (m, c) in cases.items()}
        res = torch_ce.bind(fresh)
        bound = {n: n in res.bound for n in cases}
        after = {n: torch.equal(p.full_tensor(), fulls[n]) for n, p in fresh.items()}
        # A bound weight's CE gather over the group bind chose gives the full weight.
        from torch_ce.runtime.binding import candidate_from_param

        for n in res.bound:
            group = candidate_from_param(n, fresh[n], None, 0).group
            after[n] = after[n] and torch.equal(torch_ce.all_gather(fresh[n]._local_tensor, group), fulls[n])
        return dict(compiled=compiled, bind=bound, skipped=dict(res.skipped), exact=exact, after=after,
                    where=where)
    finally:
        torch_ce.disable()


# ws 4 is slow (default suite under 15 min on 2 cores); 2 ranks hold every mesh verdict.
@pytest.mark.parametrize("ws", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_bind_and_compiled_path_agree_per_mesh(ws, tmp_path):
    seed = random.randrange(1 << 20)
    res = run_ranks(_rank, ws, seed, str(tmp_path.resolve()), timeout=TIMEOUT)
    for rank, r in enumerate(res):
        bad = {n: ok for n, ok in r["exact"].items() if not ok}
        assert not bad, f"rank {rank}: compiled output != x @ W.t() for {sorted(bad)} (seed {seed})"
        assert all(r["after"].values()), f"rank {rank}: bound weight's value or CE gather wrong: {r['after']}"
        differ = {n: (r["compiled"][n], r["bind"][n], r["skipped"].get(n)) for n in r["compiled"]
                  if r["compiled"][n] != r["bind"][n]}
        assert not differ, f"rank {rank}: (compiled, bind, bind's reason) differ: {differ}"
        want = {n: EXPECTED[n] for n in r["compiled"]}
        assert r["compiled"] == want, f"rank {rank}: compiled verdicts {r['compiled']} != {want}"
        for n, (window_ranks, shard_ranks, note, dim, names) in r["where"].items():
            assert window_ranks == shard_ranks and rank in shard_ranks, (rank, n, window_ranks, shard_ranks)
            label = repr(names[dim]) if names else f"dim {dim}"
            assert label in note, (rank, n, note, label)
