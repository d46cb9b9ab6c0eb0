"""The C++ gather kernels (csrc/ce_gather.cu, NOTE [native gather path]) on CUDA.

One GPU: a single rank with loopback slots (``cuda_helpers.register_loopback``: the "peer" copy
is a second local tensor, since symmetric memory refuses two ranks on one device) checks
the kernel's mechanics exactly against ``torch.cat``: registry, both copy streams, events,
the batch submission, the c10d work, the hand-off to the Python kernel, graph capture and
CUDA-graph trees. Several GPUs (TORCH_CE_GPU_WORLD, default 2): that many ranks with real
symmetric windows (NCCL group), compared exactly with NCCL's gather of the same shards, in
every peer order (NOTE [peer order] in csrc/ce_copy.h).

Skipped without a GPU or without the built C++ library (CPU torch, no nvcc).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from cuda_helpers import GPU_WORLD, needs_gpu_world, register_loopback
from mp_harness import count_gathers, reference_all_gather, run_ranks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        not any(f.startswith("_ce_torch") for f in os.listdir(os.path.join(
            os.path.dirname(__file__), "..", "torch_ce", "runtime"))),
        reason="the C++ gather kernels are not built (CPU torch or no nvcc)"),
]

WS = GPU_WORLD


def _device(rank: int) -> torch.device:
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _wait(t):
    return torch.ops._c10d_functional.wait_tensor(t)


def _ref(t: torch.Tensor) -> torch.Tensor:
    """NCCL's gather of the same shard, on the CPU: the reference for every CE gather."""
    return reference_all_gather(t).cpu()


def _hand_off_errors(dev, shard, world, name) -> dict:
    """What the C++ kernel does not serve reaches the Python kernel's clear errors."""
    errors = {}
    for label, call in (
        ("unbound", lambda: torch.ops.magi.ce_all_gather(torch.randn(8, device=dev), world, name)),
        ("group_size", lambda: torch.ops.magi.ce_all_gather(shard, world + 1, name)),
        ("dead_group", lambda: torch.ops.magi.ce_all_gather(shard, world, "no-such-group")),
    ):
        try:
            call()
            errors[label] = "no error"
        except RuntimeError as e:
            errors[label] = str(e)
    return errors


def _ordered_exact(shard, world, name, ref) -> bool:
    """Stream order, nothing synchronised: the current stream is busy when the gather is
    issued (the copies must start after its allocation) and the consumer runs right after
    wait_tensor (it must see every copied byte)."""
    torch.cuda._sleep(int(5e7))
    out = torch.ops.magi.ce_all_gather(shard, world, name)
    return bool(torch.equal((_wait(out) * 1).cpu(), ref))


def _capture(step):
    """Warm ``step`` up on a side stream, then capture it; returns (graph, static outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm up outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = step()
    return g, static


def _assert_hand_off_and_order(r) -> None:
    assert "not bound to a symmetric window" in r["errors"]["unbound"], r
    assert "does not match" in r["errors"]["group_size"], r
    assert "not a live process group" in r["errors"]["dead_group"], r
    assert r["ordered_exact"], r


# ---------------------------------------------------------------------------------------
# One GPU: loopback slots
# ---------------------------------------------------------------------------------------

LOOP_SPECS = (((128, 64), torch.float32), ((4096,), torch.bfloat16),
              ((64, 3, 5), torch.float16), ((32 << 20,), torch.bfloat16))  # the last: 64 MiB


def _loop_pairs(dev, gen, pos):
    """(mine, peer, expected) per spec; ``pos`` is this rank's position in the pair."""
    pairs = []
    for shape, dtype in LOOP_SPECS:
        mine = torch.randn(shape, generator=gen, device=dev).to(dtype)
        peer = torch.randn(shape, generator=gen, device=dev).to(dtype)
        register_loopback(mine, peer, dist.group.WORLD, pos)
        pairs.append((mine, peer))
    return pairs


def _expected(pairs, pos):
    return [torch.cat([m, p] if pos == 0 else [p, m]).cpu() for m, p in pairs]


