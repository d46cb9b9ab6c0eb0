"""Weights that change, on one GPU (loopback slots): the C++ gather's version net, the
update protocol's stream-ordered fences (no host synchronization), and updates seen by
CUDA-graph replays. The cross-rank parts (exchanges, delayed ranks, partial updates) are
test/test_weight_updates_host.py's on gloo ranks; here the peers' arrival exchange is the
one rank's own (a loopback slot's peer lives in this process)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from cuda_helpers import needs_gpu_and_kernels, register_loopback

pytestmark = needs_gpu_and_kernels


@pytest.fixture()
def group():
    import os

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    import torch_ce

    torch.cuda.synchronize()
    torch_ce.release_all()
    dist.destroy_process_group()


class _OneRankRound:
    """The update's exchanges with the loopback peer (this process): nothing to wait for."""

    def __init__(self, ranks, rank, *a, **k):
        self.rank = rank

    def exchange(self, phase, payload):
        return {self.rank: payload}

    def abort(self, message):
        pass


@contextlib.contextmanager
def _loopback_rounds():
    from torch_ce.runtime import updates

    real, updates.Round = updates.Round, _OneRankRound
    try:
        yield
    finally:
        updates.Round = real


def _param(group, rows=256, cols=512, seed=0):
    """A DTensor parameter on a 1-rank mesh whose local shard is bound as a loopback slot
    (peer: a second local tensor), watched like a compiled bind watches it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from torch_ce.runtime import versions

    g = torch.Generator(device="cuda").manual_seed(seed)
    mesh = DeviceMesh("cuda", [0])
    local = torch.randn(rows, cols, device="cuda", generator=g)
    peer = torch.randn(rows, cols, device="cuda", generator=g)
    p = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False), requires_grad=False)
    slot = register_loopback(p._local_tensor, peer, group)
    versions.watch_slots([(slot, p._local_tensor, "w", [p])])
    return p, peer, slot


def _gather(p, group):
    out = torch.ops.magi.ce_all_gather(p._local_tensor, 2, group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def test_cpp_gather_checks_local_and_dtensor_versions(group):
    import torch_ce

    p, peer, _ = _param(group)
    assert torch.equal(_gather(p, group), torch.cat([p._local_tensor, peer]))
    with torch.no_grad():
        p.mul_(2)  # the DTensor's counter moves, not the local tensor's
    with pytest.raises(torch_ce.StaleWeightError, match=r"w changed in place outside torch_ce.updating_weights"):
        _gather(p, group)
    q, qpeer, _ = _param(group, seed=1)
    with torch.no_grad():
        q._local_tensor.add_(1)  # the local tensor's counter
    with pytest.raises(torch_ce.StaleWeightError):
        _gather(q, group)


def test_protocol_is_stream_ordered_and_exact(group):
    import torch_ce

    p, peer, _ = _param(group)
    new = torch.randn_like(p._local_tensor)
    _gather(p, group)
    with _loopback_rounds(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch_ce.updating_weights([p]):
            with torch.no_grad():
                p._local_tensor.copy_(new)
    syncs = [e.name for e in prof.events() if "Synchronize" in e.name]
    assert not syncs, syncs
    assert torch.equal(_gather(p, group), torch.cat([new, peer]))


def test_update_between_cuda_graph_replays(group):
    import torch_ce

    p, peer, _ = _param(group)
    x = torch.randn(512, 64, device="cuda")
    _ = _gather(p, group) @ x  # the copy streams, events and cuBLAS handle exist before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _gather(p, group) @ x
    gen = torch.Generator(device="cuda").manual_seed(7)
    for k in range(3):
        new = torch.randn(p._local_tensor.shape, device="cuda", generator=gen)
        with _loopback_rounds(), torch_ce.updating_weights([p]):
            with torch.no_grad():
                p._local_tensor.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, torch.cat([new, peer]) @ x, rtol=0, atol=0)


def test_protocol_captured_and_replayed(group):
    """The protocol inside a capture: its fences and writes are captured (nothing to host
    sync), and each replay writes the source's current values before the gather reads."""
    import torch_ce

    p, peer, _ = _param(group)
    src = torch.randn_like(p._local_tensor)
    _gather(p, group)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with _loopback_rounds(), torch.cuda.graph(graph):
        with torch_ce.updating_weights([p]):
            with torch.no_grad():
                p._local_tensor.copy_(src)
        out = _gather(p, group)
    gen = torch.Generator(device="cuda").manual_seed(8)
    for k in range(3):
        src.copy_(torch.randn(src.shape, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.cat([src, peer])), k


def test_gather_inside_the_block_raises(group):
    """A gather inside the block raises (the watches are poisoned), then reads exactly."""
    import torch_ce

    p, peer, _ = _param(group)
    with _loopback_rounds(), torch_ce.updating_weights([p]):
        with pytest.raises(torch_ce.StaleWeightError, match="updating_weights is open"):
            _gather(p, group)
    assert torch.equal(_gather(p, group), torch.cat([p._local_tensor, peer]))


def test_cpp_gather_sees_state_dict_writes(group):
    """``module.state_dict()[k].to_local().copy_(x)``: the entry's local tensor has a fresh
    counter (NOTE [what the net sees]); the module's state-dict hook watches it, and the
    C++ gather hands the stale bucket to Python, which raises; the protocol recovers."""
    import torch_ce
    from torch_ce.runtime import versions

    p, peer, slot = _param(group)
    holder = torch.nn.Module()
    holder.register_parameter("w", p)
    versions.watch_slots([(slot, p._local_tensor, "w", [p])])  # now a module holds it: followed
    assert torch.equal(_gather(p, group), torch.cat([p._local_tensor, peer]))
    new = torch.randn_like(p._local_tensor)
    with torch.no_grad():
        holder.state_dict()["w"].to_local().copy_(new)  # the state dict dies at once
    with pytest.raises(torch_ce.StaleWeightError, match=r"w changed in place outside"):
        _gather(p, group)
    with _loopback_rounds(), torch_ce.updating_weights([p]):
        pass
    assert torch.equal(_gather(p, group), torch.cat([new, peer]))


def test_data_assignment_goes_back_into_its_slot(group):
    """``p._local_tensor.data = new`` inside the protocol: at the exit the values are copied
    into the slot and the shard views it again (NOTE [a weight re-pointed inside the
    protocol]), so the C++ gather finds it and reads the new values."""
    import torch_ce

    p, peer, slot = _param(group)
    # A real window's own view is a tensor of its own (cuda.slot_local_view); a loopback
    # slot's is the weight itself, which ``.data =`` moves: give it an alias that stays.
    slot.peer_views = [p._local_tensor.detach(), peer]
    addr = p._local_tensor.data_ptr()
    for k in range(3):
        new = torch.randn_like(p._local_tensor)
        with _loopback_rounds(), torch_ce.updating_weights([p]):
            p._local_tensor.data = new.clone()
        assert p._local_tensor.data_ptr() == addr
        assert torch.equal(_gather(p, group), torch.cat([new, peer]))
