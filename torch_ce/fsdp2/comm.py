"""The all-gather torch_ce installs on an FSDP2 param group (``set_custom_all_gather``).

FSDP2 calls it as ``comm(output_tensor=, input_tensor=, group=, async_op=)`` after it has
copied this rank's chunk into ``output_tensor`` (``input_tensor`` is that part of it),
on its all-gather stream; it then waits for the stream (and for a returned ``Work``) and
copies the parameters out. So a call only has to fill the peers' parts of the output:

- static: one read per peer of its bound chunk (``peer_views``), after the version net's
  check (NOTE [the version net]); no signal, no wait on any peer. On CPU the host
  transport's memcpy; on CUDA the same reads as copies on torch_ce's copy stream, which
  waits on FSDP2's all-gather stream and which that stream then waits on (nothing on the
  host waits; FSDP2's own event after the call orders its copy-out).
- staged (training): the step-word protocol (NOTE [FSDP2 training: step words]); on CUDA
  one C++ call enqueues its waits, copies and writes on FSDP2's all-gather stream itself
  (fsdp2/step_words.py).

Returning ``None`` tells FSDP2 the call is complete in stream order (its sync contract).
"""
from __future__ import annotations

import dataclasses

import torch

from ..runtime import versions
from ..runtime.gather import peer_order
from . import signals
from .chunks import Bound, stale_error
from .groups import Group


@dataclasses.dataclass
class Served:
    """What one group's all-gather did in this process (explain())."""

    calls: int = 0
    bytes: int = 0  # written by the calls (output bytes, NOTE [coverage bytes])
    no_grad_calls: int = 0  # a training group's calls under no_grad / inference_mode (explain()'s hint)


_copy_streams: dict = {}


def _copy_stream(device: torch.device):
    s = _copy_streams.get(device)
    if s is None:
        s = _copy_streams[device] = torch.cuda.Stream(device=device)
    return s


