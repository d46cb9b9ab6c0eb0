"""The protocol core (NOTE [sessions: one abort per group generation] in
torch_ce/runtime/session.py) on CPU gloo ranks and the host transport: a failure in one
protocol ends a peer's wait in every other, within the failing protocol's timeout, and
fresh calls after it are exact; reduce-scatter calls are told apart by their content.

- ``test_skipped_bucket_of_another_size``: rank 0 runs buckets B (a growth round) then C,
  rank 1 only C: rank 1's C times out (``rs_timeout_s``), rank 0's wait in B's workspace
  round ends with it (it used to wait for ``bind_arrival_timeout_s``); both raise within
  ``rs_timeout_s`` + 10 s; fresh calls (one rank late) are exact.
- ``test_skipped_bucket_of_the_same_size``: every bucket one shape, rank 1 skips B of
  A B C (worlds 2 and 3): every rank raises at the mismatched call, naming both buckets;
  no rank returns a sum; fresh calls are exact.
- ``test_a_failure_ends_every_other_wait``: for each pair of protocols (bind round, update
  round, reduce-scatter flags, reduce-scatter workspace round), rank 1 fails in one after
  its 2 s timeout while rank 0 waits in the other with a 60 s timeout: rank 0 raises within
  seconds, naming rank 1's failure; then fresh calls of every protocol are exact on both
  ranks. ``test_step_words_end_and_are_ended``: the same with FSDP2's step words on one
  side (a training group that raised is refused until ``fsdp2.disable`` and ``enable``,
  which is then a full recovery).

- ``test_a_rank_killed_inside_an_update_round``: the survivor raises at the exit round
  within the update's timeout, naming the dead rank; nothing is left in /dev/shm.

Every result is checked against gloo (reduce-scatters, gathers) or FSDP2's own forward, on
fresh random data, on every rank.
"""
from __future__ import annotations

import time

import pytest
import torch

from mp_harness import run_ranks, seed_base

RS_TIMEOUT_S = 3.0


def _gloo_rs(x, world):
    import torch.distributed as dist

    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=dist.group.WORLD)
    return out


def _exact_rs(gen, world, rank, rows=24, late=None, delay=0.0, name="fresh"):
    """One CE reduce-scatter of fresh random data (``late`` rank ``delay`` s late), checked
    against gloo's on this rank; returns a checksum."""
    import torch.distributed as dist

    import torch_ce

    x = torch.randn(world * rows, 9, generator=gen)
    if rank == late:
        time.sleep(delay)
    out = torch_ce.reduce_scatter(x, dist.group.WORLD, name=name)
    ref = _gloo_rs(x, world)
    assert torch.equal(out, ref) if world == 2 else torch.allclose(out, ref, atol=1e-5), \
        float((out - ref).abs().max())
    return float(out.sum())


def _run(rank, world, calls):
    """Run ``calls`` [(name, tensor)] in order until one raises: (its name, its error,
    seconds it took), or None if none raised (then the test fails: a wrong sum went by)."""
    import torch.distributed as dist

    from torch_ce.runtime.session import PeerError

    for name, x in calls:
        t0 = time.monotonic()
        try:
            out = torch.ops.magi.ce_reduce_scatter(x, "sum", world, dist.group.WORLD.group_name, name)
        except PeerError as e:
            return name, f"{type(e).__name__}: {e}", time.monotonic() - t0
        if name != "bucket A":
            raise AssertionError(f"rank {rank}: {name} returned a sum ({float(out.sum())}) instead of raising")
        assert torch.equal(out, _gloo_rs(x, world)) if world == 2 else torch.allclose(out, _gloo_rs(x, world), atol=1e-5)
    return None


def _another_size(rank, world, seed):
    import torch_ce

    torch_ce.config.update(rs_timeout_s=RS_TIMEOUT_S)
    gen = torch.Generator().manual_seed(seed + rank)
    _exact_rs(gen, world, rank, rows=8)  # opens a small workspace on both
    b = torch.randn(world * 300, 9, generator=gen)  # 2700 elements per rank: a growth round
    c = torch.randn(world * 20, 9, generator=gen)
    calls = [("bucket B", b), ("bucket C", c)] if rank == 0 else [("bucket C", c)]
    failed = _run(rank, world, calls)
    assert failed is not None, f"rank {rank}: no call raised"
    got = [_exact_rs(gen, world, rank, late=1, delay=0.5), _exact_rs(gen, world, rank, rows=500),
           _exact_rs(gen, world, rank, late=0, delay=0.3)]
    return failed, got


def test_skipped_bucket_of_another_size():
    (f0, g0), (f1, g1) = run_ranks(_another_size, 2, seed_base(), timeout=180)
    assert f0[0] == "bucket B" and f1[0] == "bucket C", (f0, f1)
    for name, err, took in (f0, f1):
        assert err.startswith("ReduceScatterError") and took < RS_TIMEOUT_S + 10, (name, err, took)
    assert "rank 1" in f0[1] and "bucket C" in f0[1] and "bucket B" in f0[1], f0
    assert "rank 0" in f1[1] and "rs_timeout_s" in f1[1], f1
    assert len(g0) == len(g1) == 3


