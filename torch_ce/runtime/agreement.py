"""The bind's cross-rank exchanges: agreement, layout check, publish; bounded and fail-fast.

# NOTE [agreement before anything moves]
A gather retargeted on some ranks and not on others never completes (NCCL waits for a
peer that is doing one-sided reads). So before anything moves, every rank of the group
exchanges one descriptor per candidate shard, the locally refused ones included:
a ``Descriptor`` (group ranks, shape, dtype, device type, refusal code and text). Candidate i is bound only
if every member reports an identical, eligible descriptor at position i and the same
number of candidates; anything else is marked ``Fallback`` and gathered through the
group's collective backend, identically on every rank. Then each rank computes the
layout (``windows.place``) and the ranks compare it before any window opens.

# NOTE [bind rounds go through the store]
The exchanges use the default process group's key-value store, not collectives:
- bounded: every wait is the group session's (NOTE [sessions: one abort per group
  generation] in runtime/session.py): a deadline (``bind_timeout_s``;
  ``bind_arrival_timeout_s`` for the first exchange, which also waits for peers still
  compiling), and the generation's abort, which a rank that fails posts and its peers see
  at their next poll, so every rank raises, naming the failing rank, instead of one rank
  waiting forever in a collective; a failure of any other protocol of the generation (a
  reduce-scatter, FSDP2's step words) ends a round's wait the same way;
- safe: a peer's bytes are parsed as JSON, never unpickled (``all_gather_object`` would
  unpickle them, and needs numpy, which the CPU torch wheel does not bring);
- off the GPU: no tensor is allocated, so the bind leaves nothing in a CUDA graph's pool,
  and an NCCL group's stream is not involved.
Keys are ``torch_ce/<group ranks>/g<generation>/<what>/<round>/<phase>/<rank>``; a round
number counts this group's rounds of one kind in the generation, which every member runs
in the same order. The store holds at most one key per rank and kind of round (and group)
between rounds: a rank deletes its key of a phase once every peer has posted the next one
(each peer read it before posting), and its last phase's key at the next round's first
completed exchange, so an RL loop that updates its weights every step does not grow the
store server.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from . import session as S
from .session import PeerError

_left: dict[tuple, list[str]] = {}  # (store id, group ranks, what) -> this rank's keys a finished round left


class BindError(PeerError):
    """A bind failed on some rank; raised on every rank of the group."""


_store = S._store


class Round:
    """One round of one group: named exchanges of bytes between its ranks, in the group's
    live session.

    ``exchange(phase, payload)`` posts this rank's payload and returns every member's,
    by global rank. ``abort(message)`` ends the session's generation (every member's
    current or next exchange, and every other wait of the generation, raises).
    """

    def __init__(self, group_ranks: tuple, rank: int, timeout_s: float, arrival_timeout_s: float,
                 what: str = "bind", error: type = BindError, timeout_names=("bind_arrival_timeout_s", "bind_timeout_s")):
        self.session, aborted = S.opening(group_ranks, what)
        self.store = self.session.store
        self.ranks = group_ranks
        self.rank = rank  # this process's global rank
        # ``what`` names the rounds (a bind, or runtime/updates.py's "update"), each kind
        # counted on its own: every member runs each kind's rounds in the same order.
        self.what, self.error, self.timeout_names = what, error, timeout_names
        self.kind = (id(self.store), group_ranks, what)
        self.prefix = self.session.next_round(what)
        self.timeout_s = timeout_s
        self.arrival_timeout_s = arrival_timeout_s
        self.phases = 0
        if aborted is not None:  # a peer failed the generation this rank was still in
            raise error(self._on_abort(aborted))

    @property
    def number(self) -> int:
        """This round's number: unique for its group and kind in the job."""
        return int(self.prefix.rsplit("/", 1)[1])

    def _key(self, phase: str, rank: int) -> str:
        return f"{self.prefix}/{phase}/{rank}"

    def abort(self, message: str) -> None:
        """Tell every member this round failed here (best effort: never raises)."""
        self.session.bury(self.prefix)
        self.session.fail(self.rank, self.what, message)

    def _delete(self, keys: list[str]) -> None:
        for k in keys:
            try:
                self.store.delete_key(k)
            except Exception:  # noqa: BLE001 (a store without delete: keys stay, as before)
                pass

    def _on_abort(self, rec: dict) -> str:
        who = rec["rank"] if rec["rank"] >= 0 else "?"
        where = "" if rec["protocol"] == self.what else f" (in its {S._protocol_name(rec['protocol'])})"
        return f"torch_ce: {self.what} failed on rank {who}{where}: {rec['message']}"

    def exchange(self, phase: str, payload: Any) -> dict[int, Any]:
        """Post ``payload`` (JSON-able) and return every member's, by global rank."""
        self.phases += 1
        timeout = self.arrival_timeout_s if self.phases == 1 else self.timeout_s
        self.store.set(self._key(phase, self.rank), json.dumps(payload).encode())
        _left.setdefault(self.kind, []).append(self._key(phase, self.rank))
        got = {self.rank: payload}
        waiting = [r for r in self.ranks if r != self.rank]

        def arrived() -> bool:
            nonlocal waiting
            waiting = [r for r in waiting if not self.store.check([self._key(phase, r)])]
            return not waiting

        def late() -> str:
            name = self.timeout_names[0 if self.phases == 1 else 1]
            return (f"torch_ce: rank(s) {waiting} of group {list(self.ranks)} did not reach "
                    f"the {self.what}'s '{phase}' step within {timeout:g} s ({name}; a rank that "
                    "crashed, hangs, or runs other graphs than its peers?)")

        try:
            self.session.wait(arrived, timeout_s=timeout, what=f"{self.what} '{phase}'", error=self.error,
                              protocol=self.what, rank=self.rank, on_timeout=late, abort_first=True,
                              on_abort=self._on_abort)
            rec = self.session.aborted()  # every peer arrived, but one may have given up since
            if rec is not None:
                raise self.error(self._on_abort(rec))
        except self.error:
            self.session.bury(self.prefix)
            raise
        for r in self.ranks:
            if r not in got:
                got[r] = json.loads(self.store.get(self._key(phase, r)).decode())
        # Every peer posted this phase, so it read every earlier key of this rank's (this
        # round's earlier phases, the last round's): they go (module NOTE).
        left = _left.get(self.kind, [])
        mine = self._key(phase, self.rank)
        self._delete([k for k in left if k != mine])
        _left[self.kind] = [mine]
        return got


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """What a rank says about one candidate in the agreement (JSON: rank-independent
    facts only, plus this rank's verdict)."""

    group_ranks: tuple  # the candidate's group, by global rank
    shape: tuple | None  # the slot's: the local shard's, or a padded slot's (None: no tensor)
    dtype: str | None  # what the window would hold (a staging slot's dtype in training)
    device: str | None  # device type
    code: int  # eligibility.Reason of this rank's refusal; 0: eligible here
    text: str  # that refusal's sentence

    @property
    def refused(self) -> bool:
        return self.code != 0

    def facts(self) -> tuple:
        """What every member must report identically for the candidate to bind."""
        return (self.group_ranks, self.shape, self.dtype, self.device)

    def to_json(self) -> list:
        return [list(self.group_ranks), None if self.shape is None else list(self.shape),
                self.dtype, self.device, self.code, self.text]

    @classmethod
    def from_json(cls, v: list) -> "Descriptor":
        ranks, shape, dtype, device, code, text = v
        return cls(tuple(ranks), None if shape is None else tuple(shape), dtype, device, int(code), text)