class CopyEngineAllGather:
    """FSDP2's ``AllGather`` protocol (``allocate`` and ``__call__``) over a bound group."""

    def __init__(self, group: Group, bound: Bound, timeout_s: float):
        self.group = group
        self.bound = bound
        self.timeout_s = timeout_s
        slot = bound.slot
        self.rank = slot.window.rank
        self.world = slot.group_size
        self.ranks = slot.window.group_ranks
        self.peers = peer_order(self.rank, self.world)
        self.calls = 0  # this group's gathers so far (the step words' call numbers)
        self.poison = ""
        self.served = Served()
        self._group_ok = None  # the process group whose ranks matched (checked once)
        self._srcs = None  # (the peers' chunks, their rows) for the C++ peer copy
        self._native = None  # whether the C++ peer copy serves the CUDA reads (decided at the first)
        self._step_reg = None  # a CUDA training group's C++ registration (made at its first call)
        self._watch = None  # the watchdog's record while a CUDA training gather is pending
        self._fast = None  # a CUDA training group's call once its first passed every check

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __repr__(self) -> str:
        slot = self.bound.slot
        return (f"{type(self).__name__}(group={self.group.name!r}, mode={self.group.mode!r}, "
                f"ranks={list(self.ranks)}, window={slot.window.index} @ {slot.offset}, "
                f"{slot.nbytes} B/rank)")

    def _check(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group) -> None:
        slot = self.bound.slot
        if self.poison:
            raise RuntimeError(self.poison)
        n = slot.nbytes // slot.dtype.itemsize
        if (output_tensor.dtype != slot.dtype or output_tensor.numel() != n * self.world
                or input_tensor.numel() != n or not output_tensor.is_contiguous()):
            raise RuntimeError(
                f"torch_ce.fsdp2: {self.group.name}: FSDP2 gathers {output_tensor.numel()} "
                f"{output_tensor.dtype} elements where its bound chunk is {n} x {self.world} "
                f"{slot.dtype} (parameters registered or re-typed after fsdp2.enable(); call "
                "fsdp2.disable(model) and enable it again on every rank)")
        if group is self._group_ok:
            return
        if tuple(torch.distributed.get_process_group_ranks(group)) != tuple(self.ranks):
            raise RuntimeError(f"torch_ce.fsdp2: {self.group.name}: FSDP2 gathers over ranks "
                               f"{torch.distributed.get_process_group_ranks(group)}, the chunk is "
                               f"bound over {list(self.ranks)}")
        self._group_ok = group

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False):
        if self._fast is not None and group is self._group_ok:  # a CUDA training group's
            self._fast(output_tensor, input_tensor)  # sizes, dtypes: checked in C++
            self.served.calls += 1
            self.served.bytes += self._out_bytes
            if not torch.is_grad_enabled():
                self.served.no_grad_calls += 1
            return None
        self._check(output_tensor, input_tensor, group)
        out = output_tensor.view(self.world, -1)
        if self.group.mode == "static":
            b = self.bound
            versions.check(b.slot)
            if b._pairs and not b.views():  # NOTE [FSDP2 parameters that move] in chunks.py
                raise stale_error(self.group, b)
            self._read(out)
        else:
            self._staged(out, input_tensor)
            if not torch.is_grad_enabled():
                self.served.no_grad_calls += 1
        self.served.calls += 1
        self.served.bytes += output_tensor.numel() * output_tensor.element_size()
        return None

    def _read(self, out: torch.Tensor, peers=None) -> None:
        views = self.bound.slot.peer_views
        peers = self.peers if peers is None else peers
        if not out.is_cuda:
            for p in peers:
                out[p].copy_(views[p])
            return
        if self._native is None:
            from ..runtime import native

            self._native = native.peer_copy_into if native.has_peer_copy_into() else False
        if self._native:  # the same copies and stream order, in one C++ call
            if peers is self.peers:
                if self._srcs is None:
                    self._srcs = ([views[p] for p in peers], list(peers))
                self._native(out, *self._srcs)
            else:
                self._native(out, [views[p] for p in peers], list(peers))
            return
        cur = torch.cuda.current_stream(out.device)  # FSDP2's all-gather stream
        cs = _copy_stream(out.device)
        cs.wait_stream(cur)
        with torch.cuda.stream(cs):
            for p in peers:
                out[p].copy_(views[p], non_blocking=True)
        cur.wait_stream(cs)
        out.record_stream(cs)

    def _staged(self, out: torch.Tensor, input_tensor: torch.Tensor) -> None:
        """One training call (NOTE [FSDP2 training: step words])."""
        if out.is_cuda:
            from . import step_words

            self._out_bytes = out.numel() * out.element_size()
            step_words.gather(self, out, input_tensor)  # sets ``_fast`` for the next calls
            return
        k = self.calls + 1
        words = self.bound.words.peer_views
        mine = words[self.rank]
        me, ranks = self.ranks[self.rank], self.ranks
        try:
            for p in self.peers:  # 1. no peer still reads call k-1's bytes
                signals.wait_at_least(words[p], signals.DONE, k - 1, self.timeout_s,
                                      self._what(p, k - 1, "leave"), ranks, me)
            self.bound.buffer.copy_(input_tensor)  # 2. this call's chunk
            signals.post(mine, signals.READY, k)
            for p in self.peers:  # 3. each peer's chunk of call k
                signals.wait_at_least(words[p], signals.READY, k, self.timeout_s,
                                      self._what(p, k, "stage"), ranks, me)
                self._read(out, [p])
            signals.post(mine, signals.DONE, k)  # 4.
        except BaseException as e:
            self.poison = (f"torch_ce.fsdp2: {self.group.name}: an earlier gather failed on this "
                           f"rank ({type(e).__name__}: {e}); fsdp2.disable(model) and enable it "
                           "again on every rank")
            raise
        self.calls = k

    def _what(self, p: int, k: int, verb: str) -> str:
        return (f"{self.group.name}: rank {self.ranks[p]} did not {verb} the chunk of gather "
                f"{k}")