def _same_size(rank, world, seed):
    import torch_ce

    torch_ce.config.update(rs_timeout_s=RS_TIMEOUT_S)
    gen = torch.Generator().manual_seed(seed + rank)
    xs = {k: torch.randn(world * 16, 10, generator=gen) for k in "ABC"}
    order = "AC" if rank == 1 else "ABC"
    if rank == 1:
        time.sleep(1.0)
    failed = _run(rank, world, [(f"bucket {k}", xs[k]) for k in order])
    assert failed is not None, f"rank {rank}: no call raised"
    got = [_exact_rs(gen, world, rank, late=1, delay=0.4, name="bucket A"),
           _exact_rs(gen, world, rank, name="bucket B")]
    return failed, got


@pytest.mark.parametrize("world", [2, 3])
def test_skipped_bucket_of_the_same_size(world):
    res = run_ranks(_same_size, world, seed_base(), timeout=180)
    for rank, (failed, got) in enumerate(res):
        name, err, took = failed
        assert name == ("bucket C" if rank == 1 else "bucket B"), (rank, failed)
        assert err.startswith("ReduceScatterError") and took < RS_TIMEOUT_S + 10, (rank, failed)
        assert "bucket B" in err and "bucket C" in err, (rank, err)
        assert len(got) == 2


# ---------------------------------------------------------------------------------------
# A failure in one protocol ends a peer's wait in every other
# ---------------------------------------------------------------------------------------

PROTOCOLS = ("bind", "update", "rs", "rs_round", "step")
SHORT_S, LONG_S = 2.0, 60.0


class _Core:
    """Every protocol's state on one rank: bound weights (update rounds), a reduce-scatter
    pool, an FSDP2 training model (step words)."""

    def __init__(self, rank, world, seed):
        import fsdp2_models as M
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        import torch_ce

        self.rank, self.world, self.seed = rank, world, seed
        self.gen = torch.Generator().manual_seed(seed + rank)
        self.mesh = init_device_mesh("cpu", (world,))
        self.group = dist.group.WORLD
        full = torch.randn(64, 16, generator=torch.Generator().manual_seed(seed))
        self.w = torch.nn.Parameter(distribute_tensor(full, self.mesh, [Shard(0)]), requires_grad=False)
        torch_ce.bind([self.w], group=self.group, min_shard_mib=0)
        self.model = M.build("dit", self.mesh, seed, train=True)
        self.ref = M.build("dit", self.mesh, seed, train=True)
        torch_ce.fsdp2.enable(self.model, timeout_s=LONG_S)
        self.inp = M.dit_inputs(seed + 7)
        self.binds = 0

    # -- each protocol, as a user runs it: (wait, timeout) ------------------------------

    def run(self, proto: str, timeout_s: float, seed: int = 0) -> None:
        from torch.distributed.tensor import DTensor, Shard

        import torch_ce

        if proto == "bind":
            with torch_ce.config.patch(bind_arrival_timeout_s=timeout_s, bind_timeout_s=timeout_s):
                full = torch.randn(32, 8, generator=torch.Generator().manual_seed(self.seed + seed))
                local = full.chunk(self.world)[self.rank].clone()  # no collective: a peer may be elsewhere
                w = torch.nn.Parameter(DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False),
                                       requires_grad=False)
                torch_ce.bind([w], group=self.group, min_shard_mib=0)
                assert torch.equal(torch_ce.all_gather(w._local_tensor), full)
        elif proto == "update":
            with torch_ce.updating_weights([self.w], timeout_s=timeout_s):
                self.w._local_tensor.mul_(1.0)
        elif proto in ("rs", "rs_round"):
            rows = 24 if proto == "rs" else 4000  # rs_round: a workspace larger than any before
            with torch_ce.config.patch(rs_timeout_s=timeout_s, bind_arrival_timeout_s=timeout_s):
                x = torch.randn(self.world * rows, 9, generator=self.gen)
                out = torch_ce.reduce_scatter(x, self.group, name=f"core {proto}")
                assert torch.equal(out, _gloo_rs(x, self.world))
        elif proto == "step":
            for c in _comms(self.model):
                c.timeout_s = timeout_s
            self.model(*self.inp)
        else:
            raise AssertionError(proto)

    def recover_step_words(self) -> None:
        """FSDP2's training gathers raise once they failed: disable and enable again."""
        import torch_ce

        torch_ce.fsdp2.disable(self.model)
        torch_ce.fsdp2.enable(self.model, timeout_s=LONG_S)

    def all_exact(self) -> None:
        """Fresh calls of every protocol, exact on this rank."""
        import torch_ce

        self.binds += 1  # the same count on every rank: the same weight
        self.run("bind", LONG_S, seed=self.binds)
        self.run("update", LONG_S)
        _exact_rs(self.gen, self.world, self.rank, late=1, delay=0.3, name="core rs")
        with torch.no_grad():
            got, want = self.model(*self.inp), self.ref(*self.inp)
        assert torch.equal(got, want), float((got - want).abs().max())
        assert torch.equal(torch_ce.all_gather(self.w._local_tensor), self.w.full_tensor())


