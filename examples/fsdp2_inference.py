"""Inference: an FSDP2 (fully_shard) model's weight all-gathers on the copy engines.

    torchrun --nproc_per_node 2 examples/fsdp2_inference.py

One GPU per rank (nccl, copy engines) when there are enough GPUs, else CPU ranks (gloo, host
transport). Runs the same forward on FSDP2's own all-gathers and on torch_ce's, from the same
weights, and checks the outputs are equal bit for bit; then updates the weights on every
rank inside torch_ce.updating_weights and checks again.
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
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
gen = torch.Generator(device).manual_seed(dist.get_rank())  # each rank its own batch
x = torch.randn(16, 256, device=device, generator=gen)


def build(seed):
    torch.manual_seed(seed)  # the same weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256),
                                torch.nn.GELU(), torch.nn.Linear(256, 256)).to(device)
    model.requires_grad_(False)  # static weights: bound once, read with no per-call signal
    for layer in model[:3:2]:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


with torch.no_grad():
    ref = build(0)(x)  # FSDP2's own all-gathers
    model = build(0)
    torch_ce.fsdp2.enable(model)  # collective: binds each param group's chunk into a window
    out = model(x)  # each group's gather: one read per peer, no sync
if dist.get_rank() == 0:
    print(torch_ce.explain().table())  # one row per param group: bytes, bound or why not
assert torch.equal(out, ref), (out - ref).abs().max()
new = build(1)
with torch_ce.updating_weights(model):  # every rank; a write outside it is a StaleWeightError
    model.load_state_dict(new.state_dict())
with torch.no_grad():
    assert torch.equal(model(x), new(x))
print(f"rank {dist.get_rank()}: outputs match the {dist.get_backend()} run, before and after the update")
torch_ce.fsdp2.disable(model)
dist.destroy_process_group()
