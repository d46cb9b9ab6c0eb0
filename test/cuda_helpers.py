"""Test scaffolding for the GPU tests (not part of the library).

    GPU_WORLD, needs_gpu_world   ranks of the multi-GPU tests: TORCH_CE_GPU_WORLD (default 2);
                                 the tests skip with fewer visible GPUs
    needs_gpu_and_kernels        pytestmark of a module that needs a GPU and the C++ kernels
    register_loopback(mine, peer, group, rank=0) -> Slot

One GPU: binds ``mine`` as a 2-rank slot whose other rank's copy is the local tensor ``peer``:
symmetric memory refuses two ranks on one device, but the gather mechanics (registry, copy
streams, events, batch submission, c10d work, graph capture) do not care where the peer
copy lives. ``rank`` is this rank's position in the pair. The slot goes through
``windows.register`` (which mirrors it into the C++ index); ``release_all`` forgets it.
Used by test/test_native_cuda.py and, by path, bench/issue_cost.py.
"""
from __future__ import annotations


import pytest
import torch

from testenv import GPU_WORLD  # noqa: E402
if GPU_WORLD < 2:
    raise ValueError(f"TORCH_CE_GPU_WORLD={GPU_WORLD}: the multi-GPU tests need at least 2 ranks")
needs_gpu_world = pytest.mark.skipif(
    torch.cuda.device_count() < GPU_WORLD,
    reason=f"needs {GPU_WORLD} GPUs (TORCH_CE_GPU_WORLD={GPU_WORLD})")


def _kernels_built() -> bool:
    import os

    d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ce", "runtime")
    return any(f.startswith("_ce_torch") for f in os.listdir(d))


# A module's ``pytestmark`` when it needs a GPU and the built C++ gather kernels.
needs_gpu_and_kernels = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _kernels_built(), reason="the C++ gather kernels are not built (CPU torch or no nvcc)"),
]


def register_loopback(mine: torch.Tensor, peer: torch.Tensor, group, rank: int = 0):
    from torch_ce.runtime import windows as W

    if peer.shape != mine.shape or peer.dtype != mine.dtype or not (mine.is_contiguous() and peer.is_contiguous()):
        raise ValueError("register_loopback needs two contiguous tensors of one shape and dtype")
    nbytes = mine.numel() * mine.element_size()
    w = W.Window(("loopback", group.group_name), 0, nbytes, group, (rank, 1 - rank), rank,
                 mine.device, mine.view(-1).view(torch.uint8), used=nbytes)
    slot = W.Slot(w, 0, nbytes, tuple(mine.shape), mine.dtype, "loopback")
    pair = [mine, peer] if rank == 0 else [peer, mine]
    slot.peer_ptrs = [t.data_ptr() for t in pair]
    slot.peer_views = list(pair)
    W.register(mine, slot)
    return slot


def loopback_workspaces(world: int, cap: int, dtype: torch.dtype, device="cuda", host_flags: bool | None = None) -> list:
    """``world`` reduce-scatter workspaces on one GPU, each "rank"'s peers the others
    (NOTE [reduce-scatter workspaces] in torch_ce/runtime/reduce_scatter/workspace.py): what
    ``_open_cuda`` builds over symmetric memory, built from plain device tensors, so one
    process plays every rank of a call (launch each, then complete each: the order the
    protocol's waits need, NOTE [copy-engine reduce-scatter]). Each has its own pool key.
    ``host_flags`` (default: ``host_flags.wanted()``, as ``_open_cuda``): the flags,
    headers and poison words in /dev/shm segments registered with CUDA by the runtime's own
    ``host_flags.open_group``. Used by test/test_reduce_scatter_cuda.py and, by path,
    bench/rs_cost.py."""
    import os
    import uuid

    from torch_ce.runtime.reduce_scatter import flags as RF, host_flags as HF, workspace as RW
    from torch_ce.runtime.session import Session

    recvs = [torch.zeros(2, world, cap, dtype=dtype, device=device) for _ in range(world)]
    host = HF.wanted() if host_flags is None else host_flags
    segs, poisons = [], [None] * world
    if host:
        token = uuid.uuid4().hex[:8]
        segs = HF.open_group(None, [os.path.join("/dev/shm", f"torch_ce_test_rsf_{token}_{r}") for r in range(world)], 0)
        flags, heads, poisons = [s.flags for s in segs], [s.head for s in segs], [s.poison for s in segs]
    else:
        flags = [torch.zeros(2, 2, world, dtype=torch.int32, device=device) for _ in range(world)]
        heads = [torch.zeros(2, world, 2, dtype=torch.int32, device=device) for _ in range(world)]
        for f in flags:
            f[RF.FREE].fill_(1)
    torch.cuda.synchronize()
    key = ("loopback", id(recvs))
    # One session for every "rank" (NOTE [sessions: one abort per group generation]): a
    # failure one of them gives up on is seen by all, as every rank of a group sees it.
    session = Session(tuple(range(world)), 0, torch.distributed.HashStore())
    return [RW.Workspace((tuple(range(world)), str(dtype), "cuda", key, r), r, cap, dtype, recvs[r], flags[r],
                         recvs, flags, list(segs), "", head=heads[r], peer_head=heads, poison=poisons[r],
                         session=session)
            for r in range(world)]


def loopback_reduce_scatter(wss: list, inputs: list, reduce_op: str = "sum", name: str = "loopback",
                            via_wait_tensor: bool = False, outs: list | None = None) -> list:
    """One reduce-scatter of every "rank"'s ``inputs[r]`` (a list of tensors) over the
    loopback workspaces: each launches, then each completes; the current stream then waits
    for every completion. Returns each rank's outputs. ``via_wait_tensor``: the outputs
    carry the op's c10d work and each is completed by its ``wait_tensor``, as in a graph.
    ``outs``: each rank's given outputs (FSDP2's hook writes into its own)."""
    from torch_ce.runtime.reduce_scatter import launch as RS

    outs = outs or [None] * len(wss)
    calls = [RS.launch(ws, xs, reduce_op, name, outs=o) for ws, xs, o in zip(wss, inputs, outs, strict=True)]
    if via_wait_tensor:
        for c in calls:
            RS.register(c)
        return [[torch.ops._c10d_functional.wait_tensor(o) for o in c.outs] for c in calls]
    for c in calls:
        RS.complete(c)
    for c in calls:
        torch.cuda.current_stream().wait_event(c.done)
    return [c.outs for c in calls]
