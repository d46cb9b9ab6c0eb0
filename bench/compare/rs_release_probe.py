"""Issue 46 probe: what releases a GPU stream that is blocked in cuStreamWaitValue32 on a
device word, from the host, when the peer that should write the word is gone; and what the
device says about flushing remote writes before a wait.

    python3 bench/compare/rs_release_probe.py            every method, each in a subprocess
                                                         with a hard timeout, with and without
                                                         CUDA_DEVICE_MAX_CONNECTIONS=1
    python3 bench/compare/rs_release_probe.py METHOD     one method, in this process

Scenario (what a dead peer leaves): a non-blocking torch stream S waits (EQ 7) on a word of
device memory, a kernel is queued behind the wait on S, the legacy default stream waits on
an event after it (a consumer's ``wait_tensor``) and queues a kernel, 12 more streams each
hold a kernel (so the 8 default hardware queues are all in use), and the main thread sits
in ``torch.cuda.synchronize()``. After 0.5 s a host thread writes 7 by METHOD. A method
releases when the main thread's synchronize returns; one that does not, hangs until the
parent's timeout. Driver calls go through ctypes on libcuda (no build needed).
"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import threading
import time

METHODS = ["host_mapped_store", "memcpy_htod_pinned", "memset_d32", "memset_async_own_stream",
           "write_value_own_stream"]


def _attrs(cu, dev) -> dict:
    want = ["CAN_USE_STREAM_MEM_OPS_V1", "CAN_USE_64_BIT_STREAM_MEM_OPS_V1",
            "CAN_USE_STREAM_WAIT_VALUE_NOR_V1", "CAN_FLUSH_REMOTE_WRITES", "CAN_USE_STREAM_MEM_OPS",
            "CAN_USE_64_BIT_STREAM_MEM_OPS", "CAN_USE_STREAM_WAIT_VALUE_NOR"]
    nums = {}
    for h in ("/usr/local/cuda/include/cuda.h", "/usr/local/cuda/targets/x86_64-linux/include/cuda.h"):
        if os.path.exists(h):
            text = open(h).read()
            for w in want:
                m = re.search(rf"CU_DEVICE_ATTRIBUTE_{w}\s*=\s*(\d+)", text)
                if m:
                    nums[w] = int(m.group(1))
            break
    out = {}
    for w, n in nums.items():
        v = ctypes.c_int(-1)
        rc = cu.cuDeviceGetAttribute(ctypes.byref(v), n, dev)
        out[f"{w}({n})"] = v.value if rc == 0 else f"rc={rc}"
    return out


def one(method: str, consumer: bool = True) -> None:
    import torch

    cu = ctypes.CDLL("libcuda.so.1")
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    dev = ctypes.c_int()
    cu.cuCtxGetDevice(ctypes.byref(dev))
    ctx = ctypes.c_void_p()
    cu.cuCtxGetCurrent(ctypes.byref(ctx))
    if method == "attrs":
        print("ATTRS", _attrs(cu, dev.value), flush=True)
        return
    wait = getattr(cu, "cuStreamWaitValue32_v2", None) or cu.cuStreamWaitValue32
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    if method == "host_mapped_store":
        word = torch.zeros(16, dtype=torch.int32, pin_memory=True)  # UVA: the device pointer is the host's
    else:
        word = torch.zeros(16, dtype=torch.int32, device="cuda")
    addr = word.data_ptr()
    s = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    others = [torch.cuda.Stream() for _ in range(12)]
    # Load every kernel first: with lazy module loading (CUDA's default) the first launch of
    # a kernel behind a blocked wait blocks the launching host thread (the first probe run
    # hung there, before any method ran).
    x.add_(1)
    _ = x * 2
    torch.ones(1024, device="cuda").mul_(3)
    x.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        rc = wait(ctypes.c_void_p(s.cuda_stream), addr, 7, 1)  # EQ
        assert rc == 0, rc
        x.add_(1)
        ev = torch.cuda.Event()
        ev.record()
    if consumer:
        torch.cuda.current_stream().wait_event(ev)
    y = x * 2
    for o in others:
        with torch.cuda.stream(o):
            torch.ones(1024, device="cuda").mul_(3)
    print(f"{method}: queued; stream blocked: {not ev.query()}; attrs {_attrs(cu, dev.value) if method == 'host_mapped_store' else ''}", flush=True)
    done = {}

    def release():
        time.sleep(0.5)
        cu.cuCtxSetCurrent(ctx)
        t0 = time.monotonic()
        if method == "memcpy_htod_pinned":
            src = torch.full((1,), 7, dtype=torch.int32, pin_memory=True)
            rc = cu.cuMemcpyHtoD_v2(ctypes.c_uint64(addr), ctypes.c_void_p(src.data_ptr()), ctypes.c_size_t(4))
        elif method == "memcpy_htod_pageable":
            src = ctypes.c_uint32(7)
            rc = cu.cuMemcpyHtoD_v2(ctypes.c_uint64(addr), ctypes.byref(src), ctypes.c_size_t(4))
        elif method == "memset_d32":
            rc = cu.cuMemsetD32_v2(ctypes.c_uint64(addr), ctypes.c_uint(7), ctypes.c_size_t(1))
        elif method in ("memset_async_own_stream", "write_value_own_stream", "memcpy_async_own_stream",
                        "memset_async_hiprio_stream"):
            st = ctypes.c_void_p()
            if method == "memset_async_hiprio_stream":
                lo, hi = ctypes.c_int(), ctypes.c_int()
                cu.cuCtxGetStreamPriorityRange(ctypes.byref(lo), ctypes.byref(hi))
                cu.cuStreamCreateWithPriority(ctypes.byref(st), 1, hi)
            else:
                cu.cuStreamCreate(ctypes.byref(st), 1)  # CU_STREAM_NON_BLOCKING
            if method == "write_value_own_stream":
                wv = getattr(cu, "cuStreamWriteValue32_v2", None) or cu.cuStreamWriteValue32
                wv.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                rc = wv(st, addr, 7, 0)
            elif method == "memcpy_async_own_stream":
                src = torch.full((1,), 7, dtype=torch.int32, pin_memory=True)
                rc = cu.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(addr), ctypes.c_void_p(src.data_ptr()),
                                             ctypes.c_size_t(4), st)
            else:
                rc = cu.cuMemsetD32Async(ctypes.c_uint64(addr), ctypes.c_uint(7), ctypes.c_size_t(1), st)
        elif method == "host_mapped_store":
            word[0] = 7
            rc = 0
        done["rc"], done["call_s"] = rc, time.monotonic() - t0

    t = threading.Thread(target=release, daemon=True)
    t.start()
    t0 = time.monotonic()
    while not ev.query() and time.monotonic() - t0 < 3.0:  # polled: a method that fails shows as such
        time.sleep(0.01)
    took = time.monotonic() - t0
    released = ev.query()
    t.join(2)
    print(f"RESULT {method}: {'released' if released else 'NOT released'} after {took:.2f} s; write call "
          f"{'returned rc=%s in %.3f s' % (done['rc'], done['call_s']) if done else 'still blocked'}",
          flush=True)
    if released:
        torch.cuda.synchronize()
        print(f"RESULT+ y ok={bool((y == 2).all())}", flush=True)
    os._exit(0)


def main() -> None:
    if len(sys.argv) > 1:
        one(sys.argv[1], consumer=len(sys.argv) < 3)
        return
    rows = []
    for conns in (None, "1"):
        env = dict(os.environ)
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        if conns:
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = conns
        for m in METHODS:
          for consumer in (True,):
            t0 = time.monotonic()
            log = f"/tmp/probe_{m}_{conns}_{consumer}.log"
            with open(log, "w") as f:
                p = subprocess.Popen([sys.executable, __file__, m] + ([] if consumer else ["noconsumer"]),
                                     env=env, stdout=f, stderr=subprocess.STDOUT)
                try:
                    p.wait(timeout=9)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            text = open(log).read()
            line = [ln for ln in text.splitlines() if ln.startswith(("RESULT", "ATTRS"))]
            res = " / ".join(line) if line else f"rc={p.returncode} (no result) {text[-300:]!r}"
            rows.append((conns or "default", m + ("" if consumer else " (no consumer)"), f"{time.monotonic() - t0:.1f}s", res))
            print(rows[-1], flush=True)
    print("\nconnections | method | wall | result")
    for r in rows:
        print(" | ".join(r))


if __name__ == "__main__":
    main()