def _loop_exact(rank, world):
    from torch_ce.runtime import native

    dev = _device(0)
    gen = torch.Generator(device=dev).manual_seed(os.getpid())
    name = dist.group.WORLD.group_name
    res = dict(loaded=native.loaded())
    py = count_gathers()
    keep = []  # every registered tensor stays alive: no address is reused under a stale entry
    for pos in (0, 1):
        for split in (True, False):
            native.set_split_local_copy(split)
            pairs = _loop_pairs(dev, gen, pos)
            keep.append(pairs)
            shards = [m for m, _ in pairs]
            exp = _expected(pairs, pos)
            singles = [_wait(torch.ops.magi.ce_all_gather(s, 2, name)).cpu() for s in shards]
            outs = [_wait(o).cpu() for o in torch.ops.magi.ce_all_gather_coalesced(shards, 2, name)]
            res[f"pos{pos}_split{int(split)}"] = [bool(torch.equal(a, b)) for a, b in zip(singles + outs, exp + exp, strict=True)]
    native.set_split_local_copy(True)
    res["slots"] = native.slot_count()
    res["python_submissions_native"] = sum(py.values())
    pys = [_wait(o).cpu() for o in torch.ops.torch_ce.gather_python(shards, 2, name)]
    res["python_exact"] = [bool(torch.equal(a, b)) for a, b in zip(pys, exp, strict=True)]
    res["python_submissions_python"] = sum(py.values())
    res["errors"] = _hand_off_errors(dev, shards[0], 2, name)
    res["ordered_exact"] = _ordered_exact(shards[3], 2, name, exp[3])  # 128 MiB gathered
    # Control: without wait_tensor the consumer does not wait for the copies.
    torch.cuda._sleep(int(5e7))
    unwaited = torch.ops.magi.ce_all_gather(shards[3], 2, name)
    res["control_unwaited_exact"] = bool(torch.equal((unwaited * 1).cpu(), exp[3]))
    _wait(unwaited)
    return res


def test_loopback_gathers_exact_and_hand_off():
    (r,) = run_ranks(_loop_exact, 1, timeout=300)
    print(r)
    assert r["loaded"], r
    for key in ("pos0_split1", "pos0_split0", "pos1_split1", "pos1_split0"):
        assert all(r[key]), (key, r)
    assert r["python_submissions_native"] == 0, r  # the C++ kernel served every gather
    assert all(r["python_exact"]) and r["python_submissions_python"] > 0, r
    _assert_hand_off_and_order(r)
    # The control is reported, not asserted: an unwaited read may win the race.
    print("control (no wait_tensor) exact:", r["control_unwaited_exact"])


def _loop_graph(rank, world):
    """A captured gather replays the reads: new source contents show up in each replay."""
    dev = _device(0)
    gen = torch.Generator(device=dev).manual_seed(os.getpid())
    name = dist.group.WORLD.group_name
    pairs = _loop_pairs(dev, gen, 1)[:3]
    shards = [m for m, _ in pairs]

    def step():
        outs = torch.ops.magi.ce_all_gather_coalesced(shards, 2, name)
        return [_wait(o) * 2 for o in outs]

    g, static = _capture(step)
    res = {}
    for trial in range(2):
        with torch.no_grad():
            for m, p in pairs:
                m.copy_(torch.randn(m.shape, generator=gen, device=dev).to(m.dtype))
                p.copy_(torch.randn(p.shape, generator=gen, device=dev).to(p.dtype))
        exp = [e * 2 for e in _expected(pairs, 1)]
        g.replay()
        torch.cuda.synchronize()
        res[f"replay{trial}_exact"] = [bool(torch.equal(o.cpu(), e)) for o, e in zip(static, exp, strict=True)]
    return res


def test_loopback_gather_in_cuda_graph():
    (r,) = run_ranks(_loop_graph, 1, timeout=300)
    print(r)
    assert all(r["replay0_exact"]) and all(r["replay1_exact"]), r


