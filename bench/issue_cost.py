"""Where the CPU time of one copy-engine gather goes (torchrun --nproc_per_node 2).

Times, per call, in a tight loop on bound shards: the whole op + wait through the C++
kernel, through the Python kernel (which hands its bound members back to the C++ gather),
NCCL's gather, and a few torch pieces a gather pays for (lookup, output allocation,
stream/event handling, record_stream). Prints one line per row (us/call).
With one process (``--nproc_per_node 1``, e.g. a one-GPU machine) the shard is a loopback
slot (``register_loopback`` from test/cuda_helpers.py: the peer copy is a second local
tensor; symmetric memory refuses two ranks on one device) and there is no NCCL row: CPU
cost is what this measures, and it does not depend on where the peer's copy lives.
"""
import os
import sys
import time

import torch
import torch.distributed as dist


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def _ev_wait(side, dev):
    e = torch.cuda.Event()
    e.record(torch.cuda.current_stream(dev))
    side.wait_event(e)


def main():
    rank = int(os.environ["LOCAL_RANK"])
    nccl = int(os.environ["WORLD_SIZE"]) > 1
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    if nccl:
        dist.init_process_group("nccl", device_id=dev)
    else:
        dist.init_process_group("gloo")
    import torch_ce
    from torch_ce.runtime import native, windows as W
    from torch_ce.runtime.gather import kernel_path

    if not native.load():
        raise SystemExit(f"issue_cost: {kernel_path('cuda')}")

    torch_ce.config.update(cost_mode="default")
    ws = dist.get_world_size()
    g = dist.group.WORLD
    shard = torch.randn(1 << 19, device=dev, dtype=torch.bfloat16)  # 1 MiB
    if ws == 1:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test"))
        from cuda_helpers import register_loopback

        peer = torch.randn_like(shard)
        register_loopback(shard, peer, g, 0)
        ws = 2
    else:
        torch_ce.bind([shard], group=g)
    assert isinstance(W.lookup(shard), W.Slot)
    side = torch.cuda.Stream(device=dev)
    out = torch.empty(ws * shard.numel(), device=dev, dtype=shard.dtype)
    op = torch.ops.magi.ce_all_gather.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    py = torch.ops.torch_ce.gather_python.default
    opc = torch.ops.magi.ce_all_gather_coalesced.default
    five = [shard] * 5
    rows = {
        "op + wait_tensor (C++ kernel)": lambda: wait(op(shard, ws, g.group_name)),
        "op only (C++ kernel)": lambda: op(shard, ws, g.group_name),
        "coalesced x5 + 5 waits (C++)": lambda: [wait(o) for o in opc(five, ws, g.group_name)],
        "op + wait_tensor (Python kernel)": lambda: wait(py([shard], ws, g.group_name)[0]),
        "op only (Python kernel)": lambda: py([shard], ws, g.group_name),
        "coalesced x5 + 5 waits (Python)": lambda: [wait(o) for o in py(five, ws, g.group_name)],
        "NCCL all_gather_into_tensor": (lambda: dist.all_gather_into_tensor(out, shard)) if nccl else None,
        "windows.lookup": lambda: W.lookup(shard),
        "new_empty output": lambda: shard.new_empty((ws * shard.shape[0],)),
        "current_stream + capturing": lambda: (torch.cuda.current_stream(dev), torch.cuda.is_current_stream_capturing()),
        "Event() + record + wait_event": lambda: _ev_wait(side, dev),
        "gather_bound (C++, Python's hand-back)": lambda: native.gather_bound([shard], ws),
        "record_stream": lambda: out.record_stream(side),
    }
    res = {k: per_call_us(f) for k, f in rows.items() if f is not None}
    dist.barrier()
    if rank == 0:
        for k, v in res.items():
            print(f"[issue] {k:<36} {v:8.1f} us/call", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
