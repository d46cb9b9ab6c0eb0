"""The copy-engine reduce-scatter's protocol on the host transport (CPU, gloo ranks), the op
called directly (NOTE [copy-engine reduce-scatter] in
torch_ce/runtime/reduce_scatter/__init__.py).

Every rank checks every output against gloo's own ``reduce_scatter_tensor`` of the same
fresh random inputs (world 2: bit-identical, a sum of two is order-free; world 3 and 4:
within fp32 rounding, and bit-identical to the documented order, the sum in group index
order, computed here from an all_gather of the inputs).

- ``test_protocol_with_a_late_rank``: worlds 2, 3 and (slow; CI's 2.11 leg) 4; one rank
  seconds late at the first call and a random rank late at others; single and coalesced
  buckets, fp32 and bf16, sum and avg, growing buckets (the workspace grows in a round), a
  subgroup; ten calls in a row reuse both halves; run twice for determinism.
- ``test_workspace_cap_keeps_the_collective``: a bucket over ``rs_workspace_cap_mib``
  runs gloo's collective on every rank, exactly, and says why.
- ``test_a_peer_that_never_pushes``: one rank skips a call: its peer's wait errors
  within ``rs_timeout_s``, naming the bucket and the peer; no hang.
- ``test_ranks_that_disagree``: ranks whose buckets differ at a workspace round get an
  error naming both.
- ``test_checks_and_group_lookups_cached``: the per-shape check raises at every call of a
  bad bucket (only good ones are cached), and a group made again under its old name is
  looked up again.
"""
from __future__ import annotations

import time

import pytest
import torch

from mp_harness import run_ranks, seed_base


def _reference_sum_in_order(x, group):
    """The documented order: chunk i summed over group index 0..W-1 in fp32."""
    import torch.distributed as dist

    w = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(w)]
    dist.all_gather(parts, x.contiguous(), group=group)
    i = dist.get_rank(group)
    acc = None
    for p in parts:
        c = p.chunk(w)[i].float()
        acc = c.clone() if acc is None else acc.add_(c)
    return acc


