"""A bind that fails on one rank raises on every rank, in bounded time, and leaves every
rank's parameters on valid storage with their values (NOTE [bind is exception-safe] in
runtime/binding.py). No rank hangs: each spawned run has a timeout, and the ranks check
their own time to raise against ``bind_timeout_s``.

Cases (one spawned run each, gloo, host transport):
* raise: one rank raises in the middle of moving its shards (after its peers may have
  moved all of theirs); 2 and 3 ranks, a different failing rank each.
* hang: one rank stalls inside the bind past ``bind_timeout_s``; its peers raise at the
  deadline naming it, and the stalled rank raises when it wakes (it sees their abort).
* compiled: the failure happens inside the bind step of a compiled graph's first run; the
  forward raises on every rank, and a later run (failure gone) binds and matches eager.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from mp_harness import reference_all_gather, run_ranks, setup_compile

TIMEOUT_S = 3.0


def _weights(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(16, 64, generator=gen), torch.randn(8, 8, generator=gen).to(torch.bfloat16),
            torch.randn(32, 16, generator=gen)]


def _check_rolled_back(ws, originals) -> None:
    from torch_ce.runtime import window_pools as WP
    from torch_ce.runtime import windows as W

    for w, o in zip(ws, originals, strict=True):
        assert W.lookup(w) is None, "a shard stayed registered after a failed bind"
        assert torch.equal(w, o), "a shard's values changed in a failed bind"
        w.add_(0)  # its storage is writable and alive
    assert WP.open_count() == 0


def _failing_bind(ws, move) -> tuple[str, float]:
    """Bind ``ws`` with ``binding._move_into_slots`` replaced by ``move``; every rank must
    raise BindError and roll back. Returns the message and the seconds the bind took."""
    import torch.distributed.tensor  # noqa: F401  (~2 s on first import: not the bind's time)
    import torch_ce
    from torch_ce.runtime import agreement, binding

    originals = [w.clone() for w in ws]
    real = binding._move_into_slots
    binding._move_into_slots = move
    dist.barrier()  # start together: what is timed is the bind, not the ranks' imports
    t0 = time.monotonic()
    try:
        with pytest.raises(agreement.BindError) as err:
            torch_ce.bind(ws, group=dist.group.WORLD)
    finally:
        binding._move_into_slots = real
    elapsed = time.monotonic() - t0
    _check_rolled_back(ws, originals)
    return str(err.value), elapsed


def _rank_raise(rank: int, world: int, failing: int) -> dict:
    import torch_ce
    from torch_ce.runtime import binding

    torch_ce.config.update(bind_timeout_s=TIMEOUT_S, cost_mode="default")
    ws = _weights(rank)
    real = binding._move_into_slots

    def move_then_fail(slots, moved):
        if rank == failing:
            real(slots[:1], moved)  # one shard moved, then the failure
            raise RuntimeError("injected failure while moving shards")
        real(slots, moved)

    msg, elapsed = _failing_bind(ws, move_then_fail)
    # The job goes on: the same weights bind and gather exactly.
    res = torch_ce.bind(ws, group=dist.group.WORLD)
    assert len(res.bound) == len(ws)
    for w in ws:
        assert torch.equal(torch_ce.all_gather(w), reference_all_gather(w))
    return dict(msg=msg, elapsed=elapsed)


@pytest.mark.parametrize("world,failing", [(2, 1), (3, 0)])
def test_one_rank_raises_every_rank_raises(world, failing):
    out = run_ranks(_rank_raise, world, failing, timeout=120)
    for r, o in enumerate(out):
        assert f"rank {failing}" in o["msg"], (r, o["msg"])
        assert "injected failure" in o["msg"], (r, o["msg"])
        assert o["elapsed"] < TIMEOUT_S, f"rank {r} waited for the timeout: {o}"


def _rank_hang(rank: int, world: int) -> dict:
    import torch_ce
    from torch_ce.runtime import binding

    torch_ce.config.update(bind_timeout_s=TIMEOUT_S, cost_mode="default")
    real = binding._move_into_slots

    def stall(slots, moved):
        if rank == 1:
            time.sleep(TIMEOUT_S * 2.5)  # not in any collective: just late
        real(slots, moved)

    msg, elapsed = _failing_bind(_weights(rank), stall)
    return dict(msg=msg, elapsed=elapsed)


def test_a_stalled_rank_is_named_at_the_deadline():
    out = run_ranks(_rank_hang, 2, timeout=120)
    assert "rank(s) [1]" in out[0]["msg"] and "bind_timeout_s" in out[0]["msg"], out[0]
    assert TIMEOUT_S * 0.9 <= out[0]["elapsed"] < TIMEOUT_S * 2, out[0]
    assert "bind failed on rank 0" in out[1]["msg"] and "timed out" in out[1]["msg"], out[1]


class _Tiny(torch.nn.Module):
    def __init__(self, mesh):
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Parameter(distribute_tensor(torch.randn(32, 32), mesh, [Shard(0)]), requires_grad=False)
        self.b = torch.nn.Parameter(distribute_tensor(torch.randn(32, 32), mesh, [Shard(0)]), requires_grad=False)

    def forward(self, x):
        from torch.distributed.tensor import Replicate

        full = [p.redistribute(placements=[Replicate()]).to_local() for p in (self.a, self.b)]
        return torch.relu(x @ full[0].t()) @ full[1].t()


def _rank_compiled(rank: int, world: int, cache_root: str) -> dict:
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh
    from torch_ce.runtime import agreement, binding
    from torch_ce.runtime import windows as W

    setup_compile(cache_root, rank)
    torch_ce.enable(transport="copy_engine", bind_timeout_s=TIMEOUT_S, cost_mode="default")
    mesh = init_device_mesh("cpu", (world,))
    model = _Tiny(mesh)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(x)
        originals = [p._local_tensor.clone() for p in (model.a, model.b)]
        real = binding._move_into_slots

        def fail(slots, moved):
            if rank == 0:
                raise RuntimeError("injected failure in the compiled bind step")
            real(slots, moved)

        binding._move_into_slots = fail
        compiled = torch.compile(model, fullgraph=True)
        with pytest.raises(Exception) as err:
            compiled(x)
        binding._move_into_slots = real
        for p, o in zip((model.a, model.b), originals, strict=True):
            assert W.lookup(p._local_tensor) is None and torch.equal(p._local_tensor, o)
        got = compiled(x)  # the bind step runs again, now without the failure
        bound = [isinstance(W.lookup(p._local_tensor), W.Slot) for p in (model.a, model.b)]
    torch_ce.disable()
    assert isinstance(err.value, agreement.BindError) or "bind failed on rank 0" in str(err.value)
    return dict(msg=str(err.value), exact=torch.equal(got, want), bound=bound)


def test_failure_in_a_compiled_bind_step(tmp_path):
    out = run_ranks(_rank_compiled, 2, str(tmp_path), timeout=240)
    for o in out:
        assert "rank 0" in o["msg"] and "injected failure" in o["msg"], o["msg"]
        assert o["exact"] and all(o["bound"]), o
