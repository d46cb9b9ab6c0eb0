"""The copy-engine reduce-scatter under the faults users produce (issue 46), on the host
transport (CPU, 2 gloo ranks): NOTE [reduce-scatter workspaces] in
torch_ce/runtime/reduce_scatter/workspace.py says what holds.

- ``test_a_skipped_bucket_is_an_error_on_every_rank``: after a shared first call, rank 0
  runs buckets A then B, rank 1 (a second late) only B: both ranks raise at that call,
  each naming both calls (seq and element counts); no rank returns a sum. Then a fresh
  call, and one after ``release_all()``, are exact on both.
- ``test_first_call_sizes_differ``: a first call of 3000 elements on one rank and 4000 on
  the other (the same rounded workspace): both raise, naming both sizes; then exact.
- ``test_timeout_then_recovery``: one rank later than ``rs_timeout_s``: the waiting rank
  raises, and so does the late one (its peer retracted its push); fresh calls (a rank late
  again, below the timeout: the slow path reads the store) are exact on both; a rank whose
  call succeeded while its peer gave up learns at its next call; ``release_all()`` too.
- ``test_a_host_that_is_not_x86_keeps_the_collective``: the host transport needs x86's
  store order; on an aarch64 host its reduce-scatters stay on gloo, exact, with the reason.
- ``test_a_killed_rank_leaves_no_segment``: a rank that exits right after creating its
  segment, in a reduce-scatter workspace round and in a bind's window opening: the survivor
  raises within the timeout and /dev/shm holds nothing of the job.

Every result is checked against gloo's ``reduce_scatter_tensor`` of the same fresh random
inputs (world 2, fp32: bit-identical).
"""
from __future__ import annotations

import glob
import json
import os
import time

import pytest
import torch

from mp_harness import run_ranks, seed_base


