"""The C++ kernels of the magi gathers (csrc/ce_gather.cu, NOTE [native gather path]).

Loaded once, at import of ``torch_ce.ops``, when the library was built (a CUDA build of
torch at install; nvcc or the host compiler, NOTE [building without nvcc] in
runtime/toolchain.py) and ``TORCH_CE_NATIVE`` is not 0. Loaded, they are the one CUDA
gather: ``magi::ce_all_gather[_coalesced]`` on CUDA, and the bound members of whatever
bucket they hand to the Python kernel (``gather_bound``). Their slot index mirrors the
registry of ``windows.py``, whose ``register`` and ``window_pools.release_all`` alone
write it. This module wraps the library and nothing else: which kernel serves a gather
(the row gather's CUDA, Triton or pure-torch path, ``gather.row_path``) is chosen in
runtime/gather.py, and it imports no other run-time module but ``toolchain`` and
``eligibility`` (test/test_layout.py).

# NOTE [experiment knobs]
The variables below are not configuration: they exist for A/B runs. They are read here
only, once, when the kernels load (``knobs()``), validated (a bad value raises then), and
pushed to C++; the hot path reads atomics, never the environment. A run changes them with
the scoped ``peer_order_as`` / ``split_local_copy_as``, which restore what was set before.

  TORCH_CE_NATIVE           0: leave the C++ kernels unloaded
  TORCH_CE_PEER_ORDER       the order of a gather's peer reads (NOTE [peer order] in
                            csrc/ce_copy.h): rotated (default) | rotated-member | fixed
                            (every rank reads rank 0 first); kept until four GPUs measured it
  TORCH_CE_PEER_CHUNK_MIB   0 (default: whole slabs) or the piece size of the chunked
                            interleave, rounded down to 512 bytes

The pure-torch fallback follows the rotation (``gather.copy_peers``), not the chunking.

Not loaded, CUDA weights stay on the collective (``kernel_refusal`` refuses them at bind,
with one loud warning that names the command that builds the kernels) unless
``config.cuda_torch_fallback`` opts in to per-peer ``copy_`` (runtime/gather.py). CPU
weights need nothing compiled: the host transport's memcpy is their kernel.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import math
import os
import sys
import threading
import warnings

import torch

from . import toolchain
from .eligibility import Reason, Refusal, refusal

log = logging.getLogger("torch_ce")

_state: list = []  # [loaded: bool, why not: str] once decided
# Device types whose gather kernel counts as missing, inside ``kernels_unavailable``.
_unavailable: list[str] = []
_warned: set[str] = set()
_warn_lock = threading.Lock()
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def library_path() -> str | None:
    found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ce_torch*.so")))
    return found[0] if found else None


def build_command() -> str:
    """The one command that builds the C++ kernels for this interpreter and torch."""
    try:
        return toolchain.build_command(torch, _PACKAGE)
    except Exception as e:  # noqa: BLE001 (a warning's hint must not raise)
        return (f"{toolchain.sys.executable} -m pip install --no-build-isolation --no-deps -e "
                f"<the torch_ce source tree> ({type(e).__name__} while looking for CUDA headers: {e})")


@contextlib.contextmanager
def kernels_unavailable(*device_types: str):
    """Test hook: inside, the gather kernels of ``device_types`` count as missing (``"cpu"``
    lets a CPU test take the path a CUDA job without the C++ kernels takes)."""
    _unavailable.extend(device_types)
    try:
        yield
    finally:
        for d in device_types:
            _unavailable.remove(d)


# NOTE [peer order] in csrc/ce_copy.h: name -> the C++ enum PeerOrder.
PEER_ORDERS = {"fixed": 0, "rotated": 1, "rotated-member": 2}
_knobs: dict = {}  # NOTE [experiment knobs]: read once
_now: dict = {}  # what the gathers use now: "order", "chunk_bytes", "split_local"


def chunk_bytes(mib: float) -> int:
    """``mib`` MiB as a piece size: whole 512-byte multiples (slot alignment, the copy
    engines' best), at least 512; 0 stays 0 (off)."""
    if not (isinstance(mib, (int, float)) and math.isfinite(mib) and mib >= 0):
        raise ValueError(f"torch_ce: peer chunk must be a finite number of MiB >= 0, got {mib!r}")
    return 0 if mib == 0 else max(512, int(mib * 2**20) // 512 * 512)


def read_knobs(environ=None) -> dict:
    """NOTE [experiment knobs] from ``environ`` (default: the process environment),
    validated: native (bool), order (a PEER_ORDERS name), chunk_bytes."""
    environ = os.environ if environ is None else environ
    native = environ.get("TORCH_CE_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")
    order = environ.get("TORCH_CE_PEER_ORDER", "").strip().lower() or "rotated"
    if order not in PEER_ORDERS:
        raise ValueError(f"torch_ce: TORCH_CE_PEER_ORDER={order!r}: expected one of {sorted(PEER_ORDERS)}")
    raw = environ.get("TORCH_CE_PEER_CHUNK_MIB", "").strip() or "0"
    try:
        chunk = chunk_bytes(float(raw))
    except ValueError:
        raise ValueError(f"torch_ce: TORCH_CE_PEER_CHUNK_MIB={raw!r}: expected a number of "
                         "MiB >= 0") from None
    return dict(native=native, order=order, chunk_bytes=chunk)


def knobs() -> dict:
    """The experiment knobs, read from the environment on the first call only."""
    if not _knobs:
        _knobs.update(read_knobs())
        _now.update(order=_knobs["order"], chunk_bytes=_knobs["chunk_bytes"], split_local=True)
    return _knobs


def peer_order() -> tuple[str, int]:
    """(order name, chunk bytes) of the gathers' peer reads now."""
    knobs()
    return _now["order"], _now["chunk_bytes"]


@contextlib.contextmanager
def peer_order_as(order: str | None = None, chunk_mib: float | None = None):
    """Gathers issued inside use this peer-read order and/or chunk (None: keep); the
    previous setting comes back on exit (A/B runs: bench ops, bench e2e)."""
    prev = peer_order()
    if order is not None and order not in PEER_ORDERS:
        raise ValueError(f"torch_ce: peer order {order!r}: expected one of {sorted(PEER_ORDERS)}")
    _now.update(order=prev[0] if order is None else order,
                chunk_bytes=prev[1] if chunk_mib is None else chunk_bytes(chunk_mib))
    _push()
    try:
        yield
    finally:
        _now.update(order=prev[0], chunk_bytes=prev[1])
        _push()


def _push() -> None:
    """What the gathers use now, into the C++ atomics."""
    knobs()
    if loaded():
        torch.ops.torch_ce_native.set_peer_order(PEER_ORDERS[_now["order"]], _now["chunk_bytes"])
        torch.ops.torch_ce_native.set_split_local_copy(bool(_now["split_local"]))


def load() -> bool:
    """Load the C++ kernels once; False (the reason kept for ``kernel_refusal``) when they
    cannot serve. Reads NOTE [experiment knobs] (a bad value raises here, loudly)."""
    if _state:
        return _state[0]
    ok, why = False, ""
    if not knobs()["native"]:
        why = "TORCH_CE_NATIVE=0"
    elif torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU build"
    elif library_path() is None:
        why = "csrc/ce_ops.cu was not built"
    else:
        try:
            torch.ops.load_library(library_path())
            ok = True
        except (OSError, RuntimeError) as e:
            why = f"cannot load {library_path()}: {e}"
    if not ok:
        log.debug("torch_ce: C++ gather kernels not in use: %s", why)
    _state[:] = [ok, why]
    _push()
    return ok


def loaded() -> bool:
    return bool(_state and _state[0])


def _missing(device_type: str) -> str | None:
    """Why ``device_type`` has no gather kernel here (None: it has one)."""
    if device_type in _unavailable:
        return f"disabled for {device_type!r} by native.kernels_unavailable (a test hook)"
    if device_type == "cuda" and not load():
        return _state[1]
    return None


def kernel_refusal(device_type: str, warn: bool = True) -> Refusal | None:
    """Why a ``device_type`` shard must stay on the collective for want of a gather kernel
    (None: a kernel serves it). Without the C++ kernels a CUDA gather would be per-peer
    ``copy_`` calls (slower than NCCL), so they are refused unless
    ``config.cuda_torch_fallback`` opts in; the first such refusal warns, loudly, once
    (``warn=False``: never, for a caller that only describes, as ``gather.kernel_path``)."""
    why = _refusal(device_type)
    if warn and why is not None and why.code == Reason.NO_GATHER_KERNEL:
        _warn_once(device_type, _missing(device_type))
    return why


def _refusal(device_type: str) -> Refusal | None:
    from ..config import config

    if device_type == "cuda" and not torch.cuda.is_available():
        return refusal(Reason.CUDA_UNAVAILABLE, "CUDA unavailable")
    why = _missing(device_type)
    if why is None or (device_type == "cuda" and config.cuda_torch_fallback):
        return None
    return refusal(Reason.NO_GATHER_KERNEL,
                   f"no {device_type} gather kernel ({why}): stays on the collective")


def _warn_once(device_type: str, why: str) -> None:
    with _warn_lock:
        if device_type in _warned:
            return
        _warned.add(device_type)
    msg = (f"torch_ce: transport='copy_engine' but the C++ gather kernels (csrc/ce_ops.cu) "
           f"are not available: {why}. Every {device_type} weight gather stays on the "
           f"collective backend (NCCL); nothing runs on the copy engines. To build them: "
           f"{build_command()}. "
           "To use the slow pure-torch fallback (per-peer copy_, slower than NCCL) instead: "
           "TORCH_CE_CUDA_TORCH_FALLBACK=1 or torch_ce.config.update(cuda_torch_fallback=True).")
    log.warning("%s", msg)
    warnings.warn(msg, stacklevel=3)


def build_info() -> tuple[str, str, str]:
    """(compiler, CUDA header version "13.0", row kernel "cuda" | "none") of the loaded
    library."""
    try:
        tool, version, rows = str(torch.ops.torch_ce_native.build_info()).split(";")
    except (AttributeError, RuntimeError):  # a library built before it said so: nvcc's
        return "nvcc", "?", "cuda"
    v = int(version)
    return tool, f"{v // 1000}.{v % 1000 // 10}", rows


def register_slot(slot) -> None:
    """Mirror a published CUDA slot into the C++ index, keyed by this rank's address.
    Called by ``windows.register`` only."""
    w = slot.window
    key = int(slot.peer_ptrs[w.rank])
    torch.ops.torch_ce_native.register_slot(
        key, [int(p) for p in slot.peer_ptrs], w.rank, slot.nbytes,
        slot.dtype, list(slot.shape), w.group.group_name)
    if slot.watch is not None:
        watch_slot(slot)


def watch_slot(slot) -> None:
    """Mirror ``slot.watch`` (NOTE [the version net] in versions.py) into the C++ index:
    the C++ gather checks the same counters and hands a stale bucket to Python."""
    w = slot.watch
    live = [t for t in (r() for r in w.refs) if t is not None]
    torch.ops.torch_ce_native.watch_slot(int(slot.peer_ptrs[slot.window.rank]), live, bool(w.poison))


def unregister(key: int) -> None:
    """Drop the C++ index's entry at ``key`` (``windows.register`` replaced it)."""
    if loaded():
        torch.ops.torch_ce_native.unregister_slot(int(key))


def clear() -> None:
    if loaded():
        torch.ops.torch_ce_native.clear_slots()


def slot_count() -> int:
    return int(torch.ops.torch_ce_native.slot_count()) if loaded() else 0


def gather_bound(shards: list[torch.Tensor], group_size: int) -> list[torch.Tensor]:
    """The C++ gather of bound CUDA shards, for the buckets the Python kernel handled."""
    return torch.ops.torch_ce_native.gather_bound(list(shards), group_size)


def gather_rows(shard: torch.Tensor, ids: torch.Tensor, group_size: int) -> torch.Tensor:
    """The CUDA row kernel's gather of a bound CUDA shard (NOTE [row kernel] in
    csrc/ce_rows.cu; a library built without nvcc raises: ``gather.gather_rows`` chooses)."""
    return torch.ops.torch_ce_native.gather_rows(shard, ids, group_size)


def gather_bound_dim(shards: list[torch.Tensor], group_size: int, dims: list[int]) -> list[torch.Tensor]:
    """The C++ strided gather of bound CUDA Shard(d) shards, one gather dim per member
    (NOTE [strided reads] in csrc/ce_copy.h; ``gather.gather_slot_dim`` chooses)."""
    return torch.ops.torch_ce_native.gather_bound_dim(list(shards), group_size, [int(d) for d in dims])


def dim_strategy() -> int:
    """The C++ enum DimStrategy the Shard(d) gathers submit with now (loaded kernels only;
    ``gather.DIM_STRATEGIES`` names the values)."""
    return int(torch.ops.torch_ce_native.dim_strategy())


def set_dim_strategy(strategy: int) -> None:
    """Set it (the C++ side refuses an unknown value); ``gather.dim_strategy_as`` is the
    scoped switch."""
    torch.ops.torch_ce_native.set_dim_strategy(int(strategy))


def set_split_local_copy(split: bool) -> None:
    """Copy this rank's own rows on a second copy stream (default) or inside the peer batch."""
    knobs()
    _now["split_local"] = bool(split)
    _push()


def split_local_copy() -> bool:
    """Whether gathers copy this rank's own rows on the second copy stream now."""
    knobs()
    return bool(_now["split_local"])


@contextlib.contextmanager
def split_local_copy_as(split: bool):
    """Gathers issued inside copy this rank's own rows on the second copy stream (True, the
    default) or inside the peer batch (False); the previous setting comes back on exit
    (A/B runs: bench ops' ce1_inbatch, bench e2e's ce_inbatch)."""
    prev = split_local_copy()
    set_split_local_copy(split)
    try:
        yield
    finally:
        set_split_local_copy(prev)


def set_prefetch_pending(pending: bool) -> None:
    """While prefetched outputs are parked, hand every bucket to the Python kernel, which
    knows the park (NOTE [cross-call prefetch] in prefetch.py)."""
    if loaded():
        torch.ops.torch_ce_native.set_prefetch_pending(bool(pending))


def has_stream_flags() -> bool:
    """Whether the loaded library has the stream flag ops (NOTE [stream flags] in
    csrc/ce_flags.cu): what the CUDA reduce-scatter signals and waits with."""
    return load() and hasattr(torch.ops.torch_ce_native, "stream_wait_value32")


def stream_wait_value32(addr: int, value: int) -> None:
    """The current stream waits until the 32-bit word at ``addr`` equals ``value``."""
    torch.ops.torch_ce_native.stream_wait_value32(int(addr), int(value))


def stream_write_value32(addr: int, value: int) -> None:
    """The current stream writes ``value`` to the 32-bit word at ``addr``, after its work."""
    torch.ops.torch_ce_native.stream_write_value32(int(addr), int(value))


def stream_flags_info() -> list[int]:
    """[CAN_USE_STREAM_MEM_OPS_V1, CAN_FLUSH_REMOTE_WRITES, the flags the waits use] of
    the current device (NOTE [stream flags])."""
    return list(torch.ops.torch_ce_native.stream_flags_info())


def host_write_words(addr: int, value: int, count: int, width: int, method: int) -> int:
    """``count`` words of ``width`` bytes at ``addr`` set to ``value`` from the host, on the
    library's own non-blocking stream, not waited for: how the reduce-scatter watchdog
    releases a stream wait whose writer is gone (NOTE [reduce-scatter watchdog]).
    Returns the CUresult."""
    return int(torch.ops.torch_ce_native.host_write_words(int(addr), int(value), int(count), int(width),
                                                          int(method)))


def host_register(addr: int, nbytes: int) -> int:
    """Page-locks and maps ``nbytes`` of host memory at ``addr`` for the device
    (cudaHostRegister): its device address (NOTE [poison word] in csrc/ce_flags.cu)."""
    return int(torch.ops.torch_ce_native.host_register(int(addr), int(nbytes)))


def host_unregister(addr: int) -> None:
    torch.ops.torch_ce_native.host_unregister(int(addr))


# NOTE [native reduce-scatter path] in csrc/ce_reduce_scatter.cu: the reduce-scatter's launch and
# completion in C++ (``config.rs_native``); runtime/reduce_scatter/launch.py decides when.
RS_OPS = {"sum": 0, "avg": 1}
RS_PREMUL = 2


_RAW: dict = {}


def _raw(name: str):
    """The library op ``name`` called as the builtin torch.ops wraps: no Python-level
    checks per call (host microseconds each). Eager calls only: nothing traces
    these."""
    f = _RAW.get(name)
    if f is None:
        packet = getattr(torch.ops.torch_ce_native, name)
        f = _RAW[name] = getattr(packet, "_op", packet)
    return f


def rs_timing(mode: int = 0) -> list:
    """The C++ launch's and completion's host seconds per piece (csrc/ce_reduce_scatter.cu rs_timing):
    0 read, 1 reset and on, 2 off. A probe (bench/compare/rs_host_breakdown.py)."""
    return list(torch.ops.torch_ce_native.rs_timing(int(mode)))


def rs_memop_batching(mode: int = 0) -> bool:
    """The native reduce-scatter's flag operations as cuStreamBatchMemOp batches (the
    default) or one driver call each: 0 read, 1 batches, 2 single calls (an A/B knob for
    bench/compare/rs_host_breakdown.py). Returns whether batches are on."""
    return bool(torch.ops.torch_ce_native.rs_memop_batching(int(mode)))


def rs_reduce_tuning(batch: int = 0, even: bool = False) -> list:
    """The reduction kernel's A/B knob (csrc/ce_reduce.h ``set_tuning``): ``batch`` 0 reads,
    1 or 4 sources' loads in flight per thread (-1, the default: 4 for fp32, 1 for bf16),
    ``even`` the grid spread over its rounds (the default: the block cap). Returns [batch,
    even] now ([] without the CUDA kernel)."""
    return list(torch.ops.torch_ce_native.rs_reduce_tuning(int(batch), int(bool(even))))


def has_rs_native() -> bool:
    """Whether the loaded library has the native reduce-scatter launch and completion."""
    if not _HAS_RS:
        _HAS_RS.append(load() and hasattr(torch.ops.torch_ce_native, "rs_launch"))
    return _HAS_RS[0]


_HAS_RS: list = []  # has_rs_native's answer, once (the library loads once per process)


def rs_has_kernel() -> bool:
    """Whether it has the CUDA reduction kernel (an nvcc build); else its completion calls
    ``torch_ce::rs_reduce_fallback`` (the Triton kernel,
    runtime/reduce_scatter/reduce_triton.py)."""
    return has_rs_native() and bool(torch.ops.torch_ce_native.rs_has_kernel())


def relax_thread_capture_mode() -> bool:
    """This thread's CUDA stream-capture mode set to relaxed (the watchdog's: its event
    queries must not invalidate a global-mode capture in another thread); False where the
    library lacks it."""
    if not (load() and hasattr(torch.ops.torch_ce_native, "relax_thread_capture_mode")):
        return False
    torch.ops.torch_ce_native.relax_thread_capture_mode()
    return True


def has_peer_copy_into() -> bool:
    """Whether the loaded library has ``peer_copy_into`` (FSDP2's all-gather hook)."""
    return load() and hasattr(torch.ops.torch_ce_native, "peer_copy_into")


def peer_copy_into(out: torch.Tensor, srcs: list, rows: list) -> None:
    """``srcs[i]`` into row ``rows[i]`` of ``out`` on the copy stream, ordered after and
    before the current stream (csrc/ce_gather.cu)."""
    torch.ops.torch_ce_native.peer_copy_into(out, srcs, rows)


def has_step_gather() -> bool:
    """Whether the loaded library has ``step_gather`` (FSDP2's training gathers on CUDA)."""
    return load() and hasattr(torch.ops.torch_ce_native, "step_gather")


def step_group(srcs: list, rows: list, peer_ready: list, peer_done: list, my_ready: int, my_done: int) -> int:
    """A training group's peer buffers and word addresses registered with the C++ side:
    its id for ``step_gather`` (NOTE [FSDP2 step words on CUDA] in csrc/ce_flags.cu)."""
    return int(torch.ops.torch_ce_native.step_group(srcs, rows, peer_ready, peer_done, my_ready, my_done))


def step_forget(group: int) -> None:
    torch.ops.torch_ce_native.step_forget(int(group))


def step_gather_op():
    """``step_gather(out, input, buffer, group, call)``'s overload itself, for a caller that
    binds it once (the packet's dispatch costs about a microsecond per call)."""
    return torch.ops.torch_ce_native.step_gather.default


class Handle:
    """A C++ reduce-scatter workspace or call, held by its integer id (csrc/ce_reduce_scatter.cu
    "Handles": a custom-class object costs ~15 us to pass through an op call); the C++
    side forgets it when this, its last Python reference, goes."""

    __slots__ = ("id",)

    def __init__(self, id_: int):
        self.id = id_

    def __del__(self):
        if sys.is_finalizing() and threading.current_thread() is not threading.main_thread():
            return  # a thread finalization would end inside the op (it runs without the GIL)
        try:
            _raw("rs_forget")(self.id)
        except Exception:  # noqa: BLE001 (interpreter teardown: the library may be gone)
            pass


def rs_handle_count() -> int:
    """C++ workspaces and calls still held by a Handle (a leak check for the tests)."""
    return int(_raw("rs_handle_count")())


def rs_workspace(addrs: list[int], world: int, index: int, cap: int, dtype: torch.dtype, device: int,
                 copy_stream: int, reduce_stream: int) -> Handle:
    """The C++ view of a workspace: its address tables (NOTE [native reduce-scatter path])."""
    return Handle(torch.ops.torch_ce_native.rs_workspace([int(a) for a in addrs], int(world), int(index), int(cap),
                                                         dtype, int(device), int(copy_stream), int(reduce_stream)))


def rs_launch(ws: Handle, inputs, outs, half: int, seq: int, numel: int, tag: int, op: int, factor: float,
              register_work: bool):
    """Step 1 of a call in C++: (the call's Handle, its outputs)."""
    cid, outs = _raw("rs_launch")(ws.id, inputs, outs, half, seq, numel, tag, op, factor, register_work)
    return Handle(cid), outs


def rs_complete(call: Handle, wait_current: bool) -> None:
    """Steps 2-4 in C++, once; ``wait_current``: the current stream then waits for them."""
    _raw("rs_complete")(call.id, wait_current)


def rs_stream_wait(call: Handle, stream: int) -> None:
    """The stream (a ``cuda_stream`` integer) waits for the call's completion (enqueued first)."""
    _raw("rs_stream_wait")(call.id, int(stream))


def rs_query(call: Handle) -> int:
    """0 launched, 1 completion being enqueued, 2 its done event recorded, 3 done."""
    return int(_raw("rs_query")(call.id))


def rs_stages(calls: list) -> list:
    """``rs_query`` of several calls in one op call (the watchdog's tick); 1 for a call the
    library does not know."""
    return list(_raw("rs_stages")([c.id for c in calls]))


def rs_register(call: Handle) -> None:
    """The call's c10d work on its outputs (their ``wait_tensor`` completes it)."""
    _raw("rs_register")(call.id)
