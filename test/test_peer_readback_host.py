"""The peer read-back at bind (NOTE [peer read-back at bind] in torch_ce/runtime/readback.py)
on CPU ranks (gloo, host transport): the check runs through the host transport's own
memcpy from the peers' mappings, so a mapping broken on one rank is a real one.

One run of 2 ranks, fresh random shards, rank 1 late before each bind:

- a healthy bind reads every new window back (one probe per window, through the gathers'
  copy path) and gathers exactly as gloo's all_gather;
- rank 1's mappings of its peer's windows replaced by private zeroed memory (a mapping that
  "copies nothing" of the peer), under a compiled SimpleFSDP-style model: its bind step
  falls back for that pool on every rank, with the same reason, shown by ``explain()``; no
  window of the pool is kept; the compiled forward (gathers on the collective) equals the
  eager one on every rank;
- a read that raises on rank 0 (a copy error): the same fallback on both ranks;
- ``bind_readback=False`` with the same broken mapping binds, and rank 1's gather silently
  returns zeros for its peer's rows: what the check exists to prevent;
- ``bind_readback`` off on rank 0 only: off for that bind on both ranks (no rank waits in
  an exchange its peer skips), bound and exact.
"""
from __future__ import annotations

import time

import torch

from mp_harness import reference_all_gather, run_ranks, seed_base

LATE_S = 1.5
ENV = {"TORCH_CE_COST_MODE": "default"}


def _shards(seed: int, rank: int, dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + rank)
    return [torch.randn(16, 32, generator=gen).to(dtype), torch.randn(8, 64, generator=gen).to(dtype)]


def _late(rank: int) -> None:
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        time.sleep(LATE_S)


def _break_peer_mappings(rank: int, victim: int):
    """Wrap the host transport's ``open_windows``: on ``victim``, every mapping of a peer's
    window is replaced by private zeroed memory of its size (reads "succeed" and see none
    of the peer's bytes). Returns the restore function."""
    from torch_ce.runtime import host

    real = host.open_windows

    def broken(windows, rnd, tag, job):
        real(windows, rnd, tag, job)
        if rank == victim:
            for w in windows:
                w.peer_locals = [t if r == w.rank else torch.zeros(w.nbytes, dtype=torch.uint8)
                                 for r, t in enumerate(w.peer_locals)]

    host.open_windows = broken
    return lambda: setattr(host, "open_windows", real)


def _gathers(ws) -> list[bool]:
    import torch_ce

    return [bool(torch.equal(torch_ce.all_gather(w), reference_all_gather(w))) for w in ws]


def _fallbacks(ws) -> list:
    from torch_ce.runtime import windows as W

    out = []
    for w in ws:
        e = W.lookup(w)
        out.append((type(e).__name__, getattr(e, "code", None)))
    return out


def _pool_windows(dtype) -> int:
    from torch_ce.runtime import window_pools as WP

    return sum(len(p.windows) for k, p in WP.pools().items() if k[1] == str(dtype).replace("torch.", ""))


class _Tiny(torch.nn.Module):
    """Two Shard(0) fp32 weights, gathered by DTensor's redistribute (a compiled graph's
    weight gathers)."""

    def __init__(self, mesh, seed: int):
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        gen = torch.Generator().manual_seed(seed)  # the same full weights on every rank
        self.a = torch.nn.Parameter(distribute_tensor(torch.randn(32, 32, generator=gen), mesh, [Shard(0)]),
                                    requires_grad=False)
        self.b = torch.nn.Parameter(distribute_tensor(torch.randn(32, 32, generator=gen), mesh, [Shard(0)]),
                                    requires_grad=False)

    def forward(self, x):
        from torch.distributed.tensor import Replicate

        full = [p.redistribute(placements=[Replicate()]).to_local() for p in (self.a, self.b)]
        return torch.relu(x @ full[0].t()) @ full[1].t()


