"""Where an FSDP2 training gather's host time goes on CUDA (one GPU, a simulated world of
2: ``loopback_training_comms``): per call, the hook as FSDP2 calls it, the bare C++ call
with its arguments made once, the same with the flag batches off (one driver call per
wait or write), the stream switches alone, and the device's time per step when the host
waits each time. Prints a table; one JSON line last.

    torchrun --nproc_per_node 1 bench/compare/step_gather_cost.py
"""
from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

from torch_ce.bench.fsdp2 import loopback_training_comms
from torch_ce.runtime import native


def per_call(fn, n=100, rounds=5):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def main():
    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    group = dist.group.WORLD
    res = {}
    for n in (1 << 15, 1 << 21):
        bufs = [torch.empty(n, dtype=torch.bfloat16, device=dev) for _ in range(2)]
        comms = loopback_training_comms(bufs)
        outs = [torch.randn(2 * n, device=dev).to(torch.bfloat16) for _ in range(2)]
        streams = [torch.cuda.Stream(dev) for _ in range(2)]

        def hook():
            for i, c in enumerate(comms):
                with torch.cuda.stream(streams[i]):
                    c(output_tensor=outs[i], input_tensor=outs[i][i * n:(i + 1) * n], group=group, async_op=False)

        hook()
        torch.cuda.synchronize()
        ids = [c._step_reg.id for c in comms]
        ins = [outs[i][i * n:(i + 1) * n] for i in range(2)]
        op = torch.ops.torch_ce_native.step_gather

        def bare():
            for i, c in enumerate(comms):
                with torch.cuda.stream(streams[i]):
                    c.calls += 1
                    op(outs[i], ins[i], c.bound.buffer, ids[i], c.calls)

        def switches():
            for i in range(2):
                with torch.cuda.stream(streams[i]):
                    pass

        def synced():
            hook()
            torch.cuda.synchronize()

        r = dict(hook_us=per_call(hook) / 2, bare_us=per_call(bare) / 2)
        native.rs_memop_batching(2)
        r["bare_unbatched_us"] = per_call(bare) / 2
        native.rs_memop_batching(1)
        r["switch_us"] = per_call(switches) / 2
        r["device_step_us"] = per_call(synced, n=50)
        ag_out = torch.empty(n, dtype=torch.bfloat16, device=dev)
        r["nccl_us"] = per_call(lambda: dist.all_gather_into_tensor(ag_out, bufs[0], group=group))
        torch.cuda.synchronize()
        want = torch.cat([outs[0][:n], outs[1][n:]])
        r["exact"] = all(bool(torch.equal(o, want)) for o in outs)
        res[n * 2] = r
        print(f"chunk {n * 2 / 2**20:.3g} MiB: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in r.items()), flush=True)
    print(json.dumps(dict(device=torch.cuda.get_device_name(dev), per_chunk_bytes=res)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
