"""A small multi-process runner for torch_ce tests.

    results = run_ranks(fn, world_size, *args, timeout=120, backend="gloo", env=None)

Plus the small helpers every multi-process test file used to define for itself:
``seed_base()`` (a fresh random seed per test run), ``randn(shape, dtype, gen)`` (on the
generator's device: CPU and CUDA tests share it), ``wait(t)`` (``wait_tensor``) and
``all_gather_json(obj, group)`` (every rank's JSON-able value, no numpy; see torch_ce/_net.py).

Starts ``world_size`` fresh processes, never forks of the test's process. On a machine
without a GPU a rank is forked from multiprocessing's forkserver, a clean process that
has imported torch, its distributed package, Dynamo and Inductor and nothing else, never
run an op and never imported torch_ce (it reads its environment at import); the rank
then takes the test process's environment of the moment, as a spawned one would. That
saves the ~6 CPU seconds of imports each of ~200 ranks paid (NOTE [ranks from a
forkserver]). Where a GPU is visible, or with ``TORCH_CE_TEST_START=spawn``, ranks are
spawned. Each child sets ``env``, joins a process group through a TCPStore that this
(the test's) process serves for the whole run, on a port the kernel gave it: no port is
probed free and then bound later, so concurrent pytest-xdist workers never race for one
(for "nccl" it first selects GPU ``rank`` and passes ``device_id``), runs ``fn(rank,
world_size, *args)``, waits at a barrier (peers may still be reading this rank's
windows), then calls ``torch_ce.release_all()`` and destroys the group. ``fn`` must be a
module-level function and its return value picklable; the list of return values comes
back in rank order.

Any rank's exception fails the calling test with that rank's traceback text; a child
that dies without reporting (crash, kill) fails it with its exit code; if the ranks have
not all reported after ``timeout`` seconds every child is killed and the test fails with
"timed out (hang?)", after each child still running has printed every thread's Python
stack to stderr (SIGUSR1, faulthandler). Results travel as plain pickles (tensors are copied, not shared).
"""
from __future__ import annotations

import os
import pickle
import random
import signal
import sys
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp



# torch_ce is imported lazily here: a spawned rank must apply its ``env`` (TORCH_CE_NATIVE,
# TORCH_CE_* config) before torch_ce reads it at import.
def all_gather_json(obj, group=None):
    from torch_ce._net import all_gather_json as _all_gather_json

    return _all_gather_json(obj, group)

# After the first rank fails, how long the others get to report before they are killed
# (they are usually stuck in a collective with the dead rank).
_GRACE_S = 5.0


def seed_base() -> int:
    """A fresh random seed base for one test run (ranks add their rank): every run gathers
    new data, so a gather that only works for some values shows up over time."""
    return random.randrange(1 << 30)


def randn(shape, dtype, gen):
    """Standard normal values drawn with ``gen`` on its device, then cast to ``dtype``."""
    return torch.randn(shape, generator=gen, device=gen.device).to(dtype)


def wait(t):
    """``wait_tensor`` of a magi or functional collective's output (what a graph does)."""
    return torch.ops._c10d_functional.wait_tensor(t)


# NOTE [ranks from a forkserver]
# A spawned rank imports torch, torch.distributed, Dynamo and Inductor before its test
# code runs: ~6 s of one core, ~200 ranks in the default suite, a third of its CPU time on
# the 2-core CI machine. The forkserver imports them once per test process and forks each
# rank from that state. What a rank must not inherit it does not: the server runs no op
# (no thread pool), holds no torch_ce state (torch_ce is imported by the rank, after its
# environment is set), and a rank replaces its environment with the test process's at the
# call (the server's is the one it started with). Where a GPU is visible every rank is
# spawned: torch marks a process's forks unusable for CUDA once it has asked the driver
# anything (``torch.cuda.is_available()`` does, and the server's imports ask), and on a GPU
# machine Dynamo in a forked gloo rank then fails ("Cannot re-initialize CUDA in forked
# subprocess"). On a machine without one, a CUDA build's forked ranks never reach CUDA.
_START = os.environ.get("TORCH_CE_TEST_START", "forkserver")
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
            "torch._inductor.compile_fx"]


