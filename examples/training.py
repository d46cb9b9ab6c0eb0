"""Training: SimpleFSDP steps under plain torch.compile, forward and backward gathers on the copy engines.

    torchrun --nproc_per_node 2 examples/training.py

One GPU per rank (nccl, copy engines) when there are enough GPUs, else CPU ranks (gloo, host
transport). Trains the same model twice from the same weights, gathering on the collective and
on torch_ce, and checks that every step's loss matches. Gradients reduce-scatter on the collective.
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.experiments.graph_trainer.simple_fsdp import MixedPrecisionPolicy, data_parallel

import torch_ce

cuda = torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo")
mesh = init_device_mesh(device.type, (dist.get_world_size(),))
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
gen = torch.Generator(device).manual_seed(dist.get_rank())  # each rank its own batches
batches = [torch.randn(16, 256, device=device, generator=gen).bfloat16() for _ in range(5)]


def train(transport):
    torch._dynamo.reset()
    torch.manual_seed(0)  # the same initial weights for both runs
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    model = data_parallel(mlp.to(device), mesh, mode="fully_shard", mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if transport is None:
        torch_ce.disable()  # plain torch.compile: the collective (NCCL, or gloo on CPU)
    else:
        torch_ce.enable(transport=transport)  # copy_engine also reshards after forward
    step, losses = torch.compile(model), []
    for x in batches:
        loss = step(x).float().pow(2).mean()
        loss.backward()  # the backward gathers again, from the same staging slots
        opt.step()  # the optimizer writes the shards, never a window: no hook needed
        opt.zero_grad()
        losses.append(loss.item())
    return losses


ref = train(None)  # without torch_ce
ces = train("copy_engine")
if dist.get_rank() == 0:
    print(torch_ce.explain().table())
assert ces == ref, (ces, ref)
print(f"rank {dist.get_rank()}: losses match the {dist.get_backend()} run: {[round(v, 4) for v in ces]}")
torch_ce.disable()
dist.destroy_process_group()