def _loop_trees(rank, world):
    """torch.compile(mode="reduce-overhead") of gather -> wait -> matmul: CUDA-graph trees
    record it (no pool tensor left untracked) and replay it exactly."""
    from torch._dynamo.utils import counters

    dev = _device(0)
    gen = torch.Generator(device=dev).manual_seed(os.getpid())
    name = dist.group.WORLD.group_name
    m, p = _loop_pairs(dev, gen, 0)[1]  # 4096 bf16 values per rank
    torch._dynamo.mark_static_address(m)  # a parameter in real use: not copied per call
    x = torch.randn(16, 128, generator=gen, device=dev).to(torch.bfloat16)

    def f(w, x):
        full = torch.ops._c10d_functional.wait_tensor(torch.ops.magi.ce_all_gather(w, 2, name))
        return full * 2, x @ full.view(128, 64)

    full_ref = torch.cat([m, p])
    ref = x @ full_ref.view(128, 64)
    counters.clear()
    g = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    outs = [[t.clone() for t in g(m, x)] for _ in range(3)]  # warm-up, record, replay
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        outs.append([t.clone() for t in g(m, x)])
    torch.cuda.synchronize()
    return dict(
        cudagraph_skips=int(counters["inductor"]["cudagraph_skips"]),
        graph_launches=sum(e.name == "cudaGraphLaunch" for e in prof.events()),
        gather_exact=[bool(torch.equal(a, full_ref * 2)) for a, _ in outs],
        matmul_close=[bool(torch.allclose(b.float(), ref.float(), rtol=1e-2, atol=1e-2)) for _, b in outs],
    )


def test_loopback_compiled_with_cudagraph_trees():
    (r,) = run_ranks(_loop_trees, 1, timeout=300)
    print(r)
    assert r["cudagraph_skips"] == 0 and r["graph_launches"] >= 1, r
    assert all(r["gather_exact"]) and all(r["matmul_close"]), r


# ---------------------------------------------------------------------------------------
# Two GPUs: real symmetric windows
# ---------------------------------------------------------------------------------------


def _exact(rank, world):
    import torch_ce
    from torch_ce.runtime import native

    dev = _device(rank)
    torch_ce.config.update(cost_mode="default")
    gen = torch.Generator(device=dev).manual_seed(1234 + 17 * rank + os.getpid() % 1000)
    shards = [
        torch.randn((128, 64), generator=gen, device=dev),
        torch.randn((4096,), generator=gen, device=dev).to(torch.bfloat16),
        torch.randn((64, 3, 5), generator=gen, device=dev).to(torch.float16),
        torch.randn((4 << 20,), generator=gen, device=dev).to(torch.bfloat16),  # 8 MiB
    ]
    torch_ce.bind(shards, group=dist.group.WORLD)
    name = dist.group.WORLD.group_name
    refs = [_ref(s) for s in shards]
    res = dict(loaded=native.loaded(), slots=native.slot_count())
    py = count_gathers()
    singles = [_wait(torch.ops.magi.ce_all_gather(s, world, name)).cpu() for s in shards]
    outs = [_wait(o).cpu() for o in torch.ops.magi.ce_all_gather_coalesced(shards, world, name)]
    res["python_submissions_native"] = sum(py.values())
    res["single_exact"] = [bool(torch.equal(a, b)) for a, b in zip(singles, refs, strict=True)]
    res["coalesced_exact"] = [bool(torch.equal(a, b)) for a, b in zip(outs, refs, strict=True)]
    # The Python kernel gives the same bits (it hands its bound members back to C++).
    pys = [_wait(o).cpu() for o in torch.ops.torch_ce.gather_python(shards, world, name)]
    res["python_exact"] = [bool(torch.equal(a, b)) for a, b in zip(pys, refs, strict=True)]
    res["python_submissions_python"] = sum(py.values())
    res["errors"] = _hand_off_errors(dev, shards[0], world, name)
    res["ordered_exact"] = _ordered_exact(shards[3], world, name, refs[3])
    # Every peer order and a chunked plan land the same bytes. 20 KiB pieces: the 32 KiB
    # member is a piece and a shorter one, the 8 MiB member 410 pieces per peer, the small
    # members one piece each.
    res["orders_exact"] = {}
    for kw in (dict(order="fixed"), dict(order="rotated-member"), dict(order="rotated", chunk_mib=20 / 1024)):
        with native.peer_order_as(**kw):
            outs = [_wait(o).cpu() for o in torch.ops.magi.ce_all_gather_coalesced(shards, world, name)]
        res["orders_exact"][str(kw)] = [bool(torch.equal(a, b)) for a, b in zip(outs, refs, strict=True)]
    return res