def _gloo(x):
    import torch.distributed as dist

    out = torch.empty((x.shape[0] // 2, *x.shape[1:]), dtype=torch.float32)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=dist.group.WORLD)
    return out


def _exact(gen, rows=24, late=None, rank=0, delay=0.0):
    """One CE reduce-scatter of fresh random data, ``late`` rank ``delay`` s late: its
    output, checked against gloo's here (on every rank)."""
    import torch.distributed as dist

    import torch_ce

    x = torch.randn(2 * rows, 9, generator=gen)
    if rank == late:
        time.sleep(delay)
    out = torch_ce.reduce_scatter(x, dist.group.WORLD)
    ref = _gloo(x)
    assert torch.equal(out, ref), float((out - ref).abs().max())
    return float(out.sum())


def _skipped(rank, world, seed):
    import torch.distributed as dist

    import torch_ce
    from torch_ce.runtime.reduce_scatter import ReduceScatterError

    torch_ce.config.update(rs_timeout_s=20.0)
    gen = torch.Generator().manual_seed(seed + rank)
    name = dist.group.WORLD.group_name
    _exact(gen, rows=300)  # call 1 on both: opens a workspace large enough for A and B
    a = torch.randn(2 * 20, 25, generator=gen)  # 500 elements per rank
    b = torch.randn(2 * 16, 10, generator=gen)  # 160
    errors = []
    if rank == 1:
        time.sleep(1.0)
    for x, bucket in ((a, "bucket A"), (b, "bucket B")) if rank == 0 else ((b, "bucket B"),):
        try:
            out = torch.ops.magi.ce_reduce_scatter(x, "sum", world, name, bucket)
        except ReduceScatterError as e:
            errors.append(str(e))
            break
        raise AssertionError(f"rank {rank}: {bucket} returned {out.sum()} instead of raising")
    assert len(errors) == 1, errors
    msg = errors[0]
    assert "call 2" in msg and "500" in msg and "160" in msg, msg
    assert ("bucket A" if rank == 0 else "bucket B") in msg, msg
    got = [_exact(gen, late=1, rank=rank, delay=0.5)]  # a fresh call: a new generation
    got.append(_exact(gen, rows=7))
    torch_ce.release_all()
    got.append(_exact(gen, late=0, rank=rank, delay=0.5))
    return msg, got


def test_a_skipped_bucket_is_an_error_on_every_rank():
    (m0, g0), (m1, g1) = run_ranks(_skipped, 2, seed_base(), timeout=120)
    assert "rank 1 pushed its call 2" in m0 and "rank 0 pushed its call 2" in m1, (m0, m1)
    assert g0 and g1


def _first_sizes(rank, world, seed):
    import torch.distributed as dist

    import torch_ce
    from torch_ce.runtime.reduce_scatter import ReduceScatterError

    torch_ce.config.update(rs_timeout_s=20.0)
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(3000 if rank == 0 else 4000, generator=gen)  # 1500 / 2000 per rank: cap 2048 both
    if rank == 0:
        time.sleep(1.0)
    with pytest.raises(ReduceScatterError) as e:
        torch.ops.magi.ce_reduce_scatter(x, "sum", world, dist.group.WORLD.group_name, f"bucket of rank {rank}")
    msg = str(e.value)
    assert "1500 elements" in msg and "2000 elements" in msg, msg
    return msg, [_exact(gen, rows=1000 + 37), _exact(gen, late=1, rank=rank, delay=0.4)]


def test_first_call_sizes_differ():
    for msg, got in run_ranks(_first_sizes, 2, seed_base(), timeout=120):
        assert "bucket of rank 0" in msg and "bucket of rank 1" in msg, msg
        assert len(got) == 2


def _timeout(rank, world, seed):
    import torch.distributed as dist

    import torch_ce
    from torch_ce.runtime.reduce_scatter import ReduceScatterError, flags as RF, workspace as RW

    torch_ce.config.update(rs_timeout_s=1.5)
    gen = torch.Generator().manual_seed(seed + rank)
    got = [_exact(gen, late=0, rank=rank, delay=0.5), _exact(gen)]
    x = torch.randn(2 * 24, 9, generator=gen)
    if rank == 1:
        time.sleep(3.5)  # past its peer's rs_timeout_s
    t0 = time.monotonic()
    with pytest.raises(ReduceScatterError) as e:
        torch_ce.reduce_scatter(x, dist.group.WORLD)
    took = time.monotonic() - t0
    msg = str(e.value)
    if rank == 0:
        assert "rank 1" in msg and "rs_timeout_s" in msg and 1.5 <= took < 5.0, (msg, took)
    else:
        assert "gave up" in msg and took < 1.0, (msg, took)  # its peer retracted the push
    assert not RW.pools(), RW.pools()  # the failed generation is gone
    for k in range(4):  # fresh calls: a new generation; a late rank makes the slow path read the store
        got.append(_exact(gen, late=k % 2, rank=rank, delay=0.4))
    # A rank that succeeded a call its peer gave up on (the race the retract narrows)
    # learns at its next call: emulated by rank 1 failing its finished call by hand.
    got.append(_exact(gen))
    if rank == 1:
        ws = next(iter(RW.pools().values()))
        RF.fail(ws, (ws.calls - 1) % 2, "rank 1 gave up after the fact (test)")
        got.append(_exact(gen))  # a new generation; its peer joins once it has learnt
    else:
        t0 = time.monotonic()
        with pytest.raises(ReduceScatterError, match="gave up after the fact"):
            torch_ce.reduce_scatter(torch.randn(2 * 24, 9, generator=gen), dist.group.WORLD)
        assert time.monotonic() - t0 < 1.0
        got.append(_exact(gen))
    torch_ce.release_all()
    got.append(_exact(gen, late=1, rank=rank, delay=0.4))
    return msg, got


def test_timeout_then_recovery():
    (m0, g0), (m1, g1) = run_ranks(_timeout, 2, seed_base(), timeout=120)
    assert len(g0) == len(g1) == 9


def _killed(rank, world, seed, where, out_dir):
    """Rank 1 exits right after creating its segment; rank 0 reports what it saw in a
    file (the harness fails the run: a rank died) and exits too."""
    import torch.distributed as dist

    import torch_ce
    from torch_ce.runtime import agreement, host

    torch_ce.config.update(rs_timeout_s=2.0, bind_timeout_s=2.0, shm_prefix=f"tcek{seed}_")
    real = host._map

    def dying_map(path, nbytes, create):
        mm = real(path, nbytes, create)
        if create and rank == 1:
            with open(os.path.join(out_dir, "created"), "w") as f:
                f.write(path)
            os._exit(0)
        return mm

    host._map = dying_map
    t0 = time.monotonic()
    try:
        if where == "workspace":
            torch_ce.reduce_scatter(torch.randn(2 * 64), dist.group.WORLD)
        elif where == "host_flags":  # a CUDA workspace's host-mapped flag segments (unregistered here)
            from torch_ce.runtime.reduce_scatter import host_flags as HF

            rnd = agreement.Round((0, 1), rank, 2.0, 2.0, what="flags_test")
            HF.open_group(rnd, [f"/dev/shm/tcek{seed}_flags_{j}" for j in range(2)], rank, register=False)
        else:
            from torch_ce.runtime.windows import Window

            w = Window(("cpu", "float32"), 0, 4096, dist.group.WORLD, (0, 1), rank, torch.device("cpu"),
                       torch.empty(0, dtype=torch.uint8))
            rnd = agreement.Round((0, 1), rank, 2.0, 2.0, what="windows_test")
            host.open_windows([w], rnd, "", f"tcek{seed}_win")
        err = "no error"
    except Exception as e:  # noqa: BLE001 (reported to the test)
        err = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, "survivor"), "w") as f:
        json.dump({"error": err, "took": time.monotonic() - t0}, f)
    os._exit(0)


@pytest.mark.parametrize("where", ["workspace", "windows", "host_flags"])
def test_a_killed_rank_leaves_no_segment(where, tmp_path):
    seed = seed_base()
    with pytest.raises(pytest.fail.Exception, match="exited with code 0 without reporting"):
        run_ranks(_killed, 2, seed, where, str(tmp_path), timeout=60)
    created = (tmp_path / "created").read_text()
    survivor = json.loads((tmp_path / "survivor").read_text())
    assert created.startswith(f"/dev/shm/tcek{seed}_"), created
    want = {"workspace": "ReduceScatterError", "windows": "BindError", "host_flags": "BindError"}[where]
    assert survivor["error"].startswith(want) and survivor["took"] < 2.0 + 3.0, survivor
    assert not os.path.exists(created)
    assert not glob.glob(f"/dev/shm/tcek{seed}_*"), glob.glob(f"/dev/shm/tcek{seed}_*")