def _gloo(x, group, op):
    import torch.distributed as dist

    w = dist.get_world_size(group)
    out = torch.empty((x.shape[0] // w, *x.shape[1:]), dtype=torch.float32)
    dist.reduce_scatter_tensor(out, x.float().contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out / w if op == "avg" else out


def _protocol(rank, world, seed, late):
    import torch.distributed as dist

    import torch_ce

    torch_ce.config.update(rs_timeout_s=60.0)
    groups = [(dist.group.WORLD, list(range(world)))]
    if world >= 3:
        sub = list(range(world - 1))
        g = dist.new_group(sub)
        if rank in sub:
            groups.append((g, sub))
    gen = torch.Generator().manual_seed(seed + 1000 * rank)
    pick = torch.Generator().manual_seed(seed)  # the same on every rank: who is late when
    worst, got = 0.0, []
    for call in range(10):
        late_rank = late if call == 0 else int(torch.randint(world, (1,), generator=pick))
        delay = 2.0 if call == 0 else 0.3 * float(torch.rand(1, generator=pick))
        rows = 4 * (call + 1)  # growing buckets: the workspace grows
        dtype = torch.bfloat16 if call % 3 == 2 else torch.float32
        op = "avg" if call % 4 == 3 else "sum"
        for group, members in groups:
            w = len(members)
            if rank == late_rank:
                time.sleep(delay)
            xs = [torch.randn(w * rows, 7, generator=gen).to(dtype),
                  torch.randn(w * 3, generator=gen).to(dtype)]
            if call % 2:
                outs = torch.ops.magi.ce_reduce_scatter_coalesced(xs, op, w, group.group_name, f"bucket {call}")
            else:
                outs = [torch_ce.reduce_scatter(x, group, op) for x in xs]
            for x, out in zip(xs, outs, strict=True):
                assert out.dtype == x.dtype and out.shape == (x.shape[0] // w, *x.shape[1:])
                want = _reference_sum_in_order(x, group)
                if op == "avg":
                    want = want / w
                assert torch.equal(out, want.to(dtype)), (call, w, dtype, op)
                ref = _gloo(x, group, op)
                if w == 2 and dtype == torch.float32:
                    assert torch.equal(out, ref), (call, op)
                else:
                    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
                worst = max(worst, float((out.float() - ref).abs().max()))
                got.append(out.float().sum().item())
    ex = torch_ce.explain().reduce_scatter_coverage()
    assert not any(s["collective_bytes"] for s in ex["served"].values()), ex
    assert ex["workspace_bytes"], ex
    return got


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_protocol_with_a_late_rank(world):
    seed = seed_base()
    first = run_ranks(_protocol, world, seed, world - 1, timeout=240)
    again = run_ranks(_protocol, world, seed, 0, timeout=240)
    assert first == again  # deterministic, whoever is late


def _cap(rank, world, seed):
    import torch.distributed as dist

    import torch_ce

    torch_ce.config.update(rs_workspace_cap_mib=0.005)  # 5 KiB: big needs 2 * 2 * 448 * 4 B
    gen = torch.Generator().manual_seed(seed + rank)
    small = torch.randn(2 * 8, generator=gen)
    big = torch.randn(2 * 64, 7, generator=gen)
    for x, name in ((small, "small"), (big, "big")):
        out = torch.ops.magi.ce_reduce_scatter(x, "sum", world, dist.group.WORLD.group_name, name)
        assert torch.equal(out, _gloo(x, dist.group.WORLD, "sum")), name
    served = torch_ce.explain().reduce_scatter_coverage()["served"]
    return {k: (v["ce_bytes"], v["collective_bytes"], v["reason"]) for k, v in served.items()}


def test_workspace_cap_keeps_the_collective():
    for got in run_ranks(_cap, 2, seed_base(), timeout=120):
        assert got["small"] == (2 * 8 * 4, 0, ""), got
        assert got["big"][:2] == (0, 2 * 64 * 7 * 4) and "rs_workspace_cap_mib" in got["big"][2], got


def _never_pushes(rank, world, seed):
    import torch.distributed as dist

    import torch_ce
    from torch_ce.runtime.reduce_scatter import ReduceScatterError

    torch_ce.config.update(rs_timeout_s=3.0)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed + rank))
    torch_ce.reduce_scatter(x, dist.group.WORLD)  # both ranks: opens the workspace
    if rank == 1:
        time.sleep(8.0)  # never runs the second call
        return "skipped"
    t0 = time.monotonic()
    with pytest.raises(ReduceScatterError) as e:
        torch.ops.magi.ce_reduce_scatter(x, "sum", world, dist.group.WORLD.group_name, "the lm head's bucket")
    took = time.monotonic() - t0
    assert "the lm head's bucket" in str(e.value) and "rank 1" in str(e.value), e.value
    assert "rs_timeout_s" in str(e.value)
    return took


def test_a_peer_that_never_pushes():
    took, skipped = run_ranks(_never_pushes, 2, seed_base(), timeout=60)
    assert skipped == "skipped" and 3.0 <= took < 10.0, took


def _disagree(rank, world, seed):
    import torch.distributed as dist

    import torch_ce
    from torch_ce.runtime.reduce_scatter import ReduceScatterError

    torch_ce.config.update(rs_timeout_s=10.0)
    x = torch.randn(2 * (4096 if rank == 0 else 8192), generator=torch.Generator().manual_seed(seed))
    with pytest.raises(ReduceScatterError, match="disagree") as e:
        torch.ops.magi.ce_reduce_scatter(x, "sum", world, dist.group.WORLD.group_name, f"bucket of rank {rank}")
    assert "bucket of rank 0" in str(e.value) and "bucket of rank 1" in str(e.value), e.value
    return True


def test_ranks_that_disagree():
    assert run_ranks(_disagree, 2, seed_base(), timeout=60) == [True, True]


def test_checks_and_group_lookups_cached(tmp_path):
    import torch.distributed as dist

    from torch_ce.runtime import reduce_scatter as R
    from torch_ce.runtime.reduce_scatter import op as O, spec as S

    bad = [torch.randn(3, 4)]
    for _ in range(2):  # never cached: every call raises
        with pytest.raises(R.ReduceScatterError, match="does not split in 2"):
            S.spec_of(bad, "sum", 2, "a bad bucket")
    good = [torch.randn(6, 4), torch.randn(2, 5)]
    spec = S.spec_of(good, "avg", 2, "b")
    assert (spec.need, spec.nbytes, spec.sig) == (17, 34 * 4, S.signature(good, "avg", 2)[1])
    assert S.signature(good, "avg", 2)[0] == 17
    assert S.spec_of([torch.randn(6, 4), torch.randn(2, 5)], "avg", 2, "b") is spec
    with pytest.raises(R.ReduceScatterError, match="one dtype"):  # same shapes, another dtype mix
        S.spec_of([good[0], good[1].to(torch.float64)], "avg", 2, "b")
    firsts = []
    for k in range(2):  # the same group name, a new group each time
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store{k}", rank=0, world_size=1)
        try:
            name = dist.group.WORLD.group_name
            pg, ranks, index = O._group(name, 1, "b")
            assert (ranks, index) == ((0,), 0) and O._GROUPS[name][0] is pg
            firsts.append((name, pg))
            assert pg is torch._C._distributed_c10d._resolve_process_group(name)
            with pytest.raises(R.ReduceScatterError, match="group_size 2"):
                O._group(name, 2, "b")
        finally:
            dist.destroy_process_group()
    assert firsts[0][0] == firsts[1][0] and firsts[0][1] is not firsts[1][1]  # re-looked up
    R.release()
