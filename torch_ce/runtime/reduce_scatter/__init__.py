"""The copy-engine reduce-scatter, what magi::ce_reduce_scatter[_coalesced] do: push,
signal, wait, one reduction.

# NOTE [copy-engine reduce-scatter]
A gradient reduce-scatter of a bucket over a group of W ranks, rank i (its index in the
group), without a collective and without a barrier (the workspaces and flags: NOTE
[reduce-scatter workspaces] in workspace.py). Each input is cut in W equal chunks
along dim 0, as ``reduce_scatter_tensor`` does; a bucket's slice for rank j is its
inputs' chunks j, back to back. Call n of the pool uses half h = n % 2, in two phases:

  launch (the op)
    1. push     for each peer j, from i+1 on (so the ranks do not all start at rank 0):
                wait free[h, j] (j reduced what i pushed into its half h two calls ago),
                copy the slice for j into j's recv[h, i], write (seq, numel) into j's
                head[h, i], set j's data[h, i] to the call's tag
  complete (its wait: ``wait_tensor`` on CUDA, at once on the host)
    2. wait     for each peer j: wait data[h, j] == this call's tag (j pushed i's slice
                of this call; another value is another call's push: an error naming
                both, NOTE [reduce-scatter workspaces]), before anything is reduced
    3. reduce   output = sum over group index 0, 1, ..., W-1 of chunk i, this rank's own
                read in place from its input (never copied), the peers' from recv[h, j];
                in fp32 (bf16 inputs: rounded once at the end); ``avg`` divides by W after
    4. free     for each peer j: set j's free[h, i]

Nothing waits for anything but (a) the data the reduction needs and (b) a half a peer has
not finished with. The summation order is fixed (group index order) and the same on every
rank, so results are deterministic run to run; at W = 2 a sum of two is order-free, so
they are bit-identical to the collective's.

Where the waits sit (CUDA): a stream wait blocks every later piece of work on its hardware
queue, and with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream shares one queue. So a wait
is enqueued only behind what satisfies it, on any rank: a rank enqueues its push of a call
before its wait for that call (the data wait is enqueued at the output's ``wait_tensor``,
after the compute the graph put before it, not at the launch), and a launch whose half
is still owed a completion by this rank (two calls launched, neither waited) completes
that call first, in program order, the same on every rank. Every wait then depends only
on work its peers enqueued before their own matching wait: no cycle, whatever the queues.

CUDA streams: the push on a copy stream (after the current stream: the gradient is ready),
the completion on a reduce stream (the pushes' copy stream, then the data waits, the
reduction kernels, the free writes), an event after it that ``wait_tensor`` makes the
consumer's stream wait on. The inputs and outputs are held by the call until its wait, so
no allocator or Inductor reuse can overwrite them (the lowering also marks the inputs
never reused). Under CUDA-graph capture nothing else changes: the flags are reset by their
waiters, so a replay starts from the state the capture started from.

Every rank runs every step; a peer that never pushes is a ``ReduceScatterError`` naming
the bucket and the peer within ``rs_timeout_s`` (host: the flag poll; CUDA: the watchdog
thread releases the stream, NaN outputs, and the next call raises: NOTE [reduce-scatter
watchdog]), and its peers' waits end too (the generation's abort, the retracted pushes).
A failure drops the pool on the rank that sees it; the next call opens a new generation
(NOTE [reduce-scatter workspaces]). A bucket whose slice does not fit a workspace under
``rs_workspace_cap_mib`` runs the group's collective instead, on every rank (the sizes
are the same on all), and says so once per bucket (``RsReason``, torch_ce/rs_reasons.py).

The package, in the order a call walks it:

    op.py          the op: the bucket's spec, the verdict (or the collective), launch and
                   complete, the accounting explain() reads (``served``)
    spec.py        a bucket's checks and signature, made once per bucket
    workspace.py   the pools and their workspaces, opened complete by one round of the
                   group (NOTE [reduce-scatter workspaces])
    host_flags.py  a CUDA workspace's words in host memory, for one hardware queue
    launch.py      a call launched (after the completion its half still owes) and completed:
                   the native path, or the Python one; the outputs' c10d work
    call.py        one call's record and its ``Stage``
    reference.py   the steps in Python: the host transport, and the CUDA reference
    reduce_triton.py  the native completion's reduction in Triton (builds without nvcc)
    watchdog.py    the thread that releases a stream no peer will release (NOTE
                   [reduce-scatter watchdog])
    flags.py       the words, their tags, the generation's abort, the host's bounded wait
"""
from __future__ import annotations

from .flags import ReduceScatterError
from .op import Served, note, reduce_scatter, release, served
from .reference import reduce_fallback
from .spec import DTYPES, REDUCE_OPS, premul_factor

__all__ = ["DTYPES", "REDUCE_OPS", "ReduceScatterError", "Served", "note", "premul_factor", "reduce_fallback",
           "reduce_scatter", "release", "served"]
