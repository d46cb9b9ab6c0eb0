"""Row gathers of embedding lookups (NOTE [row gathers] in torch_ce/passes/rows.py) on CPU
ranks with the host transport: ``magi::ce_gather_rows`` on bound shards, and compiled
SimpleFSDP-style models whose embedding lookups become row gathers (or stay full gathers,
with their reason). Every output is compared exactly with the full gather + ``embedding``
(the op) or with the eager model (compiled; a bf16 ``param_dtype`` model, whose table is
looked up in its cast slot, with the plain compiled one), on fresh random data each run.

``_rank_op`` also runs on GPUs (test/test_rows_cuda.py).
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from mp_harness import TitanEmbedding, fsdp_every_param, randn, reference_all_gather, run_ranks, seed_base, setup_compile

# (dtype, rows per rank, dim): row sizes of 96, 10 and 24 bytes (16-, 2- and 8-byte
# aligned rows: every vector width of the CUDA kernel).
TABLES = ((torch.float32, 7, 24), (torch.bfloat16, 5, 5), (torch.float16, 6, 12))


def _id_cases(total: int, rows: int, ws: int, gen: torch.Generator) -> dict:
    """ids spanning every rank's rows, repeated, every rank in one batch, 1-D and 2-D."""
    every = torch.randperm(total, generator=gen)
    some = torch.randint(0, total, (5,), generator=gen)
    # Row i of this 2-D batch holds ids that rank i owns.
    per_rank = torch.stack([r * rows + torch.randint(0, rows, (4,), generator=gen) for r in range(ws)])
    return {
        "every_row": every,
        "repeated": torch.cat([some, some.flip(0), some[:2]]),
        "per_rank_2d": per_rank,
        "int32_3d": torch.randint(0, total, (2, 3, 4), generator=gen, dtype=torch.int32),
        "last_rows": torch.tensor([total - 1, 0, total - 1, rows, rows - 1]),
        "empty": torch.empty(0, dtype=torch.long),
    }


def _rank_op(rank, ws, base, device_type):
    """The op on bound shards, on a refused (Fallback) shard, and its errors."""
    import torch_ce
    import torch_ce.runtime.windows as W
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dev = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    gen = torch.Generator(device=dev).manual_seed(base + rank)
    ids_gen = torch.Generator().manual_seed(base + 1000 + rank)  # other ids on every rank
    mesh = init_device_mesh(device_type, (ws,))
    gname = mesh.get_group(0).group_name
    params, tables = {}, {}
    for dt, rows, dim in TABLES:
        local = randn((rows, dim), dt, gen)
        tables[str(dt)] = reference_all_gather(local)
        gshape = (rows * ws, dim)
        params[str(dt)] = torch.nn.Parameter(
            DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=gshape,
                               stride=(dim, 1)), requires_grad=False)
    res = torch_ce.bind(params)
    assert sorted(res.bound) == sorted(params) and not res.skipped, res
    checked = 0
    for name, p in params.items():
        shard, table = p._local_tensor, tables[name]
        assert isinstance(W.lookup(shard), W.Slot), name
        for case, ids in _id_cases(table.shape[0], shard.shape[0], ws, ids_gen).items():
            ids = ids.to(dev)
            out = torch.ops.magi.ce_gather_rows(shard, ids, ws, gname)
            ref = torch.embedding(table, ids)
            assert out.shape == ref.shape and out.dtype == ref.dtype, (name, case, out.shape)
            assert torch.equal(out, ref), f"{name}, {case}: rows differ from gather + embedding"
            checked += 1

    # Refused by agreement (rank 1's copy is non-contiguous): the full gather, on every rank.
    b = randn((6, 8), torch.float32, gen)
    if rank == 1:
        b = b.t().contiguous().t()
    b_table = reference_all_gather(b)
    res = torch_ce.bind([b], group=dist.group.WORLD)
    assert isinstance(W.lookup(b), W.Fallback), res
    ids = torch.randint(0, 6 * ws, (3, 5), generator=ids_gen).to(dev)
    wname = dist.group.WORLD.group_name
    assert torch.equal(torch.ops.magi.ce_gather_rows(b, ids, ws, wname), torch.embedding(b_table, ids))

    with pytest.raises(RuntimeError, match="ce_gather_rows got a tensor that is not bound"):
        torch.ops.magi.ce_gather_rows(randn((4, 4), torch.float32, gen), ids, ws, wname)
    if device_type == "cpu":  # CUDA asserts on the device (as its embedding does): no test
        shard = params["torch.float32"]._local_tensor
        for bad in (7 * ws, -1):
            with pytest.raises(IndexError, match="index out of range"):
                torch.ops.magi.ce_gather_rows(shard, torch.tensor([0, bad], device=dev), ws, gname)
        # Schema and fake impl on the bound shard itself (opcheck's own tests clone it, and
        # a clone is not bound: group size 1 needs no binding).
        from torch.library import opcheck
        from torch.testing._internal.optests.fake_tensor import fake_check
        from torch.testing._internal.optests.generate_tests import safe_schema_check

        op, args = torch.ops.magi.ce_gather_rows.default, (shard, ids, ws, gname)
        safe_schema_check(op, args, {}, copy_inputs=False)
        fake_check(op, args, {})
        opcheck(op, (shard, ids.remainder(shard.shape[0]), 1, gname))
    return checked


# world 3 is slow (default suite under 15 min on 2 cores): the zoo case and test_uneven_host
# row-gather on 3 ranks by default.
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_op_rows_exact(world):
    checked = run_ranks(_rank_op, world, seed_base(), "cpu", timeout=120)
    assert checked == [len(TABLES) * 6] * world


