"""One GPU: what splitting a gathered matmul by column blocks costs.

The "own rows in place" experiment (docs/perf-notes.md, section 9; built, measured in runs
17-18 and reverted) computed ``x @ full.T`` as one matmul per block of output columns:
this rank's rows straight from its shard, the peers' rows from a gather of only their rows,
each block written in place into one output. This times that split against one
``torch.mm`` over the full weight for the e2e decoder's shapes (bf16, world 2, both rank
positions) and checks that the results agree.

    python3 bench/ce_linear_cost.py [--tokens 1024,4096]
"""
from __future__ import annotations

import argparse

import torch



def linear_split(inp, shard, peer_rows, group_size: int, rank: int):
    """``inp @ full.T``, ``full`` being ``peer_rows`` with ``shard`` inserted as rank
    ``rank``'s rows: one matmul per contiguous block of output columns, in place."""
    rows = shard.shape[0]
    out = inp.new_empty((inp.shape[0], group_size * rows))
    before = rank * rows
    if before:
        torch.mm(inp, peer_rows[:before].t(), out=out[:, :before])
    torch.mm(inp, shard.t(), out=out[:, before:before + rows])
    if before + rows < out.shape[1]:
        torch.mm(inp, peer_rows[before:].t(), out=out[:, before + rows:])
    return out


def _time_ms(fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / iters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1024,4096")
    a = p.parse_args()
    dim, ffn, world = 4096, 14336, 2
    shapes = dict(qkv=(3 * dim, dim), o=(dim, dim), gate=(ffn, dim), down=(dim, ffn))
    print(f"{'tokens':>6} {'weight':>6} {'mm ms':>8} {'split r0':>9} {'split r1':>9} {'ratio':>6} max|diff|")
    for m in (int(t) for t in a.tokens.split(",")):
        for name, (n, k) in shapes.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            rows = n // world
            full = _time_ms(lambda: torch.mm(x, w.t()))
            ts, diff = [], 0.0
            ref = torch.mm(x, w.t())
            for r in range(world):
                shard = w[r * rows:(r + 1) * rows].contiguous()
                peers = torch.cat([w[: r * rows], w[(r + 1) * rows:]])
                ts.append(_time_ms(lambda: linear_split(x, shard, peers, world, r)))
                diff = max(diff, (linear_split(x, shard, peers, world, r) - ref).abs().max().item())
            print(f"{m:>6} {name:>6} {full:8.3f} {ts[0]:9.3f} {ts[1]:9.3f} {max(ts) / full:6.3f} {diff:.3g}")


if __name__ == "__main__":
    main()
