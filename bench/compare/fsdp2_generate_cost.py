"""Host time per generated token of a Hugging Face causal LM under FSDP2 (greedy
``generate()`` under ``no_grad``): FSDP2's own all-gathers, torch_ce with the model as
``from_pretrained`` leaves it (parameters requiring grad: training groups, staged with step
words), and torch_ce with ``requires_grad_(False)`` (static groups). Same weights, same
prompt; the tokens are checked equal to FSDP2's. On CPU: gloo and the host transport; on
GPUs: NCCL and the copy engines (one GPU per rank).

    torchrun --nproc_per_node 2 bench/compare/fsdp2_generate_cost.py [--out DIR] [--tokens 32]

Rank 0 prints a table and writes ``fsdp2_generate_<device>.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def build(seed: int, hidden: int, layers: int, requires_grad: bool, mesh, device):
    import transformers
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=256)
    net = transformers.LlamaForCausalLM(cfg).eval().requires_grad_(requires_grad).to(device)
    for layer in net.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    torch.set_num_threads(1)
    import torch_ce
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(rank)).to(device)
    res, want = {}, None
    for name, rg, ce in (("fsdp2", True, False), ("torch_ce as loaded", True, True),
                         ("torch_ce requires_grad_(False)", False, True)):
        m = build(0, a.hidden, a.layers, rg, mesh, device)
        if ce:
            torch_ce.fsdp2.enable(m)
        times = []
        for _ in range(a.rounds):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = m.generate(ids, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False,
                                 pad_token_id=0)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / a.tokens * 1e3)
        if want is None:
            want = out
        hint = torch_ce.explain().as_dict().get("fsdp2_hint", "") if ce else ""
        res[name] = dict(ms_per_token=statistics.median(times), same_tokens=bool(torch.equal(out, want)),
                         hint=bool(hint))
        if ce:
            torch_ce.fsdp2.disable(m)
    base = res["fsdp2"]["ms_per_token"]
    for r in res.values():
        r["ratio"] = r["ms_per_token"] / base
    if rank == 0:
        dev = torch.cuda.get_device_name(device) if cuda else "cpu"
        print(f"{'path':<34} {'ms/token':>9} {'ratio':>6} same tokens  hint")
        for name, r in res.items():
            print(f"{name:<34} {r['ms_per_token']:>9.2f} {r['ratio']:>6.2f} {str(r['same_tokens']):<11}  {r['hint']}")
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"fsdp2_generate_{dev.replace(' ', '_').lower()}.json")
        with open(path, "w") as f:
            json.dump(dict(args=vars(a), world=world, device=dev, torch=torch.__version__, paths=res), f, indent=1)
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