def _context():
    if _START == "spawn" or torch.cuda.is_available():  # NCCL ranks included
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call)
    return ctx


def _child(rank, world_size, port, backend, environ, env, fn, args, q):
    import faulthandler

    faulthandler.enable()  # a rank killed by a signal prints its Python stack (stderr)
    # A rank still running at the deadline is sent SIGUSR1 first: it prints every
    # thread's stack (stderr), so a hang names the call it is stuck in.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.clear()  # the test process's environment now, then the test's own
    os.environ.update(environ)
    os.environ.update(env or {})
    try:
        import torch
        import torch.distributed as dist

        kw = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=store, **kw)
        try:
            out = fn(rank, world_size, *args)
            # Peers may still be reading this rank's windows: leave together.
            if backend == "nccl":
                torch.cuda.synchronize()
            dist.barrier()
        finally:
            import torch_ce

            torch_ce.release_all()
            dist.destroy_process_group()
        q.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001  (report everything, including SystemExit)
        q.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world_size, *args, timeout=120, backend="gloo", env=None):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; see module doc."""
    import torch.distributed as dist

    ctx = _context()
    q = ctx.SimpleQueue()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # see module doc
    port = server.port
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, backend, dict(os.environ), env, fn, args, q), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while len(results) + len(errors) < world_size:
            if not q.empty():
                rank, ok, payload = q.get()
                (results if ok else errors)[rank] = payload
                if errors:  # peers of a failed rank usually hang: give them a short grace
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                continue
            if time.monotonic() > deadline:
                timed_out = not errors
                break
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results and r not in errors]
            if dead:
                time.sleep(0.2)  # a report may still be in the pipe
                if q.empty():
                    for r in dead:
                        errors[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting"
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                continue
            time.sleep(0.02)
    finally:
        if timed_out:
            for r, p in enumerate(procs):
                if p.is_alive():
                    print(f"---- rank {r} (pid {p.pid}) still running: its stacks ----", file=sys.stderr, flush=True)
                    os.kill(p.pid, signal.SIGUSR1)
                    time.sleep(1.0)  # let it write its stacks before the next one (and the kill)
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
        del server  # served until every rank is gone
    if errors:
        text = "\n".join(f"---- rank {r} ----\n{errors[r]}" for r in sorted(errors))
        pytest.fail(f"{fn.__name__}: {len(errors)} of {world_size} ranks failed:\n{text}", pytrace=False)
    if timed_out:
        missing = sorted(set(range(world_size)) - set(results))
        pytest.fail(f"{fn.__name__}: timed out (hang?) after {timeout}s; ranks {missing} never finished", pytrace=False)
    return [pickle.loads(results[r]) for r in range(world_size)]


def quiet_warnings() -> None:
    """Silence torch's Future/User warnings inside a rank (they drown the failure text)."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


# NOTE [one gloo collective in flight in the references]
# Torch's functional collectives on gloo can corrupt the heap when two or more are in flight
# at once on a loaded machine (bench/compare/gloo_inflight.py: an abort or a segfault, no
# torch_ce code involved). Inductor's defaults put two in flight in a plain compiled graph:
# ``reorder_for_locality`` hoists each gather up to the previous one's wait, and torch 2.14+'s
# simple overlap moves collectives up and waits down. A reference run compiled that way
# killed a rank of CI's 2.15 leg (SIGABRT in test_uneven_host's plain compiled run, its peers
# then "Connection reset by peer"). ``torch_ce.enable()`` sets both off (passes/install.py),
# so setting them off here as well compiles the references under the same settings as the
# runs they are compared with; only the order of launches and waits changes, never a value.