def _comms(model):
    import torch_ce.fsdp2 as F

    e = F._entry(model)
    return list(e.comms.values()) if e is not None else []


def _matrix(rank, world, seed, pairs, recover=True):
    import torch.distributed as dist

    from torch_ce.runtime.session import PeerError

    core = _Core(rank, world, seed)
    core.all_exact()
    out = []
    for waits, fails in pairs:
        dist.barrier()
        t0 = time.monotonic()
        err = ""
        try:
            if rank == 0:
                core.run(waits, LONG_S)  # rank 1 never comes: it fails elsewhere
            else:
                core.run(fails, SHORT_S)  # rank 0 never comes: it waits elsewhere
        except PeerError as e:
            err = f"{type(e).__name__}: {e}"
        took = time.monotonic() - t0
        dist.barrier()
        if recover and "step" in (waits, fails):
            core.recover_step_words()  # a training group that raised: disable and enable
        if recover:
            core.all_exact()  # fresh calls of every protocol after the failure, no release_all()
        out.append((waits, fails, err, took))
    return out


def _check_pairs(res) -> None:
    bad = []
    for (w, f, err0, took0), (_, _, err1, took1) in zip(*res):
        if not (err1 and took1 < SHORT_S + 5):
            bad.append(f"rank 1 failing in {f}: {err1!r} after {took1:.1f} s")
        if not (err0 and took0 < SHORT_S + 5 and "rank 1" in err0):
            bad.append(f"rank 0 waiting in {w} while rank 1 failed in {f}: {err0!r} after {took0:.1f} s")
    assert not bad, "\n".join(bad)


def test_a_failure_ends_every_other_wait():
    """Rank 0 waits in one protocol (60 s bound), rank 1 fails in another (2 s), for every
    pair of rounds and reduce-scatter waits: both raise, rank 0 within a few seconds,
    naming rank 1; then every protocol's fresh calls are exact on both ranks (no
    ``release_all()``)."""
    protos = ("bind", "update", "rs", "rs_round")
    pairs = [(w, f) for w in protos for f in protos if f != w and {w, f} != {"rs", "rs_round"}]
    _check_pairs(run_ranks(_matrix, 2, seed_base(), pairs, timeout=600))


@pytest.mark.parametrize("pair", [("step", "update"), ("update", "step"), ("rs", "step")], ids="-".join)
def test_step_words_end_and_are_ended(pair):
    """FSDP2's step words meet the other protocols' failures too: rank 0 waiting in a
    training gather while rank 1 fails an update round raises within seconds, and a step
    word that times out on rank 1 ends rank 0's update round or reduce-scatter wait; after
    ``fsdp2.disable`` and ``enable`` on every rank (a forward that raised left FSDP2 mid
    pass) every protocol's fresh calls are exact."""
    _check_pairs(run_ranks(_matrix, 2, seed_base(), [pair], timeout=300))


def _killed_in_update(rank, world, seed, out_dir):
    """Rank 1 exits inside ``updating_weights`` (after the enter round); rank 0 reports
    what it saw in a file (the harness fails the run: a rank died) and exits too."""
    import json
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import torch_ce

    torch_ce.config.update(shm_prefix=f"tceu{seed}_")
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(64, 16, generator=torch.Generator().manual_seed(seed))
    w = torch.nn.Parameter(DTensor.from_local(full.chunk(world)[rank].clone(), mesh, [Shard(0)], run_check=False),
                           requires_grad=False)
    torch_ce.bind([w], group=dist.group.WORLD, min_shard_mib=0)
    t0 = time.monotonic()
    try:
        with torch_ce.updating_weights([w], timeout_s=3.0):
            if rank == 1:
                os._exit(0)
            w._local_tensor.mul_(2.0)
        err = "no error"
    except Exception as e:  # noqa: BLE001 (reported to the test)
        err = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, "survivor"), "w") as f:
        json.dump({"error": err, "took": time.monotonic() - t0}, f)
    os._exit(0)


def test_a_rank_killed_inside_an_update_round(tmp_path):
    """A rank that dies inside ``updating_weights``: its peer raises ``UpdateError`` at the
    exit round within the update's timeout, naming it, and /dev/shm holds nothing of the job."""
    import glob
    import json

    seed = seed_base()
    with pytest.raises(pytest.fail.Exception, match="exited with code 0 without reporting"):
        run_ranks(_killed_in_update, 2, seed, str(tmp_path), timeout=120)
    survivor = json.loads((tmp_path / "survivor").read_text())
    assert survivor["error"].startswith("UpdateError") and "[1]" in survivor["error"], survivor
    assert survivor["took"] < 3.0 + 5.0, survivor
    assert not glob.glob(f"/dev/shm/tceu{seed}_*"), glob.glob(f"/dev/shm/tceu{seed}_*")
