"""``torch-ce``: the console script.

    torch-ce demo                 the README's main job (GPUs if >= 2, else 2 CPU ranks)
    torch-ce bench ops [...]      CE vs NCCL gather latency / bandwidth / SM contention
    torch-ce bench e2e [...]      compiled SimpleFSDP decoder: NCCL vs CE vs no-comm bound
    torch-ce bench train [...]    SimpleFSDP training steps: NCCL vs CE gathers (torchtitan's Llama3)
    torch-ce bench fsdp2 [...]    FSDP2 fully_shard: its default vs symm_mem vs torch_ce (Llama3, Wan DiT)
    torch-ce bench plot-scaling   GB/s vs size per (world size, transport) from bench ops JSONs

The bench commands launch their own ranks (one process per GPU) unless run under torchrun.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: torch-ce {demo,bench ops,bench e2e,bench train,bench fsdp2,bench plot-scaling} [options]  (torch-ce <cmd> --help)"
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as demo_main

        return demo_main(rest) or 0
    if cmd == "bench":
        if not rest or rest[0] not in ("ops", "e2e", "train", "fsdp2", "plot-scaling"):
            print(usage, file=sys.stderr)
            return 2
        if rest[0] == "ops":
            from .bench.ops import main as ops_main

            return ops_main(rest[1:]) or 0
        if rest[0] == "train":
            from .bench.train import main as train_main

            return train_main(rest[1:]) or 0
        if rest[0] == "fsdp2":
            from .bench.fsdp2 import main as fsdp2_main

            return fsdp2_main(rest[1:]) or 0
        if rest[0] == "plot-scaling":
            from .bench.scaling import main as scaling_main

            return scaling_main(rest[1:])
        from .bench.e2e import main as e2e_main

        return e2e_main(rest[1:]) or 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
