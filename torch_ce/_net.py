"""Small process-group helpers shared by the demo, the benches and the tests.

    free_port()                    a free local TCP port for a rendezvous
    all_gather_json(obj, group)    every rank's JSON-able ``obj``, in rank order

``all_gather_json`` replaces ``dist.all_gather_object``: that one pickles through numpy,
which the CPU torch wheel does not depend on (and pickles run code on load). Here each
rank's ``json.dumps(obj)`` travels as a uint8 tensor, padded to the longest one after the
lengths are gathered. JSON turns tuples into lists and dict keys into strings: compare
gathered values with each other, not with the local object.
"""
from __future__ import annotations

import json
import socket
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_gather_json(obj: Any, group=None) -> list:
    """Every rank's ``obj`` (JSON round trip), in group rank order; collective on ``group``.

    CPU tensors, except on a pure NCCL group (this rank's current CUDA device there)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return [json.loads(json.dumps(obj))]
    dev = torch.device("cpu")
    if str(dist.get_backend(group)) == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    data = bytearray(json.dumps(obj).encode())
    world = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    lens = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(lens, n, group=group)
    sizes = [int(x.item()) for x in lens]
    buf = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
    buf[: len(data)] = torch.frombuffer(data, dtype=torch.uint8).to(dev)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(bytes(b[:k].cpu().tolist())) for b, k in zip(bufs, sizes)]
