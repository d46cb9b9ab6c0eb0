"""The staging-slot check of runs 30-31 (bench/results/run30_31_staging_check.log).

    torchrun --nproc_per_node 2 bench/compare/staging_check.py
    DET=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 VARIANTS=nccl,nccl,copy_engine LAYERS=2 torchrun ...

Trains torchtitan's Llama3-8B shapes (LAYERS blocks, bf16 param_dtype, AdamW, 2048 tokens
per rank) for STEPS steps per variant (transports, comma-separated in VARIANTS). With
copy_engine, after each forward it compares every weight's staging slot with the weight's
bf16 cast (they must be equal: only the stage step writes a slot), and after each step it
looks for NaN gradients and weights. DET=1 turns on deterministic algorithms, so that the
variants' losses can be compared bit for bit. Prints per-rank lines starting with [rN].
"""
import os, sys, torch, torch.distributed as dist
dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
rank = dist.get_rank(); dev = torch.device("cuda", rank); torch.cuda.set_device(dev)
import torch_ce
from torch_ce.bench import zoo
from torch_ce.runtime import windows as W
from torch.distributed.device_mesh import init_device_mesh
LAYERS = int(os.environ.get("LAYERS", "4")); DET = os.environ.get("DET") == "1"
if DET:
    torch.use_deterministic_algorithms(True, warn_only=True)
mesh = init_device_mesh("cuda", (2,))
a = dict(model="llama3_8b", layers=LAYERS, dim=0, vocab=0)
g = torch.Generator(device=dev).manual_seed(1000 + rank)
toks = [torch.randint(0, 128256, (1, 2049), device=dev, generator=g) for _ in range(4)]
def log(*x):
    print(f"[r{rank}]", *x, flush=True)
res = {}
for transport in os.environ.get("VARIANTS", "nccl,copy_engine").split(","):
    torch._dynamo.reset()
    model = zoo.build_for_training(a, dev, 0, mesh, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    torch_ce.enable(transport=transport, reshard_after_forward=True)
    c = torch.compile(model)
    losses = []
    for i in range(int(os.environ.get("STEPS", "6"))):
        x = toks[i % 4]
        loss = zoo.next_token_loss(c(x[:, :-1]), x)
        lf = loss.item()
        if transport == "copy_engine":
            bad = []
            for n, p in model.named_parameters():
                hit = W.staged(p._local_tensor, torch.bfloat16)
                if hit is None or not isinstance(hit[0], W.Slot):
                    bad.append((n, "nostage")); continue
                if not torch.equal(hit[1], p._local_tensor.to(torch.bfloat16)):
                    bad.append((n, "stale", (hit[1].float() - p._local_tensor).abs().max().item()))
            if bad: log("step", i, "staging mismatch", bad[:4])
        loss.backward()
        gn = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad.to_local()).all()]
        opt.step(); opt.zero_grad()
        pn = [n for n, p in model.named_parameters() if not torch.isfinite(p._local_tensor).all()]
        losses.append(lf)
        if gn or pn or lf != lf: log(transport, "step", i, "loss", lf, "nan grads", gn[:4], "nan params", pn[:4])
    log(transport, losses)
    res[len(res)] = (transport, losses)
    torch_ce.disable(); torch.cuda.synchronize(); dist.barrier(); torch_ce.release_all()
    del model, opt, c
vals = list(res.values())
log("pairwise identical", [(a[0], b[0], a[1] == b[1]) for i, a in enumerate(vals) for b in vals[i + 1:]])
dist.barrier()
dist.destroy_process_group()
