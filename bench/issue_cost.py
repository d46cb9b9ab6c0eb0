"""Where the CPU time of one copy-engine gather goes (2 GPUs, torchrun --nproc_per_node 2).

Times, per call, in a tight loop on bound shards: the whole op + wait, and its parts
(lookup, output allocation, stream/event handling, the raw cudaMemcpyBatchAsync call, the
raw per-peer cudaMemcpyAsync calls, the c10d work). Prints one line per part (us/call).
"""
import os
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
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    import torch_ce
    from torch_ce import _cuda_lib, cuda_transport as tr, windows as W

    torch_ce.config.update(cost_mode="default")
    ws = dist.get_world_size()
    g = dist.group.WORLD
    shard = torch.randn(1 << 19, device=dev, dtype=torch.bfloat16)  # 1 MiB
    torch_ce.bind([shard], group=g)
    slot = W.lookup(shard)
    side = tr.copy_stream(dev)
    out = torch.empty(ws * shard.numel(), device=dev, dtype=shard.dtype)
    lay = tr._bucket_layout([slot])
    for i, off in enumerate(lay.offsets[0]):
        lay.dsts[i] = out.data_ptr() + off
    op = torch.ops.magi.ce_all_gather.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    rows = {
        "op + wait_tensor": lambda: wait(op(shard, ws, g.group_name)),
        "op only": lambda: op(shard, ws, g.group_name),
        "NCCL all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, shard),
        "windows.lookup": lambda: W.lookup(shard),
        "new_empty output": lambda: shard.new_empty((ws * shard.shape[0],)),
        "current_stream + capturing": lambda: (torch.cuda.current_stream(dev), torch.cuda.is_current_stream_capturing()),
        "Event() + record + wait_event": lambda: _ev_wait(side, dev),
        "raw memcpy_batch (ctypes)": lambda: _cuda_lib.memcpy_batch(lay.dsts, lay.srcs, lay.sizes, side.cuda_stream),
        "raw memcpy_peer_fallback (ctypes)": lambda: _cuda_lib.memcpy_peer_fallback(lay.dsts, lay.srcs, lay.sizes, side.cuda_stream),
        "gather_into (transport)": lambda: tr.gather_into([out], [slot]),
        "CopyEngineWork + register": lambda: torch._C._distributed_c10d._register_work(out, tr.CopyEngineWork(torch.cuda.Event())),
        "record_stream": lambda: out.record_stream(side),
    }
    res = {k: per_call_us(f) for k, f in rows.items()}
    dist.barrier()
    if rank == 0:
        for k, v in res.items():
            print(f"[issue] {k:<36} {v:8.1f} us/call", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
