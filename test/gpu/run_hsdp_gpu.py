"""A (1, 2) ``hybrid_shard`` mesh on 2 GPUs: the weight gathers run on the copy engines and
match NCCL.

    torchrun --nproc_per_node 2 test/gpu/run_hsdp_gpu.py

Not a pytest module: it needs 2 GPUs, NCCL, torchtitan and the built CUDA library. Each
rank wraps the same small bf16 decoder with torchtitan's
``simple_fsdp.data_parallel(model, mesh, mode="hybrid_shard")`` on a (1, 2) cuda mesh
named ("dp_replicate", "dp_shard") (one "host" of 2 GPUs: the replicate dim has size 1, so
every gather runs over the dp_shard group), compiles it with ``torch_ce.enable(
transport="nccl")`` and then, after ``torch._dynamo.reset()``, with
``transport="copy_engine"``, and checks: every gather is retargeted (magi ops in the
code, every local shard in a window of the dp_shard group), outputs equal the NCCL-compiled
ones (exactness reported) and eager at bf16 tolerance, on two runs with fresh inputs, and ``explain()``
names the dp_shard dim. One shared Inductor cache dir (the default layout) is used.
Prints ``PASS``/``FAIL`` lines per check and rank; exits non-zero on any failure.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from test_torchtitan import TinyDecoder  # noqa: E402

CE_CALL = re.compile(r"= torch\.ops\.magi\.ce_all_gather(_coalesced)?\.default\(")
failures = []


def check(rank, name, ok, detail=""):
    print(f"[rank {rank}] {'PASS' if ok else 'FAIL'} {name}{(': ' + detail) if detail else ''}", flush=True)
    if not ok:
        failures.append(name)


def main():
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    cache = os.path.join(tempfile.gettempdir(), "torch_ce_hsdp_gpu_inductor")  # shared
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    import torch_ce
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh
    from torch_ce.runtime import windows as W
    from torchtitan.experiments.graph_trainer import simple_fsdp

    mesh = init_device_mesh("cuda", (1, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(0)
    model = TinyDecoder(dim=256, hidden=512, layers=2, out=128).to("cuda", torch.bfloat16).eval()
    model = simple_fsdp.data_parallel(model, mesh, mode="hybrid_shard")
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    xs = [torch.randn(4, 16, 256, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2)]
    with torch.no_grad():
        eager = [model(x) for x in xs]

    torch_ce.enable(transport="nccl")
    with torch.no_grad():
        compiled = torch.compile(model)
        nccl = [compiled(x) for x in xs]
    torch_ce.disable()
    torch._dynamo.reset()

    torch_ce.enable(transport="copy_engine")
    with torch.no_grad():
        compiled = torch.compile(model)
        out0, codes = run_and_get_code(compiled, xs[0])
        out1 = compiled(xs[1])
    torch.cuda.synchronize()
    ce = [out0, out1]
    shard_ranks = tuple(dist.get_process_group_ranks(mesh.get_group("dp_shard")))
    check(rank, "magi ops in the generated code", len(CE_CALL.findall("\n".join(codes))) > 0)
    where = {}
    for n, p in model.named_parameters():
        e = W.lookup(p._local_tensor)
        where[n] = e.window.group_ranks if isinstance(e, W.Slot) else type(e).__name__
    bad = {n: w for n, w in where.items() if w != shard_ranks}
    check(rank, "every shard in a window of the dp_shard group", not bad, str(bad) if bad else str(shard_ranks))
    for i in range(2):
        exact = torch.equal(ce[i], nccl[i])
        diff = float((ce[i].float() - nccl[i].float()).abs().max())
        check(rank, f"run {i}: CE matches NCCL", exact or torch.allclose(ce[i].float(), nccl[i].float(), rtol=1e-2, atol=1e-2),
              f"exact={exact}, max diff {diff:.3g}")
        check(rank, f"run {i}: CE ~ eager (bf16)", torch.allclose(ce[i].float(), eager[i].float(), rtol=2e-2, atol=2e-2))
    from torch_ce import report

    note = report.mesh_dims.get(mesh.get_group("dp_shard").group_name, "")  # also on a warm cache
    check(rank, "explain() names the dp_shard dim", "'dp_shard'" in note, note)
    torch_ce.disable()
    torch.cuda.synchronize()
    dist.barrier()
    torch_ce.release_all()


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        failures.append("exception")
    rank = int(os.environ.get("RANK", 0))
    print(f"[rank {rank}] {'PASS' if not failures else 'FAIL'} summary ({len(failures)} failed)", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1 if failures else 0)