def _rank(rank: int, world: int, seed: int, root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch_ce
    from mp_harness import setup_compile
    from torch_ce.runtime import gather, readback
    from torch_ce.runtime.eligibility import Reason

    setup_compile(root, rank)
    torch_ce.enable(transport="copy_engine", cost_mode="default", bind_timeout_s=20.0)
    out: dict = {"code": int(Reason.PEER_READBACK)}
    g = dist.group.WORLD

    # Counts of the read-back's probes and of the host copies they ran through.
    reads, copies = [0], [0]
    real_read, real_copy = readback.read_words, gather.copy_peers

    def counted_read(w):
        reads[0] += 1
        return real_read(w)

    def counted_copy(outs, slots):
        copies[0] += 1
        return real_copy(outs, slots)

    readback.read_words, gather.copy_peers = counted_read, counted_copy
    try:
        # 1. healthy: read back, bound, exact
        ws = _shards(seed, rank, torch.float64)
        _late(rank)
        res = torch_ce.bind(ws, group=g)
        exact = _gathers(ws)
        out["healthy"] = dict(bound=len(res.bound), opened=res.windows_opened, reads=reads[0],
                              copies=copies[0], exact=exact)
        # a second bind into the same pool opens nothing, so reads nothing back
        more = _shards(seed + 50, rank, torch.float64)[:1]
        res = torch_ce.bind(more, group=g)
        out["pooled"] = dict(bound=len(res.bound), opened=res.windows_opened, reads=reads[0],
                             exact=_gathers(more))
    finally:
        readback.read_words, gather.copy_peers = real_read, real_copy

    # 2. rank 1 maps zeroed private memory in place of its peer's windows; a compiled
    # model's bind step opens them
    mesh = init_device_mesh("cpu", (world,))
    model = _Tiny(mesh, seed + 100)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed + 101 + rank))
    compiled = torch.compile(model, fullgraph=True)
    from torch_ce import report

    n_binds = len(report.binds)
    restore = _break_peer_mappings(rank, victim=1)
    try:
        with torch.no_grad():
            want = model(x)
            _late(rank)
            got = [compiled(x) for _ in range(2)]
    finally:
        restore()
    text = torch_ce.explain().table()
    ws = [model.a._local_tensor, model.b._local_tensor]
    skipped = {k: v for b in report.binds[n_binds:] for k, v in b.skipped.items()}
    out["broken"] = dict(bound=sum(len(b.bound) for b in report.binds[n_binds:]), skipped=skipped,
                         entries=_fallbacks(ws), windows=_pool_windows(torch.float32),
                         exact=[bool(torch.equal(g_, want)) for g_ in got] + _gathers(ws),
                         explained=[line for line in text.splitlines() if "read-back" in line])

    # 3. the read itself raises on rank 0
    def raising(w):
        raise RuntimeError("injected copy error")

    if rank == 0:
        readback.read_words = raising
    try:
        ws = _shards(seed + 200, rank, torch.float16)
        _late(rank)
        res = torch_ce.bind(ws, group=g)
    finally:
        readback.read_words = real_read
    out["raised"] = dict(bound=len(res.bound), skipped=dict(res.skipped), entries=_fallbacks(ws),
                         windows=_pool_windows(torch.float16), exact=_gathers(ws))

    # 4. the check off: the broken mapping binds, and rank 1 reads zeros of its peer
    torch_ce.config.update(bind_readback=False)
    restore = _break_peer_mappings(rank, victim=1)
    try:
        ws = _shards(seed + 300, rank, torch.bfloat16)
        _late(rank)
        res = torch_ce.bind(ws, group=g)
    finally:
        restore()
        torch_ce.config.update(bind_readback=True)
    peer = 1 - rank
    rows = [torch_ce.all_gather(w).view(world, *w.shape)[peer] for w in ws]
    out["unchecked"] = dict(bound=len(res.bound), exact=_gathers(ws),
                            peer_rows_zero=[bool((r == 0).all()) for r in rows])

    # 5. off on rank 0 only: off for the bind on both ranks (no rank waits in an exchange
    # its peer skips)
    torch_ce.config.update(bind_readback=rank != 0)
    readback.read_words = counted_read
    try:
        ws = [(w * 100).to(torch.int32) for w in _shards(seed + 400, rank, torch.float32)]
        _late(rank)
        res = torch_ce.bind(ws, group=g)
    finally:
        readback.read_words = real_read
        torch_ce.config.update(bind_readback=True)
    out["split_config"] = dict(bound=len(res.bound), opened=res.windows_opened,
                               reads=reads[0] - out["pooled"]["reads"], exact=_gathers(ws))
    torch_ce.disable()
    return out


def test_peer_readback_decides_on_every_rank(tmp_path):
    res = run_ranks(_rank, 2, seed_base(), str(tmp_path.resolve()), timeout=400, env=ENV)
    for rank, r in enumerate(res):
        h = r["healthy"]
        assert h["bound"] == 2 and h["opened"] >= 1 and all(h["exact"]), (rank, h)
        # one probe per new window, each one host copy_peers call (the gathers' own path)
        assert h["reads"] == h["opened"] and h["copies"] >= h["reads"] + 2, (rank, h)
        p = r["pooled"]
        assert p["bound"] == 1 and p["opened"] == 0 and p["reads"] == h["reads"] and all(p["exact"]), (rank, p)

        b = r["broken"]
        assert b["bound"] == 0 and len(b["skipped"]) == 2, (rank, b)
        for why in b["skipped"].values():
            assert "peer read-back at bind failed" in why and "rank 1 read" in why, why
            assert "from rank 0's window" in why, why
        assert b["entries"] == [("Fallback", r["code"])] * 2, (rank, b)
        assert b["windows"] == 0, (rank, b)  # the pool's new windows were dropped
        assert all(b["exact"]), (rank, b)  # on the collective, exact everywhere
        assert b["explained"] and all("peer read-back" in line for line in b["explained"]), (rank, b)

        x = r["raised"]
        assert x["bound"] == 0 and x["entries"] == [("Fallback", r["code"])] * 2, (rank, x)
        assert all("rank 0 could not read window" in w and "injected copy error" in w
                   for w in x["skipped"].values()), (rank, x)
        assert x["windows"] == 0 and all(x["exact"]), (rank, x)

        u = r["unchecked"]
        assert u["bound"] == 2, (rank, u)
        s = r["split_config"]
        assert s["bound"] == 2 and s["opened"] >= 1 and s["reads"] == 0 and all(s["exact"]), (rank, s)
    # The same reason on every rank: the agreement pairs up.
    assert res[0]["broken"]["skipped"] == res[1]["broken"]["skipped"]
    assert res[0]["raised"]["skipped"] == res[1]["raised"]["skipped"]
    # Unchecked, the broken mapping is a silent wrong gather on rank 1 only.
    assert all(res[0]["unchecked"]["exact"]) and not any(res[0]["unchecked"]["peer_rows_zero"])
    assert not any(res[1]["unchecked"]["exact"]) and all(res[1]["unchecked"]["peer_rows_zero"])
