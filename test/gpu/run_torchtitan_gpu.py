"""torch_ce under torchtitan's SimpleFSDP on 2 GPUs (NCCL + the copy-engine transport).

    torchrun --nproc_per_node 2 test/gpu/run_torchtitan_gpu.py

Not a pytest module (no ``test_`` prefix): it needs 2 GPUs, NCCL, torchtitan and the built
CUDA library (``pip install --no-build-isolation -e .`` with nvcc). Each rank:

  1. builds the same small decoder-ish model (nn.Linear blocks, some with biases), bf16
     weights, wraps it unchanged with torchtitan's
     ``simple_fsdp.data_parallel(model, mesh, mode="fully_shard")`` on a 1-D cuda mesh;
  2. eager forward under ``torch.no_grad()`` (the reference; torch_ce not enabled);
  3. ``torch.compile`` with ``torch_ce.enable(transport="nccl")``: NCCL gathers;
  4. ``torch._dynamo.reset()``, ``torch_ce.enable(transport="copy_engine")``, compile again:
     every weight gather must be retargeted (``magi.ce_all_gather`` in the generated code,
     nothing refused, every local shard bound into a window after the first run), and the
     output must match the NCCL-compiled one (allclose; exactness is reported) and eager
     (allclose at bf16 tolerance: Inductor and eager round differently), on a first and a
     second run (bind step a no-op) with fresh inputs.

Prints one ``PASS``/``FAIL`` line per check and rank, and a final summary on rank 0; exits
non-zero if any check failed on any rank. NVLink multicast stays off: the script never
overrides NCCL_NVLS_ENABLE / TORCH_SYMM_MEM_DISABLE_MULTICAST (it sets them to 0 / 1 only
if they are unset).
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import torch_ce  # noqa: F401
except ImportError:
    sys.path.insert(0, _ROOT)
    import torch_ce  # noqa: F401

DIM, HIDDEN, LAYERS, OUT = 1024, 2048, 2, 512
TOKENS = (4, 256)  # batch, sequence
# bf16 tolerances, relative to the reference's largest magnitude.
REL_TOL_NCCL = 1e-2  # same gathered weights, same Inductor graph up to the gather ops
REL_TOL_EAGER = 3e-2  # Inductor vs eager bf16 rounding (bias epilogues, fused adds)


# The CPU test's model (test/test_torchtitan.py), at GPU sizes.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_torchtitan import TinyDecoder  # noqa: E402


class Checks:
    def __init__(self, rank: int):
        self.rank, self.failed, self.n = rank, [], 0

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.n += 1
        if not ok:
            self.failed.append(name)
        print(f"[rank {self.rank}] {'PASS' if ok else 'FAIL'} {name}"
              f"{': ' + detail if detail else ''}", flush=True)
        return ok


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def compile_and_run(model, xs, transport: str):
    """Fresh Dynamo state, torch_ce on with ``transport``, compile, run every input."""
    from torch._inductor.utils import run_and_get_code
    from torch_ce import report

    torch._dynamo.reset()
    report.clear()
    torch_ce.disable()
    torch_ce.enable(transport=transport)
    compiled = torch.compile(model)
    with torch.no_grad():
        out0, codes = run_and_get_code(compiled, xs[0])
        torch.cuda.synchronize()
        after_first = None
        if transport == "copy_engine":
            from torch_ce.runtime import windows

            after_first = {n: type(windows.lookup(p._local_tensor)).__name__
                           for n, p in model.named_parameters()}
        outs = [out0] + [compiled(x) for x in xs[1:]]
        torch.cuda.synchronize()
    rec = report.graphs[-1] if report.graphs else None
    return outs, "\n".join(codes), rec, after_first


def main() -> int:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    C = Checks(rank)
    t0 = time.time()
    try:
        # Per-rank fresh Inductor cache (absolute path), no FX graph cache.
        cache = tempfile.mkdtemp(prefix=f"torch_ce_tt_inductor_r{rank}_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache)
        import torch._inductor.config as ic

        ic.fx_graph_cache = False

        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel
        except ImportError as e:
            C.check("import torchtitan.experiments.graph_trainer.simple_fsdp", False, repr(e))
            return _finish(C, world, t0)
        from torch.distributed.tensor import DTensor, Shard
        from torch_ce.runtime import native
        from torch_ce.runtime.gather import kernel_path

        if not C.check("C++ gather kernels loaded", native.load(), kernel_path("cuda")):
            return _finish(C, world, t0)

        torch.manual_seed(1234)  # same weights on every rank
        model = TinyDecoder(DIM, HIDDEN, LAYERS, OUT).to(device=dev, dtype=torch.bfloat16).eval()
        mesh = init_device_mesh("cuda", (world,))
        model = data_parallel(model, mesh, mode="fully_shard")
        params = dict(model.named_parameters())
        C.check("every parameter is a Shard(0) DTensor",
                all(isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),)
                    for p in params.values()), f"{len(params)} parameters")

        gen = torch.Generator(device=dev).manual_seed(100 + rank)  # own data per rank
        xs = [torch.randn(*TOKENS, DIM, generator=gen, device=dev, dtype=torch.bfloat16)
              for _ in range(2)]
        with torch.no_grad():
            eager = [model(x) for x in xs]
        torch.cuda.synchronize()

        nccl_outs, nccl_code, _, _ = compile_and_run(model, xs, "nccl")
        C.check("nccl transport: no magi op in the generated code",
                "magi.ce_all_gather" not in nccl_code)

        ce_outs, ce_code, rec, after_first = compile_and_run(model, xs, "copy_engine")
        n_ce = len(re.findall(r"= torch\.ops\.magi\.ce_all_gather(?:_coalesced)?\.default\(",
                              ce_code))
        C.check("copy_engine: generated code calls magi.ce_all_gather", n_ce > 0,
                f"{n_ce} call(s)")
        C.check("copy_engine: every gather retargeted, none refused",
                rec is not None and len(rec.bound) == len(params) and not rec.refused,
                f"bound {len(rec.bound) if rec else None} of {len(params)}, "
                f"refused {rec.refused if rec else None}")
        unbound = {n: k for n, k in (after_first or {}).items() if k != "Slot"}
        C.check("copy_engine: every local shard bound after the first run", not unbound,
                str(unbound) if unbound else f"{len(after_first)} shards in windows")

        for i, (ce, nc, ea) in enumerate(zip(ce_outs, nccl_outs, eager)):
            run = "first" if i == 0 else "second"
            finite = bool(torch.isfinite(ce.float()).all())
            d_n, d_e = rel_diff(ce, nc), rel_diff(ce, ea)
            C.check(f"{run} run: CE output finite", finite)
            C.check(f"{run} run: CE == compiled NCCL (allclose)", d_n <= REL_TOL_NCCL,
                    f"rel max diff {d_n:.3g}, bit-exact {torch.equal(ce, nc)}")
            C.check(f"{run} run: CE == eager (allclose)", d_e <= REL_TOL_EAGER,
                    f"rel max diff {d_e:.3g} (NCCL-compiled vs eager: {rel_diff(nc, ea):.3g})")
        # The bound parameters still serve eager correctly (they view the windows now).
        with torch.no_grad():
            eager_after = model(xs[0])
        torch.cuda.synchronize()
        C.check("eager on the bound weights unchanged", torch.equal(eager_after, eager[0]))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        C.check("ran without an exception", False)
    finally:
        try:
            torch_ce.disable()
            torch_ce.release_all()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    return _finish(C, world, t0)


def _finish(C: Checks, world: int, t0: float) -> int:
    failed = torch.tensor([len(C.failed)], device="cuda")
    dist.all_reduce(failed)
    total = int(failed.item())
    if C.rank == 0:
        verdict = "PASS" if total == 0 else "FAIL"
        print(f"{verdict} run_torchtitan_gpu: {total} failed check(s) over {world} ranks "
              f"({C.n} checks per rank, {time.time() - t0:.1f} s)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
