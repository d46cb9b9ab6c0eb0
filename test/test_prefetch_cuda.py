"""Cross-call prefetch on TORCH_CE_GPU_WORLD GPUs (default 2) (NOTE [cross-call prefetch] in torch_ce/runtime/prefetch.py).

A compiled SimpleFSDP decoder over the CE transport with ``prefetch_next_call_mib``: on
fresh random inputs each call its outputs equal the same compile without the prefetch bit
for bit, and it takes every prefetched weight from the park (the C++ kernels hand those
buckets to the Python kernel). Under CUDA-graph trees the compile inserts no prefetch and
still records and replays exactly.
Skipped with fewer GPUs.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from cuda_helpers import GPU_WORLD, needs_gpu_world
from mp_harness import run_ranks

pytestmark = needs_gpu_world


def _prefetch_compiled(rank, world, cache_root):
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    import torch_ce
    from torch_ce.runtime import native, prefetch
    from torch_ce.simple_fsdp import build

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, f"r{rank}")
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    mesh = init_device_mesh("cuda", (world,))
    model = build(0, dev, torch.bfloat16, mesh, layers=3, dim=512, ffn=1024, heads=8)
    xs = []
    for i in range(4):
        torch.manual_seed(100 + i)  # fresh input per call, the same on every rank
        xs.append(torch.randn(2, 64, 512, device=dev, dtype=torch.bfloat16))
    res: dict = dict(native=native.loaded())
    with torch.no_grad():
        torch_ce.enable(transport="copy_engine", prefetch_next_call_mib=0)
        ref = [torch.compile(model, fullgraph=True)(x).clone() for x in xs]
        torch._dynamo.reset()

        torch_ce.enable(transport="copy_engine", prefetch_next_call_mib=8)
        prefetch.reset_stats()
        plain = torch.compile(model, fullgraph=True)
        res["plain_exact"] = [bool(torch.equal(plain(x), r)) for x, r in zip(xs, ref, strict=True)]
        res["plain_stats"] = dict(prefetch.stats)
        res["members"] = len(torch_ce.report.graphs[-1].prefetch.get("members", []))
        torch._dynamo.reset()
        torch_ce.drop_prefetched()

        counters.clear()
        graphed = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        outs = [graphed(x).clone() for x in xs]  # warm-up, record, replays
        outs.append(graphed(xs[0]).clone())
        res["graphs_exact"] = [bool(torch.equal(o, r)) for o, r in zip(outs, ref + ref[:1], strict=True)]
        res["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
        res["graphs_prefetch"] = torch_ce.report.graphs[-1].prefetch
        torch.cuda.synchronize()
        torch._dynamo.reset()
        torch_ce.drop_prefetched()
        res["pending_end"] = prefetch.pending()
        torch_ce.disable()
    dist.barrier()
    return res


def test_prefetch_across_calls_on_gpus(tmp_path):
    for r in run_ranks(_prefetch_compiled, GPU_WORLD, str(tmp_path), backend="nccl", timeout=600):
        print(r)
        assert all(r["plain_exact"]) and all(r["graphs_exact"]), r
        assert r["members"] >= 1, r
        # Calls 2-4 took every prefetched weight.
        assert r["plain_stats"]["taken"] == 3 * r["members"], r
        assert r["plain_stats"]["prefetched"] == 4 * r["members"], r
        assert r["cudagraph_skips"] == 0 and r["pending_end"] == 0, r
        assert r["graphs_prefetch"]["members"] == [] and "CUDA graphs" in r["graphs_prefetch"]["what"], r
