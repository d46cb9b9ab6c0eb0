"""The row gather's Triton kernel (runtime/rows_triton.py) on one GPU, loopback slots.

``register_loopback`` binds a 2-rank slot whose peer copy is a second local tensor, so the
kernel's reads through the owners' addresses run on one device. Checked exactly against
``torch.embedding`` of the concatenated table, for every row width the word choice covers
(16-byte, 8, 4, 2 and 1-byte rows), int64 and int32 ids, both positions in the pair; the row
path the library uses (``gather.gather_rows``: the CUDA kernel in an nvcc build, this one
otherwise) against it; a CUDA-graph capture replayed with new ids and new table contents
(no host sync, no stale address); and an out-of-range id faults on the device with the
message (in a child process: the fault poisons its CUDA context).

Skipped without a GPU, triton, or the built C++ library.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from cuda_helpers import register_loopback
from mp_harness import run_ranks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        not any(f.startswith("_ce_torch") for f in os.listdir(os.path.join(
            os.path.dirname(__file__), "..", "torch_ce", "runtime"))),
        reason="the C++ gather kernels are not built"),
]

# (rows per rank, row shape, dtype): 8 KiB bf16 rows (16-byte words), 12-byte fp32 rows
# (4-byte words), 6-byte fp16 rows (2), 5-byte uint8 rows (1), 8-byte rows (8).
SPECS = ((512, (4096,), torch.bfloat16), (96, (3,), torch.float32), (64, (3,), torch.float16),
         (40, (5,), torch.uint8), (33, (2,), torch.float32))


def _table(shape, dtype, gen, dev):
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen, device=dev, dtype=dtype)
    return torch.randn(shape, generator=gen, device=dev).to(dtype)


def _rank_rows(rank, world):
    from torch_ce.runtime import gather, rows_triton

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev).manual_seed(os.getpid())
    res = dict(row_path=gather.row_path(), kernel_path=gather.kernel_path("cuda"), exact={}, lib={})
    keep = []
    for rows, tail, dtype in SPECS:
        for pos in (0, 1):
            mine, peer = _table((rows, *tail), dtype, gen, dev), _table((rows, *tail), dtype, gen, dev)
            slot = register_loopback(mine, peer, dist.group.WORLD, pos)
            keep.append((mine, peer))
            full = torch.cat([mine, peer] if pos == 0 else [peer, mine])
            table = rows_triton.table(slot.peer_ptrs, dev)
            for idt in (torch.int64, torch.int32):
                ids = torch.randint(0, 2 * rows, (3, 37), generator=gen, device=dev).to(idt)
                ref = full[ids.long()]
                got = rows_triton.gather_rows(table, slot.peer_ptrs, slot.shape, dtype, ids)
                lib = gather.gather_rows(mine, slot, ids)
                key = f"{dtype}x{tail}/pos{pos}/{idt}"
                res["exact"][key] = bool(torch.equal(got, ref))
                res["lib"][key] = bool(torch.equal(lib, ref))
            one = rows_triton.gather_rows(table, slot.peer_ptrs, slot.shape, dtype,
                                          torch.tensor(rows, device=dev))  # a 0-d id
            res["exact"][f"{dtype}x{tail}/pos{pos}/0-d"] = bool(torch.equal(one, full[rows]))
    # Captured: the replay reads the ids and the table as they are then.
    rows, tail, dtype = SPECS[0]
    mine, peer = _table((rows, *tail), dtype, gen, dev), _table((rows, *tail), dtype, gen, dev)
    slot = register_loopback(mine, peer, dist.group.WORLD, 0)
    table = rows_triton.table(slot.peer_ptrs, dev)
    ids = torch.randint(0, 2 * rows, (256,), generator=gen, device=dev)
    step = lambda: rows_triton.gather_rows(table, slot.peer_ptrs, slot.shape, dtype, ids) * 1  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = step()
    replays = []
    for _ in range(2):
        ids.copy_(torch.randint(0, 2 * rows, ids.shape, generator=gen, device=dev))
        mine.copy_(_table(mine.shape, dtype, gen, dev))
        peer.copy_(_table(peer.shape, dtype, gen, dev))
        g.replay()
        torch.cuda.synchronize()
        replays.append(bool(torch.equal(static, torch.cat([mine, peer])[ids])))
    res["replays"] = replays
    return res


def test_triton_rows_exact_on_loopback():
    from torch_ce.runtime import rows_triton

    if rows_triton.unavailable():
        pytest.skip(rows_triton.unavailable())
    (r,) = run_ranks(_rank_rows, 1, timeout=300)
    print(r["row_path"], r["kernel_path"])
    assert r["row_path"][0] in ("cuda", "triton"), r["row_path"]
    assert all(r["exact"].values()), r["exact"]
    assert all(r["lib"].values()), r["lib"]
    assert r["replays"] == [True, True], r


_OOB = r"""
import torch
from torch_ce.runtime import rows_triton
dev = torch.device("cuda", 0)
a, b = torch.randn(8, 4, device=dev), torch.randn(8, 4, device=dev)
t = rows_triton.table([a.data_ptr(), b.data_ptr()], dev)
out = rows_triton.gather_rows(t, [a.data_ptr(), b.data_ptr()], (8, 4), torch.float32,
                              torch.tensor([1, 16], device=dev))
torch.cuda.synchronize()
print("NO FAULT")
"""


def test_triton_rows_out_of_range_faults():
    from torch_ce.runtime import rows_triton

    if rows_triton.unavailable():
        pytest.skip(rows_triton.unavailable())
    p = subprocess.run([sys.executable, "-c", _OOB], capture_output=True, text=True, timeout=180,
                       cwd=os.path.join(os.path.dirname(__file__), ".."))
    text = p.stdout + p.stderr
    assert p.returncode != 0 and "NO FAULT" not in text, text[-2000:]
    # The kernel prints before it faults; CUDA may drop a faulted context's printf buffer.
    assert "index out of range" in text or "illegal" in text.lower(), text[-2000:]
