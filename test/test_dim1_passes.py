"""The Shard(1) pattern on hand-built post-grad graphs (no process group: literal group
names), and the host transport's strided reads on fake slots (no shared memory).

NOTE [Shard(1) reads] in passes/gate.py: only ``wait -> split(rows, dim 0) -> getitem 0..W-1
-> cat(in rank order, d >= 1)`` with nothing else reading the blocks is folded into
``magi.ce_all_gather_dim``; every variant stays refused as a re-split.
"""
from __future__ import annotations

import operator
import types

import pytest
import torch
import torch.fx as fx

import torch_ce  # noqa: F401  (the magi ops)
from torch_ce.passes import fx_utils as U
from torch_ce.passes import gate as gate_mod, plan as plan_mod, rewrite as rewrite_mod
from torch_ce.runtime.eligibility import Reason
from torch_ce.runtime.gather import copy_peers_dim

aten = torch.ops.aten


def _graph(shape=(2, 3, 4), W=2, order=None, split_size=None, cat_dim=1, extra_reader=False):
    g = fx.Graph()
    w = g.placeholder("w")
    w.meta["val"] = torch.empty(shape)
    full0 = torch.empty((W * shape[0], *shape[1:]))
    ag = g.call_function(U.ALL_GATHER, (w, W, "0"))
    ag.meta["val"] = full0
    wt = g.call_function(U.WAIT, (ag,))
    wt.meta["val"] = full0
    size = shape[0] if split_size is None else split_size
    sp = g.call_function(aten.split.Tensor, (wt, size))
    n = W * shape[0] // size
    items = [g.call_function(operator.getitem, (sp, i)) for i in range(n)]
    blocks = [items[i] for i in (order or range(n))]
    cat = g.call_function(aten.cat.default, (blocks, cat_dim))
    cat.meta["val"] = torch.cat([torch.empty((size, *shape[1:]))] * n, cat_dim)
    y = g.call_function(aten.mul.Tensor, (cat, 2))
    outs = [y] + ([g.call_function(aten.mul.Tensor, (items[0], 3))] if extra_reader else [])
    g.output(tuple(outs))
    return g


@pytest.fixture
def cfg():
    torch_ce.config.update(symm_min_shard_mib=0)
    return torch_ce.config


def test_dim1_pattern_is_eligible_and_folded(cfg):
    g = _graph()
    (seed,) = gate_mod.gate(g, cfg, is_inference=True)
    assert seed.eligible and seed.gather_dim == 1, seed.reason
    rewrite_mod.rewrite(g, plan_mod.plan([seed]))
    g.lint()
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert U.magi.ce_all_gather_dim.default in targets
    assert aten.cat.default not in targets and aten.split.Tensor not in targets
    assert operator.getitem not in targets
    ag = next(n for n in g.nodes if n.target is U.magi.ce_all_gather_dim.default)
    assert ag.args[1:] == (2, "0", 1)
    wait = next(iter(ag.users))
    assert tuple(wait.meta["val"].shape) == (2, 6, 4)
    assert [u.target for u in wait.users] == [aten.mul.Tensor]


@pytest.mark.parametrize("shape,W,d", [((2, 3, 4), 4, 2), ((5, 6), 2, 1), ((2, 3, 4), 2, -1)])
def test_other_dims_and_worlds(cfg, shape, W, d):
    (seed,) = gate_mod.gate(_graph(shape, W, cat_dim=d), cfg, is_inference=True)
    assert seed.eligible and seed.gather_dim == d % len(shape), seed.reason


@pytest.mark.parametrize("variant", [
    dict(order=[1, 0]),          # blocks in another order
    dict(split_size=1),          # not one block per rank
    dict(cat_dim=0),             # re-concatenated along dim 0 (not a Shard(d>=1) rebuild)
    dict(extra_reader=True),     # a block read by something else too
])
def test_variants_stay_refused(cfg, variant):
    (seed,) = gate_mod.gate(_graph(**variant), cfg, is_inference=True)
    assert not seed.eligible and seed.gather_dim == 0
    assert seed.reason.code == Reason.NOT_SHARD0, seed.reason


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("shape,d", [((2, 3, 4), 1), ((2, 3, 4), 2), ((3, 5), 1), ((4, 2), 0)])
def test_copy_peers_dim_is_cat(rank, shape, d):
    """The host transport's strided reads put peer r's shard where torch.cat puts it."""
    W = 3
    shards = [torch.randn(shape) for _ in range(W)]
    slot = types.SimpleNamespace(window=types.SimpleNamespace(rank=rank), group_size=W,
                                 shape=shape, peer_views=shards)
    full = list(shape)
    full[d] *= W
    out = torch.full(full, float("nan"))
    copy_peers_dim(out, slot, d)
    assert torch.equal(out, torch.cat(shards, d))


_ROWS_MAIN = r"""
#include "ce_copy.h"
#include <cstdio>
using namespace torch_ce_copy;
int main() {
  // Two peers' blocks of a [E=3, h=2, D=4] fp32 shard gathered on dim 1 over W=2:
  // width 2*4*4 = 32 B, pitch 64 B, 3 rows; and a height-1 block (a dim-0 slab).
  static char out[3 * 64], a[96], b[96], c[40], d[80];
  Block blocks[3] = {{out, a, 64, 32, 32, 3}, {out + 32, b, 64, 32, 32, 3}, {d, c, 80, 40, 40, 1}};
  std::vector<void*> dsts; std::vector<const void*> srcs; std::vector<size_t> sizes;
  rows_of(blocks, 3, dsts, srcs, sizes);
  for (size_t i = 0; i < dsts.size(); ++i) {
    const char* base = static_cast<const char*>(srcs[i]);
    int which = base >= a && base < a + 96 ? 0 : base >= b && base < b + 96 ? 1 : 2;
    const char* sb = which == 0 ? a : which == 1 ? b : c;
    const char* db = which == 2 ? d : out;
    std::printf("%d %td %td %zu\n", which, static_cast<const char*>(dsts[i]) - db, base - sb, sizes[i]);
  }
}
"""


def test_rows_of_expands_blocks_into_rows(tmp_path):
    """csrc/ce_copy.h's ``rows_of`` (the default strided strategy, NOTE [strided reads]),
    built and run on the host: block k of peer s lands at row r's ``s * width + r * pitch``
    and reads the source's row ``r * width``; a one-row block is one copy."""
    import os
    import shutil
    import subprocess

    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("needs nvcc")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    src, exe = tmp_path / "rows.cpp", tmp_path / "rows"
    src.write_text(_ROWS_MAIN)
    subprocess.run([nvcc, f"-I{os.path.join(root, 'csrc')}", "-o", str(exe), str(src)], check=True)
    got = [tuple(int(x) for x in ln.split()) for ln in
           subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()]
    want = [(0, r * 64, r * 32, 32) for r in range(3)] + [(1, 32 + r * 64, r * 32, 32) for r in range(3)]
    assert got == want + [(2, 0, 0, 40)], got
