"""Inference: a SimpleFSDP model under plain torch.compile, its weight gathers on the copy engines.

    torchrun --nproc_per_node 2 examples/inference.py

One GPU per rank (nccl, copy engines) when there are enough GPUs, else CPU ranks (gloo, host
transport). Compiles the model twice, gathers on the collective and on torch_ce, and checks
that the outputs match.
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

import torch_ce

cuda = torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo")
mesh = init_device_mesh(device.type, (dist.get_world_size(),))

torch.manual_seed(0)  # the same full weights on every rank; data_parallel keeps each rank's Shard(0)
mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
model = data_parallel(mlp.to(device), mesh, mode="fully_shard")
x = torch.randn(16, 256, device=device)


def forward(transport):
    torch._dynamo.reset()
    if transport is None:
        torch_ce.disable()  # plain torch.compile: the collective (NCCL, or gloo on CPU)
    else:
        torch_ce.enable(transport=transport)  # installs torch_ce's passes in Inductor's config
    with torch.no_grad():
        return torch.compile(model)(x)  # the copy_engine run binds the weights on its first call


ref = forward(None)  # without torch_ce
out = forward("copy_engine")  # one-sided reads of the weights' symmetric-memory windows
if dist.get_rank() == 0:
    print(torch_ce.explain().table())
torch.testing.assert_close(out, ref, rtol=0, atol=0)
print(f"rank {dist.get_rank()}: outputs match the {dist.get_backend()} run")
torch_ce.disable()
dist.destroy_process_group()
