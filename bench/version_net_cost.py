"""Host cost of the version net per call (NOTE [the version net] in
torch_ce/runtime/versions.py): one coalesced gather of N bound weights, with their watches
(local shard + DTensor parameter) and without, on the path that serves it: the C++ gather
on CUDA (loopback slots, one GPU), the Python kernel on CPU (host-transport-shaped slots
of one process). Prints a JSON line; ``--out`` writes it.

    python3 bench/version_net_cost.py --device cuda --weights 300 --out bench/results/version_net_cost_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--weights", type=int, default=300)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if a.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=0, world_size=1)
    import torch_ce
    from torch_ce.runtime import native, versions
    from torch_ce.runtime import windows as W

    group = dist.group.WORLD
    mesh = DeviceMesh(a.device, [0])
    params, slots = [], []
    for i in range(a.weights):
        local = torch.randn(64, device=dev)
        peer = torch.randn(64, device=dev)
        p = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False), requires_grad=False)
        nbytes = local.numel() * local.element_size()
        w = W.Window(("bench", i), 0, nbytes, group, (0, 1), 0, dev, local.view(torch.uint8), used=nbytes)
        s = W.Slot(w, 0, nbytes, tuple(local.shape), local.dtype, f"w{i}")
        s.peer_ptrs = [local.data_ptr(), peer.data_ptr()]
        s.peer_views = [local, peer]
        W.register(p._local_tensor, s)
        params.append((p, peer))
        slots.append(s)
    shards = [p._local_tensor for p, _ in params]
    op = torch.ops.magi.ce_all_gather_coalesced

    def per_call_us() -> float:
        for _ in range(50):
            op(shards, 2, group.group_name)
        if a.device == "cuda":
            torch.cuda.synchronize()
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(a.iters // 5):
                outs = op(shards, 2, group.group_name)
            best.append((time.perf_counter() - t0) / (a.iters // 5) * 1e6)
            if a.device == "cuda":
                for o in outs:
                    torch.ops._c10d_functional.wait_tensor(o)
                torch.cuda.synchronize()
        return min(best)

    def check_us() -> float:
        """The C++ lookups and checks alone (torch_ce_native.stale_count), per call."""
        f = torch.ops.torch_ce_native.stale_count
        for _ in range(100):
            f(shards)
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(a.iters):
                f(shards)
            best.append((time.perf_counter() - t0) / a.iters * 1e6)
        return min(best)

    cpp = a.device == "cuda" and native.loaded()
    off = per_call_us()
    c_off = check_us() if cpp else None
    versions.watch_slots([(s, p._local_tensor, s.name, [p]) for s, (p, _) in zip(slots, params, strict=True)])
    on = per_call_us()
    c_on = check_us() if cpp else None
    if cpp:
        assert torch.ops.torch_ce_native.stale_count(shards) == 0
        with torch.no_grad():
            params[0][0].mul_(1.0)  # the DTensor's counter moves: one stale slot
        assert torch.ops.torch_ce_native.stale_count(shards) == 1
    res = dict(device=a.device, torch=torch.__version__, weights=a.weights,
               path="C++ gather" if a.device == "cuda" and native.loaded() else "Python kernel",
               host_us_per_call_unwatched=round(off, 2), host_us_per_call_watched=round(on, 2),
               gather_delta_us=round(on - off, 2), target_us=5.0)
    if cpp:  # the whole-gather delta is below the gather's run-to-run noise: time the checks
        res.update(lookup_us_unwatched=round(c_off, 3), lookup_us_watched=round(c_on, 3),
                   net_us_per_call=round(c_on - c_off, 3))
    else:
        res.update(net_us_per_call=round(on - off, 2))
    res["net_ns_per_weight"] = round(res["net_us_per_call"] * 1e3 / a.weights, 2)
    print(json.dumps(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if a.device == "cuda":
        torch.cuda.synchronize()
    torch_ce.release_all()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