@needs_gpu_world
def test_native_gathers_exact_and_hand_off():
    for r in run_ranks(_exact, WS, backend="nccl", timeout=300):
        print(r)
        assert r["loaded"] and r["slots"] == 4, r
        assert r["python_submissions_native"] == 0, r  # the C++ kernel served every gather
        assert all(r["single_exact"]) and all(r["coalesced_exact"]), r
        assert all(r["python_exact"]) and r["python_submissions_python"] > 0, r
        assert len(r["orders_exact"]) == 3 and all(all(v) for v in r["orders_exact"].values()), r
        _assert_hand_off_and_order(r)


def _graph(rank, world):
    """A captured gather replays the reads: new window contents show up in the replay."""
    import torch_ce

    dev = _device(rank)
    torch_ce.config.update(cost_mode="default")
    gen = torch.Generator(device=dev).manual_seed(99 + rank + os.getpid() % 1000)
    shards = [torch.randn((256, 128), generator=gen, device=dev),
              torch.randn((1000,), generator=gen, device=dev).to(torch.bfloat16)]
    torch_ce.bind(shards, group=dist.group.WORLD)
    name = dist.group.WORLD.group_name

    def step():
        outs = torch.ops.magi.ce_all_gather_coalesced(shards, world, name)
        return [_wait(o) * 2 for o in outs]

    g, static = _capture(step)
    res = {}
    for trial in range(2):
        with torch.no_grad():  # new contents in place (the windows stay where they are)
            for sh in shards:
                sh.copy_(torch.randn(sh.shape, generator=gen, device=dev).to(sh.dtype))
        torch.cuda.synchronize()
        dist.barrier()  # every rank's new contents are in place before anyone reads
        refs = [_ref(sh) * 2 for sh in shards]
        g.replay()
        torch.cuda.synchronize()
        res[f"replay{trial}_exact"] = [bool(torch.equal(o.cpu(), r)) for o, r in zip(static, refs, strict=True)]
        dist.barrier()  # peers finished reading before the next overwrite
    return res


@needs_gpu_world
def test_native_gather_in_cuda_graph():
    for r in run_ranks(_graph, WS, backend="nccl", timeout=300):
        print(r)
        assert all(r["replay0_exact"]) and all(r["replay1_exact"]), r


def _compiled_cudagraphs(rank, world, cache_root):
    """torch.compile(mode="reduce-overhead") of a SimpleFSDP decoder over the CE transport:
    CUDA-graph trees record and replay it, bit-exact vs the same compile without graphs."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import torch_ce
    from torch_ce.simple_fsdp import build

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, f"r{rank}")
    dev = _device(rank)
    init_device_mesh("cuda", (world,))
    # A fresh group: its first collectives (the bind's agreement and publish barrier, and
    # the calibration) run inside the graph trees' first run, as in a real job.
    mesh = DeviceMesh.from_group(dist.new_group(list(range(world))), "cuda")
    model = build(0, dev, torch.bfloat16, mesh, layers=2, dim=512, ffn=1024, heads=8)
    torch.manual_seed(7)  # same input on every rank
    x = torch.randn(2, 128, 512, device=dev, dtype=torch.bfloat16)
    res = {}
    with torch.no_grad():
        torch_ce.enable(transport="copy_engine")
        # Graphs first: the bind step runs inside the trees' warm-up run.
        counters.clear()
        graphed = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        outs = [graphed(x).clone() for _ in range(3)]  # warm-up (binds), record, replay
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            outs.append(graphed(x).clone())
        torch.cuda.synchronize()
        skips = int(counters["inductor"]["cudagraph_skips"])
        torch._dynamo.reset()
        plain = torch.compile(model, fullgraph=True)(x).clone()
        torch_ce.disable()
    res["cudagraph_skips"] = skips
    res["graph_launches"] = sum(e.name == "cudaGraphLaunch" for e in prof.events())
    res["exact"] = [bool(torch.equal(o, plain)) for o in outs]
    return res


@needs_gpu_world
def test_compiled_ce_with_cuda_graphs(tmp_path):
    for r in run_ranks(_compiled_cudagraphs, WS, str(tmp_path), backend="nccl", timeout=600):
        print(r)
        assert r["cudagraph_skips"] == 0 and r["graph_launches"] >= 1, r
        assert all(r["exact"]), r
