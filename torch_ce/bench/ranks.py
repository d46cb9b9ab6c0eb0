"""Launching bench ranks and small exchanges between them.

    spawn_ranks(fn, nprocs, *args)   run ``fn(rank, world, *args)`` once per GPU (or under
                                     torchrun: once, in this process)
    device(), is_cuda()              this rank's benchmark device
    status_group(), exchange(obj)    a gloo group and a JSON all-gather over it, for
                                     per-variant failures and budget decisions
    agree_errors(err)                every rank's failure text, the same on all ranks

Split from common.py (timing, results on disk, tables), which uses ``device()``.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Callable

from torch_ce._net import all_gather_json, free_port

# Set in each rank by ``spawn_ranks`` (the device this rank benchmarks on).
_device = None


# ---------------------------------------------------------------------------------------
# Launching ranks
# ---------------------------------------------------------------------------------------


def device():
    """This rank's benchmark device (cuda:<local rank>, or cpu for smoke runs)."""
    import torch

    return _device if _device is not None else torch.device("cpu")


def is_cuda() -> bool:
    return device().type == "cuda"


def _init_rank(rank_: int, world: int, backend: str, init_method: str | None) -> None:
    global _device
    import torch
    import torch.distributed as dist

    kw: dict[str, Any] = {}
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank_ % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        _device = torch.device("cuda", local)
        kw["device_id"] = _device
    else:
        _device = torch.device("cpu")
    if init_method is not None:
        kw.update(init_method=init_method, rank=rank_, world_size=world)
    dist.init_process_group(backend, **kw)


def _teardown() -> None:
    import torch.distributed as dist

    try:
        import torch_ce

        torch_ce.release_all()
    except Exception:
        pass
    if dist.is_initialized():
        try:
            dist.barrier()
        except Exception:
            pass
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _child(rank_, world, port, backend, fn, args, q):
    os.environ.update(RANK=str(rank_), LOCAL_RANK=str(rank_), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        _init_rank(rank_, world, backend, f"tcp://127.0.0.1:{port}")
        fn(rank_, world, *args)
    except BaseException:  # noqa: BLE001  (report everything, then leave without cleanup)
        tb = traceback.format_exc()
        print(f"[rank {rank_}] FAILED:\n{tb}", file=sys.stderr, flush=True)
        try:
            q.put((rank_, False, tb[-4000:]))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # a peer may be stuck in a collective with us: do not try to tear down
    q.put((rank_, True, None))
    _teardown()


def default_nprocs(backend: str) -> int:
    if backend == "nccl":
        import torch

        return torch.cuda.device_count()
    return 2


def spawn_ranks(fn: Callable, nprocs: int | None, *args: Any, backend: str | None = None,
                timeout_s: float | None = None) -> int:
    """Run ``fn(rank, world, *args)`` in ``nprocs`` processes (one per GPU); 0 if all passed.

    Under torchrun (``RANK`` and ``WORLD_SIZE`` set) this process is one rank: it joins the
    group (env://) and calls ``fn`` itself. Otherwise it spawns the ranks (``spawn``
    start method), each joining over TCP on a free local port with
    ``init_process_group("nccl", device_id=cuda:<rank>)``. ``fn`` must be a module-level
    function. A rank that fails gets the others killed after a short grace (they are
    usually stuck in a collective with it); after ``timeout_s`` every rank is killed.
    """
    backend = backend or "nccl"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank_, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _init_rank(rank_, world, backend, None)
        try:
            fn(rank_, world, *args)
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        _teardown()
        return 0

    import torch.multiprocessing as mp

    nprocs = nprocs or default_nprocs(backend)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, nprocs, port, backend, fn, args, q))
             for r in range(nprocs)]
    for p in procs:
        p.start()
    done: dict[int, bool] = {}
    t0 = time.monotonic()
    deadline = t0 + timeout_s if timeout_s else float("inf")
    exit_grace = None  # after every rank reported: time left for a clean exit
    rc = 0
    try:
        while True:
            while not q.empty():
                r, ok, _tb = q.get()
                done[r] = ok
                if not ok:
                    rc = 1
                    deadline = min(deadline, time.monotonic() + 10.0)
            if len(done) == nprocs and exit_grace is None:
                exit_grace = time.monotonic() + 60.0
            if all(p.exitcode is not None for p in procs):
                break
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in done]
            if dead:
                time.sleep(0.3)  # a report may still be in the pipe
                if q.empty():
                    for r in dead:
                        if r not in done:
                            print(f"torch-ce bench: rank {r} exited with code "
                                  f"{procs[r].exitcode} without reporting", flush=True)
                            done[r] = False
                    rc = 1
                    deadline = min(deadline, time.monotonic() + 10.0)
                continue
            now = time.monotonic()
            if exit_grace is not None and now > exit_grace:
                print("torch-ce bench: ranks finished but did not exit; killing them", flush=True)
                break
            if now > deadline:
                if rc == 0:
                    print(f"torch-ce bench: TIMEOUT after {now - t0:.0f} s (limit {timeout_s} s); "
                          f"killing the ranks (results written so far are kept)", flush=True)
                    rc = 3
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
    if rc == 0 and not all(done.get(r, False) for r in range(nprocs)):
        rc = 1
    return rc


def too_few_ranks(prog: str, backend: str, nprocs: int | None) -> str | None:
    """Why the bench cannot run on the ranks it would get, in one line (None: it can).
    A gather needs a peer: one rank would time nothing and write empty results."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
    else:
        world = nprocs or default_nprocs(backend)
    if world >= 2:
        return None
    if backend == "nccl" and not nprocs and "WORLD_SIZE" not in os.environ:
        return (f"{prog}: needs 2 or more GPUs, found {world} "
                f"(--device cpu runs a smoke test on 2 CPU ranks)")
    return f"{prog}: needs 2 or more ranks, got {world}"


def launch(prog: str, worker: Callable, args, banner: str = "") -> int:
    """Run a bench's ``worker(rank, world, vars(args))`` on the ranks its common arguments
    ask for (``--device``: NCCL or gloo, ``--nprocs``, ``--timeout``); the exit code
    (2, with one line on stderr and nothing written, on fewer than 2 ranks). ``banner``
    is printed once the ranks are known to suffice."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    why = too_few_ranks(prog, backend, args.nprocs)
    if why is not None:
        print(why, file=sys.stderr, flush=True)
        return 2
    if banner:
        print(f"{prog}: {banner}", flush=True)
    t0 = time.monotonic()
    rc = spawn_ranks(worker, args.nprocs, vars(args), backend=backend, timeout_s=args.timeout)
    print(f"{prog}: done in {time.monotonic() - t0:.0f} s (exit code {rc})", flush=True)
    return rc


# ---------------------------------------------------------------------------------------
# Status exchange between ranks (per-variant failures, budget decisions)
# ---------------------------------------------------------------------------------------


def status_group(timeout_s: float = 180.0):
    """A gloo group over all ranks for small Python-object exchanges (never NCCL-blocked)."""
    import datetime as _dt

    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=timeout_s))


def exchange(obj: Any, group=None) -> list:
    """Every rank's ``obj``, in rank order, over ``group`` (``all_gather_json``: JSON, no
    pickle, no numpy; tuples come back as lists)."""
    return all_gather_json(obj, group)


def agree_errors(err: str | None, group=None) -> str | None:
    """None if no rank failed, else the failures of all ranks as one string (same on all)."""
    errs = exchange(err, group)
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if not bad:
        return None
    return "\n".join(f"[rank {r}] {e}" for r, e in bad)
