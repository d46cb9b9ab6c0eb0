"""Training: an FSDP2 (fully_shard) model's forward and backward all-gathers on torch_ce.

    torchrun --nproc_per_node 2 examples/fsdp2_training.py

One GPU per rank (nccl) when there are enough GPUs, else CPU ranks (gloo, host transport).
Trains the same model twice from the same weights, on FSDP2's own all-gathers and on
torch_ce's, and checks that every step's loss matches. Training gathers stage each chunk and
order the reads with one-sided step words (host transport; on CUDA the groups keep FSDP2's
all-gather for now, and explain() says so). Gradients reduce-scatter on the collective.
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import torch_ce

cuda = torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo")
mesh = init_device_mesh(device.type, (dist.get_world_size(),))
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
gen = torch.Generator(device).manual_seed(dist.get_rank())  # each rank its own batches
batches = [torch.randn(16, 256, device=device, generator=gen) for _ in range(5)]


def train(with_torch_ce):
    torch.manual_seed(0)  # the same initial weights for both runs
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).to(device)
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if with_torch_ce:
        torch_ce.fsdp2.enable(model)  # parameters require grad: each group is staged per call
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in batches:
        loss = model(x).float().pow(2).mean()
        loss.backward()  # the backward gathers again (reshard after forward)
        opt.step()  # writes the shards; the next gather stages them: no hook needed
        opt.zero_grad()
        losses.append(loss.item())
    return losses


ref = train(False)  # FSDP2's own all-gathers
ces = train(True)
if dist.get_rank() == 0:
    print(torch_ce.explain().table())
assert ces == ref, (ces, ref)
print(f"rank {dist.get_rank()}: losses match the {dist.get_backend()} run: {[round(v, 4) for v in ces]}")
dist.destroy_process_group()