def descriptor(c) -> Descriptor:
    """What this rank says about one candidate."""
    from .windows import group_ranks_of

    ranks = tuple(group_ranks_of(c.group)) if c.group is not None else ()
    t = c.tensor
    code = int(c.reason.code) if c.reason is not None else 0
    text = str(c.reason) if c.reason is not None else ""
    if t is None:
        return Descriptor(ranks, None, None, None, code or 99, text or "ineligible")
    dtype = getattr(c, "stage_dtype", None) or t.dtype  # a staging slot's dtype (training)
    # A padded slot's shape (uneven Shard(0)): the same on every rank, whatever its shard.
    shape = getattr(c, "slot_shape", None) or tuple(t.shape)
    return Descriptor(ranks, tuple(shape), str(dtype), t.device.type, code, text)


def agree(cands: list, mine: list[Descriptor], everyone: dict[int, list[Descriptor]]) -> list:
    """Per candidate: None (agreed) or the Refusal that keeps it on the collective."""
    from .eligibility import Reason, refusal

    out = []
    for i, c in enumerate(cands):
        d = mine[i]
        if d.refused:
            out.append(c.reason)
            continue
        why = None
        for m in d.group_ranks:
            other = everyone.get(m)
            if other is None:
                why = refusal(Reason.DISAGREEMENT, f"rank disagreement: rank {m} of the group "
                              "did not take part in the agreement")
            elif len(other) != len(mine):
                why = refusal(Reason.DISAGREEMENT, f"rank disagreement: rank {m} has {len(other)} "
                              f"candidate shards, this rank {len(mine)}")
            elif other[i].facts() != d.facts():
                why = refusal(Reason.DISAGREEMENT, f"rank disagreement: rank {m} disagrees on "
                              f"shard {i} ({list(other[i].facts())} vs {list(d.facts())})")
            elif other[i].refused:
                why = refusal(Reason.PEER_REFUSED, f"rank disagreement: rank {m} refused it: "
                              f"{other[i].text}")
            if why is not None:
                break
        out.append(why)
    return out


def refuse_split_staging(cands: list, everyone: dict[int, list]) -> None:
    """Raise (on every rank alike: all see the same descriptors) when the ranks split over
    a training graph's weight: some stage it, some refused it.

    # NOTE [training graphs cannot fall back weight by weight]
    An inference bind refused by a peer falls back inside the op, gather by gather, in
    program order, which matches the peers' collectives. A training graph also runs
    gradient reduce-scatters on the same group, and a rank that refused a weight at
    compile time (a rank-dependent config) has another graph: its gathers are plain
    collectives that the reorder places among the reduce-scatters differently from the
    CE gathers of its peers. Their collectives would then meet in different orders and
    hang. A clear error at the first step is what is left."""
    for i, c in enumerate(cands):
        if c.stage_dtype is None:
            continue
        verdicts = {r: d[i] for r, d in everyone.items() if i < len(d)}
        ok = sorted(r for r, d in verdicts.items() if not d.refused)
        if ok and len(ok) < len(verdicts):
            no = {r: d.text for r, d in verdicts.items() if d.refused}
            raise BindError(
                f"torch_ce: the ranks disagree on which weights of a training graph gather on "
                f"the copy engine: {c.name} is staged on ranks {ok} and refused on "
                + ", ".join(f"rank {r} ({why})" for r, why in sorted(no.items()))
                + ". A training graph cannot fall back weight by weight (its collectives "
                "would meet the gradient reduce-scatters in another order on each rank: NOTE "
                "[training graphs cannot fall back weight by weight] in runtime/agreement.py). "
                "Give every rank the same torch_ce config, or use transport='nccl'.")