# ---------------------------------------------------------------------------------------
# Compiled: SimpleFSDP-style models
# ---------------------------------------------------------------------------------------

VOCAB_PER_RANK, DIM = 8, 16
ROWS_CALL = re.compile(r"torch\.ops\.magi\.ce_gather_rows\.default\(")


class _LM(torch.nn.Module):
    """Embedding, one linear; ``kind``: "rows" (nn.Embedding with padding_idx), "titan"
    (the double read), "tied" (an LM head on the embedding weight), "max_norm", "cast"
    (a bf16 ``param_dtype`` over fp32 weights: every gather reads a cast slot, the lookup
    its rows)."""

    def __init__(self, vocab, kind):
        super().__init__()
        self.kind = kind
        if kind == "titan":
            self.tok = TitanEmbedding(vocab, DIM)
        else:
            kw = {"rows": dict(padding_idx=1), "max_norm": dict(max_norm=1.0)}.get(kind, {})
            self.tok = torch.nn.Embedding(vocab, DIM, **kw)
        self.lin = torch.nn.Linear(DIM, DIM)

    def forward(self, t):
        h = self.tok(t)
        h = h + self.lin(h)
        return h @ self.tok.weight.t() if self.kind == "tied" else h


KINDS = {"rows": "", "titan": "", "tied": "also read by something other than an embedding",
         "max_norm": "max_norm", "cast": ""}


def _shard(model, mesh, kind):
    if kind != "cast":
        return fsdp_every_param(model, mesh)
    from torch_ce.simple_fsdp import shard_param

    for mod in list(model.modules()):
        for pname, _ in list(mod.named_parameters(recurse=False)):
            shard_param(mod, pname, mesh, cast=torch.bfloat16)
    return model


def _rank_compiled(rank, ws, base, cache_root):
    setup_compile(cache_root, rank)
    import torch_ce
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    vocab = VOCAB_PER_RANK * ws
    gen = torch.Generator().manual_seed(base + 1 + rank)
    out = {}
    torch_ce.enable(transport="copy_engine")
    try:
        for kind in KINDS:
            torch.manual_seed(base)  # the same weights on every rank
            model = _shard(_LM(vocab, kind).eval(), mesh, kind)
            # Every rank's rows, a repeat, this rank's own ids; 2-D.
            ids = torch.cat([torch.arange(vocab), torch.randint(0, vocab, (vocab,), generator=gen)])
            ids = ids.view(4, -1)
            with torch.no_grad():
                if kind == "cast":
                    # bf16 activations: Inductor's fusions round otherwise than eager's ops, so
                    # the reference is the plain compile (NOTE [row gathers fuse as lookups]).
                    torch_ce.disable()
                    torch._dynamo.reset()
                    plain = torch.compile(model, fullgraph=True)
                    eager, eager_again = plain(ids), plain(ids.flip(1))
                    torch._dynamo.reset()
                    torch_ce.enable(transport="copy_engine")
                else:
                    eager = model(ids)
                got, codes = run_and_get_code(torch.compile(model, fullgraph=True), ids)
                again = torch.compile(model, fullgraph=True)(ids.flip(1))  # bound now; other ids
                if kind != "cast":
                    eager_again = model(ids.flip(1))
            code = "\n".join(codes)
            e = torch_ce.explain()
            row = next(w for w in e.weights if w.graph_id == e.graphs[-1].graph_id and w.param == "tok.weight")
            out[kind] = dict(exact=[torch.equal(got, eager), torch.equal(again, eager_again)],
                             dtype=str(got.dtype),
                             rows_calls=len(ROWS_CALL.findall(code)),
                             # Is the table still gathered (a member of a gather launch)?
                             full=any(row.name in b["members"] for b in e.graphs[-1].buckets),
                             status=row.status, gathers=row.gathers, rows=row.rows,
                             ids=ids.numel(), table=e.table())
        return out
    finally:
        torch_ce.disable()


def test_compiled_embedding_rows(tmp_path):
    seed = seed_base()
    res = run_ranks(_rank_compiled, 2, seed, str(tmp_path.resolve()), timeout=240)
    for rank, per in enumerate(res):
        for kind, why in KINDS.items():
            r, ctx = per[kind], f"rank {rank}, {kind} (seed {seed})"
            assert r["exact"] == [True, True], f"{ctx}: compiled != eager (cast: != plain compiled)"
            assert r["dtype"] == ("torch.bfloat16" if kind == "cast" else "torch.float32"), (ctx, r["dtype"])
            assert r["status"] == "bound", (ctx, r["status"])
            assert r["gathers"] == (2 if kind in ("titan", "tied") else 1), (ctx, r["gathers"])
            if not why:  # row gathers: no full gather of the table left
                assert r["rows_calls"] == 1 and not r["full"], (ctx, r)
                size = 2 if kind == "cast" else 4  # the cast slot's rows: bf16
                assert r["rows"] == dict(lookups=1, rows=r["ids"], row_bytes=DIM * size,
                                         bytes_per_forward=r["ids"] * DIM * size, reason="", code=0), ctx
                want = f"row gather: 1 lookup(s), {r['ids']} x {DIM * size} B = {r['ids'] * DIM * size:,d} B"
                assert want in r["table"], (ctx, r["table"])
            else:
                assert r["rows_calls"] == 0 and r["full"], (ctx, r)
                assert why in r["rows"]["reason"] and r["rows"]["reason"] in r["table"], (ctx, r)
