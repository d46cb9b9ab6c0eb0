"""FSDP2's copy-engine all-gather hook on one GPU (loopback; issue 48's 1-H200 points).

The hook torch_ce installs with ``set_custom_all_gather`` (torch_ce/fsdp2/comm.py), over a
loopback slot (the bench's ``loopback_comm``: a 2-rank window whose other rank's chunk is
a local tensor), called as FSDP2 calls it, after FSDP2's own copy-in: the output must be
exactly both chunks, and a profile of the call must show the peer copy and no kernel (no
SM); both the C++ peer copy (``native.peer_copy_into``) and the Python reads. The
reduce-scatter FSDP2's hook calls is the runtime's, with given outputs: test/
test_reduce_scatter_cuda.py's loopback cases (the given-outputs call among them).
"""
from __future__ import annotations

import pytest
import torch

from cuda_helpers import needs_gpu_and_kernels
from mp_harness import run_ranks

pytestmark = needs_gpu_and_kernels


def _hook_exact(rank, world):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from torch_ce.bench.fsdp2 import loopback_comm

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev).manual_seed(1234)
    res = dict(exact=[], kernels=[], memcpys=[])
    group = dist.group.WORLD
    keep = []
    cases = [(path, dtype, n) for path in ("native", "python")
             for dtype, n in ((torch.float32, 4096 * 3), (torch.bfloat16, 1 << 20), (torch.bfloat16, 7 * 129))]
    for path, dtype, n in cases:
        mine = torch.randn(n, device=dev, generator=gen).to(dtype)
        peer = torch.randn(n, device=dev, generator=gen).to(dtype)
        comm = loopback_comm(mine, peer)
        if path == "python":
            comm._native = False  # the Python reads (a library without peer_copy_into)
        out = comm.allocate((2 * n,), dtype=dtype, device=dev)
        keep += [mine, peer, out]
        for step in range(3):
            out.copy_(torch.randn(2 * n, device=dev, generator=gen).to(dtype))  # noise where the peer lands
            out[:n].copy_(mine)  # FSDP2's copy-in of this rank's chunk
            if step == 2:
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    work = comm(output_tensor=out, input_tensor=out[:n], group=group, async_op=False)
                    torch.cuda.synchronize()
                ev = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                res["kernels"].append([k for k in ev if not any(s in k.lower() for s in ("memcpy", "memset", "stream"))])
                res["memcpys"].append(len([k for k in ev if "memcpy" in k.lower()]))
            else:
                work = comm(output_tensor=out, input_tensor=out[:n], group=group, async_op=False)
            assert work is None  # complete in stream order, FSDP2's contract
            # FSDP2 reads the output on its own stream after the call: the current stream here.
            got = out.clone()
            torch.cuda.synchronize()
            res["exact"].append(bool(torch.equal(got, torch.cat([mine, peer]))))
            peer.copy_(torch.randn(n, device=dev, generator=gen).to(dtype))  # a fresh peer chunk per call
            torch.cuda.synchronize()
    return res


def test_fsdp2_hook_loopback_exact_and_no_kernel():
    (r,) = run_ranks(_hook_exact, 1, backend="nccl", timeout=300)
    assert r["exact"] and all(r["exact"]), r["exact"]
    assert r["kernels"] == [[]] * 6, r["kernels"]  # the peer's part is a copy, never a kernel
    assert all(m >= 1 for m in r["memcpys"]), r["memcpys"]
