"""Cross-call prefetch (NOTE [cross-call prefetch] in torch_ce/runtime/prefetch.py) on CPU ranks.

Two gloo ranks, the host transport: a compiled SimpleFSDP MLP with
``prefetch_next_call_mib`` gives eager's outputs exactly on fresh random inputs while the
next call's first weights are taken from the park; an in-place weight update made on every
rank (version counters move) is seen, not served stale; a gather that asks for other
shards drops the park and is still exact; ``drop_prefetched`` empties it.
"""
from __future__ import annotations

import torch

from mp_harness import reference_all_gather, run_ranks, setup_compile


def _model(world, seed):
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    from torch_ce.simple_fsdp import shard_linears

    torch.manual_seed(seed)
    dims = [8 * world, 16 * world, 8 * world, 4 * world]
    model = nn.Sequential(*[nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:])])
    eager = nn.Sequential(*[nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:])])
    eager.load_state_dict(model.state_dict())
    return shard_linears(model, init_device_mesh("cpu", (world,))), eager.requires_grad_(False), dims


def _run(rank, world, seed, cache_root):
    import torch.distributed as dist

    import torch_ce
    from torch_ce.runtime import prefetch

    setup_compile(cache_root, rank)  # this rank's own cache, no FX graph cache: the passes run here
    model, eager, dims = _model(world, seed)
    shards = [m.parametrizations.weight.original._local_tensor for m in model]
    # The first two weights fit the budget (gathered bytes), the third does not.
    budget = (dims[0] * dims[1] + dims[1] * dims[2]) * 4 / 2**20
    torch_ce.enable(transport="copy_engine", prefetch_next_call_mib=budget)
    prefetch.reset_stats()
    res: dict = dict(exact=[], stats=[])
    try:
        compiled = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            def call(i):
                torch.manual_seed(seed + 100 + i)  # fresh input, same on every rank
                x = torch.randn(3, dims[0])
                y, ref = compiled(x), eager(x)
                res["exact"].append(bool(torch.equal(y, ref)))
                res.setdefault("max_diff", []).append(float((y - ref).abs().max()))
                res["stats"].append(dict(prefetch.stats))

            for i in range(3):
                call(i)
            res["pending_after_calls"] = prefetch.pending()
            res["graph_prefetch"] = torch_ce.report.graphs[-1].prefetch

            # Every rank updates its own shard in place through the protocol (it fences,
            # and drops the parked set), then the eager reference takes the same full weights.
            torch.manual_seed(seed + 7)
            new = [torch.randn(m.out_features, m.in_features) for m in eager]
            rows = [w.shape[0] // world for w in new]
            with torch_ce.updating_weights(model):
                for s, w, r in zip(shards, new, rows, strict=True):
                    s.copy_(w[rank * r:(rank + 1) * r])
            for m, w in zip(eager, new, strict=True):
                m.weight.copy_(w)
            call(3)
            call(4)

            # A gather of another shard drops the park, and is still exact.
            torch_ce.drop_prefetched()
            res["pending_after_drop"] = prefetch.pending()
            prefetch.reset_stats()
            torch.ops.magi.ce_prefetch([shards[0]], world, dist.group.WORLD.group_name)
            other = torch_ce.all_gather(shards[2])
            res["other_exact"] = bool(torch.equal(other, reference_all_gather(shards[2])))
            res["after_other"] = dict(prefetch.stats, pending=prefetch.pending())
            torch.ops.magi.ce_prefetch([shards[0], shards[1]], world, dist.group.WORLD.group_name)
            torch_ce.drop_prefetched()
            res["after_drop"] = dict(prefetch.stats, pending=prefetch.pending())
            dist.barrier()  # no rank releases its windows while a peer still reads them
    finally:
        torch_ce.disable()
    return res


def test_prefetch_across_calls_host_transport(tmp_path):
    seed = int(torch.randint(0, 2**31, ()).item())
    for r in run_ranks(_run, 2, seed, str(tmp_path.resolve()), timeout=300):
        assert all(r["exact"]), r
        assert r["graph_prefetch"]["members"] and len(r["graph_prefetch"]["members"]) == 2, r
        # Calls 2 and 3 took both prefetched weights; call 1 had nothing parked.
        assert [s["taken"] for s in r["stats"][:3]] == [0, 2, 4], r["stats"]
        assert [s["prefetched"] for s in r["stats"][:3]] == [2, 4, 6], r["stats"]
        assert r["pending_after_calls"] == 2, r
        # The update dropped both parked weights (not taken), call 5 takes again.
        assert r["stats"][3]["dropped"] == 2 and r["stats"][3]["taken"] == 4, r["stats"]
        assert r["stats"][4]["taken"] == 6, r["stats"]
        assert r["pending_after_drop"] == 0, r
        assert r["other_exact"], r
        assert r["after_other"] == dict(prefetched=1, taken=0, dropped=1, stale=0, pending=0), r
        assert r["after_drop"]["pending"] == 0 and r["after_drop"]["dropped"] == 3, r
