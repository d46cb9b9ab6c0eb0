"""CPU cost per gather call of a padded (uneven Shard(0)) gather vs a plain one, one GPU.

    python3 bench/compare/uneven_cost.py            (on a 1-GPU machine; no torchrun)

Loopback slots (``register_loopback`` from test/cuda_helpers.py: the peer copy is a second
local tensor; symmetric memory refuses two ranks on one device), so this measures the CPU
side only: the time per ``op + wait_tensor`` in a tight loop, in microseconds, for

- ``plain``: ``magi.ce_all_gather`` of a bound [rows, dim] slot (the C++ kernel);
- ``padded``: ``magi.ce_all_gather_padded`` of a short rank's weight, a view of the first
  rows of a [rows, dim] padded slot (the Python op: the padded-slot lookup, then the same
  C++ gather of the full slot; NOTE [uneven Shard(0): padded slots]);
- ``padded, empty shard``: the same with 0 live rows;
- ``cast slot``: ``magi.ce_staged(static=True)`` + the plain gather of its slot (what an
  inference graph with a cast slot runs per call: NOTE [cast slots]).

Each line: ``<row>: <us>/call``, then the difference padded - plain. Prints JSON last.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "test"))
sys.path.insert(0, os.path.join(HERE, "..", ".."))


def per_call_us(fn, n=500, reps=5):
    """Median over ``reps`` loops of ``n`` calls (after a warm-up), in us per call."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", rank=0, world_size=1)
    import torch_ce
    from torch_ce.runtime import native
    from torch_ce.runtime.gather import kernel_path

    from cuda_helpers import register_loopback
    from test_uneven_cuda import padded_loopback

    if not native.load():
        raise SystemExit(f"uneven_cost: the C++ kernels are not loaded ({kernel_path('cuda')})")
    torch_ce.config.update(cost_mode="default")
    g = dist.group.WORLD
    name = g.group_name
    rows, dim = 512, 1024  # 1 MiB bf16 slabs
    mk = lambda: torch.randn(rows, dim, device=dev).to(torch.bfloat16)  # noqa: E731
    plain, plain_peer = mk(), mk()
    register_loopback(plain, plain_peer, g, 0)
    full, full_peer = mk(), mk()
    short = padded_loopback(full, full_peer, g, 1, rows - 1)
    efull, efull_peer = mk(), mk()
    empty = padded_loopback(efull, efull_peer, g, 1, 0)
    w = torch.randn(rows, dim, device=dev)
    cfull, cpeer = w.to(torch.bfloat16), mk()
    padded_loopback(cfull, cpeer, g, 1, rows, cast_of=w)

    wait = torch.ops._c10d_functional.wait_tensor.default
    op = torch.ops.magi.ce_all_gather.default
    pad = torch.ops.magi.ce_all_gather_padded.default
    staged = torch.ops.magi.ce_staged.default
    rows_ = {
        "plain": lambda: wait(op(plain, 2, name)),
        "padded": lambda: wait(pad(short, rows, 2, name)),
        "padded, empty shard": lambda: wait(pad(empty, rows, 2, name)),
        "cast slot (ce_staged + plain)": lambda: wait(op(staged([w], ["bfloat16"], [name], True)[0], 2, name)),
        "cast slot padded (ce_staged + padded)": lambda: wait(pad(staged([w], ["bfloat16"], [name], True)[0], rows, 2, name)),
    }
    # Exactness first: a cost of a wrong gather is no cost.
    exp = torch.cat([full_peer, full])
    assert torch.equal(rows_["padded"](), exp), "padded gather differs from its slots"
    res = {}
    for label, fn in rows_.items():
        res[label] = per_call_us(fn)
        print(f"{label}: {res[label]:.1f} us/call", flush=True)
    res["padded - plain"] = res["padded"] - res["plain"]
    print(f"padded - plain: {res['padded - plain']:+.1f} us/call")
    print(json.dumps({k: round(v, 2) for k, v in res.items()}))
    torch.cuda.synchronize()
    torch_ce.release_all()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
