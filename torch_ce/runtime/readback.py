"""The bind's peer read-back: every window a bind opens is read back by every rank through
the gathers' own path before anything moves into it (NOTE [peer read-back at bind]). The
bind (binding.py) runs it between opening its windows and moving its shards.
"""
from __future__ import annotations

import logging
import secrets

import torch

from . import windows as W
from .agreement import Round
from .eligibility import Reason, Refusal, refusal
from .transports import transport

log = logging.getLogger("torch_ce")


# NOTE [peer read-back at bind]
# A peer copy into or out of memory without the right access mapping can return success
# and copy nothing; a gather would then hand out what its output held before, on one
# rank, with no error anywhere. So a bind that opens windows reads every one of them back
# before anything moves into it, each rank every rank's copy, through the gathers' own
# path: ``gather.gather_slots`` on a one-word probe slot at the window's start, registered
# as a bound shard (the C++ gather's peer copies on CUDA, the opted-in per-peer ``copy_``,
# the host transport's memcpy from the peer's mapping on CPU). The word is a canary: each
# rank writes a fresh random one (never 0) at the start of each of its new windows and
# posts them (exchange "readback-canary"); after the reads each rank posts what it found
# wrong (exchange "readback"), which also keeps every canary in place until every rank has
# read it (the move overwrites them). A window that any rank could not read back, or read
# another value from, ends its pool's part of the bind on every rank alike (every rank sees
# every report, in rank order): its new windows are dropped and its weights of this bind
# stay on the collective with the reason (``Reason.PEER_READBACK``, in ``explain()``).
# Cost: one 8-byte read per peer and new window and two store exchanges, in a bind that
# opens windows only (windows opened earlier were read back then). Off:
# ``config.bind_readback`` (on every rank: the agreement's payloads carry it, so a rank
# that turned it off turns it off for the bind).
_READBACK_SHOWN = 4  # report lines a refusal quotes


def read_back(plans: list, rnd: Round, enabled: bool = True) -> dict[int, Refusal]:
    """The plans (by index) whose new windows some rank could not read back, each with its
    refusal: the same on every rank of the round (NOTE [peer read-back at bind]).
    ``plans``: the bind's pool plans (``binding._PoolPlan``: its ``key`` and the windows
    ``new`` it opened). ``enabled``: every rank's ``config.bind_readback`` (agreed: all on,
    or it is off)."""
    wins = [(i, w) for i, p in enumerate(plans) for w in p.new if w.nbytes >= 8]
    if not enabled or not wins:
        return {}
    mine = {}
    for i, w in wins:
        mine[f"{i}/{w.index}"] = canary = secrets.randbits(62) + 1
        write_word(w, canary)
    posted = rnd.exchange("readback-canary", mine)
    found: dict[str, list[str]] = {}
    for i, w in wins:
        wrote = [posted.get(g, {}).get(f"{i}/{w.index}") for g in w.group_ranks]
        try:
            got = read_words(w)
        except Exception as e:  # noqa: BLE001 (reported to every rank: the pool falls back)
            found.setdefault(str(i), []).append(
                f"rank {rnd.rank} could not read window #{w.index} ({type(e).__name__}: {e})")
            continue
        for r, (x, y) in enumerate(zip(got, wrote)):
            if x != y:
                found.setdefault(str(i), []).append(
                    f"rank {rnd.rank} read {_word(x)} from rank {w.group_ranks[r]}'s window "
                    f"#{w.index}, which wrote {_word(y)}")
    reports = rnd.exchange("readback", found)
    lines: dict[int, list[str]] = {}
    for r in sorted(reports):
        for i, ls in sorted(reports[r].items()):
            lines.setdefault(int(i), []).extend(ls)
    out = {}
    for i, ls in lines.items():
        more = f"; and {len(ls) - _READBACK_SHOWN} more" if len(ls) > _READBACK_SHOWN else ""
        out[i] = refusal(Reason.PEER_READBACK,
                         "peer read-back at bind failed (a peer mapping that copies nothing, or "
                         "reads other memory?): " + "; ".join(ls[:_READBACK_SHOWN]) + more)
        log.warning("torch_ce.bind: %s; pool %s stays on the collective", out[i], plans[i].key)
    return out


def write_word(w: W.Window, value: int) -> None:
    """``value`` as the first 8 bytes of this rank's copy of ``w``, visible to its peers
    when this returns (NOTE [peer read-back at bind])."""
    word = w.local[:8].view(torch.int64)
    with torch.no_grad(), torch.inference_mode(word.is_inference()):
        word.copy_(torch.tensor([value], dtype=torch.int64))
    if w.device.type == "cuda":
        torch.cuda.synchronize(w.device)


def read_words(w: W.Window) -> list[int]:
    """The first 8 bytes of every rank's copy of ``w`` (group-rank order), read as the
    gathers read: a probe slot published by the transport, registered as a bound shard,
    gathered by ``gather.gather_slots`` (NOTE [peer read-back at bind])."""
    from . import gather

    slot = W.Slot(w, 0, 8, (1,), torch.int64, "read-back")
    transport(w.device).publish_slot(slot)
    probe = w.local[:8].view(torch.int64)
    with W.registered_probe(probe, slot):
        out = gather.gather_slots([probe], [slot], w.group_size)[0]
        out = torch.ops._c10d_functional.wait_tensor(out)
        return [int(v) for v in out.cpu().tolist()]


def _word(v) -> str:
    return "nothing" if v is None else f"{int(v) & (2**64 - 1):#018x}"