def keep_one_gloo_collective_in_flight() -> None:
    """Inductor settings that launch each collective after the previous one's wait (NOTE
    [one gloo collective in flight in the references])."""
    import torch._inductor.config as ic

    ic.reorder_for_locality = False
    ado = getattr(ic, "aten_distributed_optimizations", None)
    if ado is not None and hasattr(ado, "enable_simple_overlap"):  # torch 2.14+
        ado.enable_simple_overlap = False


def collectives_in_flight(code: str) -> int:
    """The most ``_c10d_functional`` collectives Inductor's generated code has in flight at
    once (launched, not yet waited): at most 1 on gloo (NOTE [gloo: one functional
    collective in flight] in torch_ce/ops.py; NOTE [one gloo collective in flight in the
    references] above)."""
    import re

    pending, most = set(), 0
    for line in code.splitlines():
        m = re.match(r"\s*(buf\d+) = torch\.ops\._c10d_functional\.\w+\.default\(", line)
        if m:
            pending.add(m.group(1))
            most = max(most, len(pending))
        elif m := re.search(r"_c10d_functional\.wait_tensor\.default\((buf\d+)\)", line):
            pending.discard(m.group(1))
    return most


def setup_compile(cache_root: str, rank: int, fx_cache: bool = False, torch_defaults: bool = False) -> None:
    """Compile settings for a CPU rank: its own absolute Inductor cache dir (ranks never
    share compiled code; torch 2.11 rejects a relative one), one compile thread, one
    intra-op thread, no vector-ISA probe builds (~9 s of g++ per fresh cache dir), one gloo
    collective in flight (unless ``torch_defaults``: a test of what torch_ce changes in
    Inductor's defaults), a fresh dynamo, quiet warnings."""
    import torch
    import torch._inductor.config as ic

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, f"inductor_rank{rank}")
    ic.fx_graph_cache = fx_cache
    ic.compile_threads = 1
    ic.cpp.vec_isa_ok = False
    if not torch_defaults:
        keep_one_gloo_collective_in_flight()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    quiet_warnings()


def reference_all_gather(t, group=None):
    """The backend's own all_gather_into_tensor of the same shard: the reference every
    CE gather is compared with exactly (gloo on CPU, NCCL on GPUs)."""
    import warnings

    import torch.distributed as dist

    out = t.new_empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 2.13 prefers all_gather_single
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


def count_gathers() -> dict:
    """Count the gathers of bound slots by the path that ran them: {"native": n} for the
    Python kernel's hand-backs to the C++ kernel, {"torch": n} for per-peer ``copy_``
    buckets (host transport, opted-in CUDA fallback). The C++ kernel's own gathers pass
    through neither."""
    from torch_ce.runtime import gather, native

    counts = {"native": 0, "torch": 0}
    real_native, real_torch = native.gather_bound, gather.copy_peers

    def native_(*a, **k):
        counts["native"] += 1
        return real_native(*a, **k)

    def torch_(*a, **k):
        counts["torch"] += 1
        return real_torch(*a, **k)

    native.gather_bound, gather.copy_peers = native_, torch_
    return counts


# ---------------------------------------------------------------------------------------
# SimpleFSDP-style models for compiled tests
# ---------------------------------------------------------------------------------------


def fsdp_every_param(module, mesh):
    """Every parameter of ``module``: a Shard(0) DTensor behind SimpleFSDP's
    parametrization (``torch_ce.simple_fsdp.shard_param``, the one helper; no grads)."""
    from torch_ce.simple_fsdp import shard_param

    for mod in list(module.modules()):
        for pname, _ in list(mod.named_parameters(recurse=False)):
            shard_param(mod, pname, mesh)
    return module


class TitanEmbedding(torch.nn.Embedding):
    """torchtitan's models/common/embedding.py: the parametrized weight is read twice."""

    def forward(self, t):
        from torch.distributed.tensor import DTensor

        w = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        return torch.nn.functional.embedding(t, w)