def _not_x86(rank, world, seed):
    import platform

    import torch.distributed as dist

    import torch_ce

    platform.machine = lambda: "aarch64"  # what a Grace host says
    gen = torch.Generator().manual_seed(seed + rank)
    got = [_exact(gen), _exact(gen, late=1, rank=rank, delay=0.3)]
    served = torch_ce.explain().reduce_scatter_coverage()["served"]
    (s,) = served.values()
    assert s["ce_bytes"] == 0 and s["collective_bytes"] and "x86" in s["reason"], served
    assert dist.get_world_size() == 2
    return got


def test_a_host_that_is_not_x86_keeps_the_collective():
    """The host transport relies on x86's store order (NOTE [reduce-scatter workspaces]):
    elsewhere its reduce-scatters stay on the collective, exact, with the reason."""
    a, b = run_ranks(_not_x86, 2, seed_base(), timeout=120)
    assert len(a) == len(b) == 2


def test_one_hardware_queue_keeps_the_collective(monkeypatch):
    """Under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` only a host store releases a dead peer's
    stream wait (run 60), so CUDA reduce-scatters use host-mapped flags there, which need
    the native completion's reduction kernel (it reads the poison word): without it, or
    with ``rs_host_flags=False``, they stay on the collective, with the reason; any other
    setting keeps the copy engines on device flags."""
    import torch_ce
    from torch_ce.rs_reasons import RsReason
    from torch_ce.runtime.reduce_scatter import host_flags as HF, op as O

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(HF, "unavailable", lambda: "the library was built without nvcc")
    why = O.one_queue_refusal()
    assert not HF.wanted() and why.code == RsReason.ONE_QUEUE
    why = str(why)
    assert why and "CUDA_DEVICE_MAX_CONNECTIONS=1" in why and "hang" in why and "without nvcc" in why, why
    monkeypatch.setattr(HF, "unavailable", lambda: None)  # a build with the kernel
    assert HF.wanted() and O.one_queue_refusal() is None
    with torch_ce.config.patch(rs_host_flags=False):
        why = str(O.one_queue_refusal())
        assert not HF.wanted() and why and "rs_host_flags is False" in why, why
    for v in ("8", "32"):
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", v)
        assert O.one_queue_refusal() is None and not HF.wanted()
        with torch_ce.config.patch(rs_host_flags=True):
            assert HF.wanted()  # forced (the GPU tests run them under the default queues too)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert O.one_queue_refusal() is None


def _flag_segments(rank, world, seed):
    """Every rank opens the group's host-mapped flag segments (one Round), writes a fresh
    word into each peer's segment, and reads what each peer wrote into its own."""
    from torch_ce.runtime import agreement
    from torch_ce.runtime.reduce_scatter import host_flags as HF

    ranks = tuple(range(world))
    if rank == world - 1:
        time.sleep(2.0)  # a late rank: its peers wait for it in the round, nothing is lost
    rnd = agreement.Round(ranks, rank, 10.0, 10.0, what="flags_test")
    paths = [f"/dev/shm/tcef{seed}_flags_{j}" for j in range(world)]
    segs = HF.open_group(rnd, paths, rank, register=False)
    start = (segs[rank].flags.clone().tolist(), segs[rank].head.tolist(), segs[rank].poison.tolist())
    rnd.exchange("read", True)
    left = [p for p in paths if os.path.exists(p)]  # every owner unlinked its own by now
    for j in ranks:
        if j != rank:
            segs[j].head[1, rank, 0] = seed % 1000 + 10 * rank + j  # what rank j reads from this rank
    rnd.exchange("written", True)
    got = {j: int(segs[rank].head[1, j, 0]) for j in ranks if j != rank}
    return start, got, left


@pytest.mark.parametrize("world", [2, 3])
def test_host_flag_segments_are_shared_and_leave_no_name(world):
    """The host-mapped flag segments of a CUDA workspace (runtime/reduce_scatter/host_flags.py), opened
    by gloo ranks as ``_open_cuda`` opens them (without the CUDA registration), the last
    rank 2 s late: every rank starts with its free flags set and the rest zero, sees what
    each peer stored into its segment, and no name is left in /dev/shm after the round."""
    seed = seed_base()
    res = run_ranks(_flag_segments, world, seed, timeout=60)
    for rank, (start, got, left) in enumerate(res):
        flags, head, poison = start
        assert flags == [[[0] * world] * 2, [[1] * world] * 2] and poison == [0, 0], start
        assert not any(v for half in head for pair in half for v in pair), head
        assert got == {j: seed % 1000 + 10 * j + rank for j in range(world) if j != rank}, (rank, got)
        assert left == [], left
    assert not glob.glob(f"/dev/shm/tcef{seed}_*")
