"""The upstream crash behind NOTE [gloo: one functional collective in flight] (torch_ce/ops.py).

    for i in 1 2 3; do torchrun --nproc_per_node 2 --master_port 2950$i \\
        bench/compare/gloo_inflight.py --inflight 17 & done; wait    # aborts (a race; 2.13 CPU)
    ... --inflight 1                                                  # never aborted
    ... --inflight 4 --api                                            # never aborted

Each rank launches ``--inflight`` ``_c10d_functional.all_gather_into_tensor`` calls on the
gloo WORLD group, then waits for them in order, ``--iters`` times, with some allocator churn
between the waits; ``--api`` issues the same pattern through
``dist.all_gather_into_tensor(..., async_op=True)``. Measured on the dev machine (2 cores,
torch 2.13.0+cpu, 3 jobs at once, i.e. 6 ranks on 2 cores, as a loaded CI machine):
- the same loop run by test/mp_harness.py's spawned ranks: in flight 17: 3 of 3 jobs
  aborted ("malloc(): unaligned tcache chunk detected", or a segfault) within 30 s;
  4: 1 of 3; 2: 1 of 3; 1: 0 of 3 (20,000 iterations); ``--api`` with 4: 0 of 3;
- this script under torchrun: in flight 17: 1 of 3 aborted within 150 s; 2: 0 of 3
  (20,000 iterations). It is a race: the rate depends on load and timing.
The training graphs that first showed it (torch_ce's reorder put all 17 of a small
Llama3's weight gathers in flight at once on gloo) aborted in 2 of 2 runs of 1,500 steps;
the same graphs in Inductor's order (one in flight) ran 2 x 1,500 steps clean.
"""
import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inflight", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--api", action="store_true", help="dist.all_gather_into_tensor(async_op=True)")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, name = dist.get_world_size(), dist.group.WORLD.group_name
    xs = [torch.randn(64 * (1 + i % 3), 32) for i in range(a.inflight)]
    for _ in range(a.iters):
        if a.api:
            outs = []
            for x in xs:
                o = x.new_empty((world * x.shape[0], x.shape[1]))
                outs.append((o, dist.all_gather_into_tensor(o, x, async_op=True)))
            done = [(w.wait(), o)[1] for o, w in outs]
        else:
            launched = [torch.ops._c10d_functional.all_gather_into_tensor(x, world, name) for x in xs]
            done = []
            for o in launched:
                done.append(torch.ops._c10d_functional.wait_tensor(o))
                torch.randn(64, 64) @ torch.randn(64, 64)  # allocator churn between waits
        for o, x in zip(done, xs):
            assert torch.equal(o[dist.get_rank() * x.shape[0]:][: x.shape[0]], x)
    print(f"rank {dist.get_rank()} ({os.getpid()}): {a.iters} iterations, {a.inflight} in flight: no crash")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
