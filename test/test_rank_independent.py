"""One process, no process group: the rules that must give every rank the same answer.

- The reshard pass's serving decision (``gate.serving_refusal``) on hand-built joint
  graphs of one weight as each rank of 3 sees it (ranks 0-1: the shard gathered as is;
  rank 2: padded first, possibly from an empty shard): the same verdict and the same
  recompute tags on every rank, an uneven Shard(0) served (``gate.uneven_rows``) pad
  included; an inference cast served exactly when ``config.cast_slots`` gives it a slot,
  as the post-grad gate decides.
- A refusal's code survives the trip through the compiled graph (eligibility.encode /
  decode), and the agreement's ``Descriptor`` survives JSON and is what ``agree`` compares.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from torch_ce.config import Config
from torch_ce.passes import gate, reshard
from torch_ce.runtime import agreement
from torch_ce.runtime.eligibility import Reason, Refusal, decode, encode

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _joint(local_rows: int, rows: int, world: int = 3, cols: int = 4, cast: bool = False,
           unread: bool = False, pad_all: bool = False, waits: int = 1) -> fx.Graph:
    """primals_1 (this rank's shard) [-> cast] [-> pad] -> all_gather -> wait [-> slice];
    ``unread``: nothing reads the wait (the graph returns the shard). Torch releases
    differ in how they trace it, and the verdict must not: ``pad_all``, torch 2.15's form
    of an uneven gather (every rank pads, the long ranks by zero rows; older torch pads
    only the short ranks); ``waits=2``, torch 2.14's CSE of a weight read twice (one
    gather, a first wait nobody reads, then the read one)."""
    ceil = -(-rows // world)
    g = fx.Graph()
    w = g.placeholder("primals_1")
    w.meta["val"] = torch.empty(local_rows, cols)
    x = w
    if cast:
        x = g.call_function(torch.ops.prims.convert_element_type.default, (x, torch.bfloat16))
        x.meta["val"] = torch.empty(local_rows, cols, dtype=torch.bfloat16)
    dtype = x.meta["val"].dtype
    if local_rows < ceil or (pad_all and world * ceil != rows):
        x = g.call_function(aten.constant_pad_nd.default, (x, [0, 0, 0, ceil - local_rows]))
        x.meta["val"] = torch.empty(ceil, cols, dtype=dtype)
    ag = g.call_function(c10d.all_gather_into_tensor.default, (x, world, "0"))
    ag.meta["val"] = torch.empty(world * ceil, cols, dtype=dtype)
    for _ in range(waits):  # the last one is read
        wt = g.call_function(c10d.wait_tensor.default, (ag,))
        wt.meta["val"] = ag.meta["val"]
    out = wt
    if unread:
        g.output(w)
        return g
    if world * ceil != rows:
        out = g.call_function(aten.slice.Tensor, (wt, 0, 0, rows))
        out.meta["val"] = torch.empty(rows, cols, dtype=dtype)
    g.output(out)
    return g


def _shards(rows: int, world: int = 3) -> list[int]:
    """torch.chunk's local row counts (the short shards last)."""
    ceil = -(-rows // world)
    return [max(0, min(ceil, rows - r * ceil)) for r in range(world)]


def _verdict(g: fx.Graph, cfg: Config):
    ag = next(n for n in g.nodes if n.target is c10d.all_gather_into_tensor.default)
    why = gate.serving_refusal(ag, cfg, training=True, ph_index=gate._placeholder_index(g),
                               mutated=gate.mutated_inputs(g))
    return None if why is None else why.code


def _tags(g: fx.Graph, cfg: Config) -> list[str]:
    reshard.tag_recompute(g, cfg)
    return sorted(str(n.target) for n in g.nodes if "recompute" in n.meta)


CFG = Config(host_transport=True)


def test_even_shards_are_served_and_tagged():
    for cast in (False, True):
        g = _joint(2, 6, cast=cast)
        assert _verdict(g, CFG) is None
        tags = _tags(g, CFG)
        assert any("all_gather" in t for t in tags) and any("wait_tensor" in t for t in tags), tags
        assert any("convert_element_type" in t for t in tags) == cast, tags


def test_uneven_and_empty_shards_decide_alike():
    """Every rank's verdict and tags are the same, and the same whether the long ranks pad
    by zero rows (torch 2.15) or not at all (older torch): NOTE [uneven pads are not a
    rank's fact]."""
    for rows in (7, 8, 2, 1):  # 3,3,1 / 3,3,2 / 1,1,0 / 1,0,0
        locals_ = _shards(rows)
        verdicts = {_verdict(_joint(n, rows, pad_all=p), CFG) for n in locals_ for p in (False, True)}
        assert verdicts == {None}, (rows, locals_, verdicts)
        tags = {tuple(t for t in _tags(_joint(n, rows, pad_all=p), CFG) if "constant_pad" not in t)
                for n in locals_ for p in (False, True)}
        assert len(tags) == 1, (rows, tags)


def test_one_gather_with_two_waits_is_one_read_gather():
    """NOTE [one gather, several waits]: the CSE'd form of a weight read twice is served
    (reshard and gate alike) as one gather with one wait, on every rank."""
    from torch_ce.passes import fx_utils

    for training in (True, False):
        for rows in (6, 7):
            for n in _shards(rows):
                ctx = (training, rows, n)
                g = _joint(n, rows, waits=2)
                tags = _tags(g, CFG)  # the reshard pass merges the waits, then tags the chain
                assert any("all_gather" in t for t in tags) and any("wait_tensor" in t for t in tags), (ctx, tags)
                g = _joint(n, rows, waits=2)
                assert fx_utils.merge_waits(g) == 1, ctx
                waits = [x for x in g.nodes if x.target is c10d.wait_tensor.default]
                assert len(waits) == 1 and waits[0].users, ctx
                assert _gate_verdicts(g, CFG, is_inference=not training) == [None], ctx


def test_minimum_size_is_the_slot_not_the_local_shard():
    # 7 rows of 4 fp32 over 3: slots of 3 rows (48 B) on every rank, also the 1-row rank.
    cfg = Config(host_transport=True, symm_min_shard_mib=40 / 2**20)
    verdicts = {_verdict(_joint(n, 7), cfg) for n in _shards(7)}
    assert verdicts == {None}, verdicts
    cfg = Config(host_transport=True, symm_min_shard_mib=60 / 2**20)
    verdicts = {_verdict(_joint(n, 7), cfg) for n in _shards(7)}
    assert verdicts == {Reason.BELOW_MIN_SIZE}, verdicts


def test_served_uneven_is_tagged_on_every_rank_pad_included():
    for rows in (7, 2):
        per_rank = []
        for n in _shards(rows):
            g = _joint(n, rows)
            assert _verdict(g, CFG) is None, (rows, n)
            tags = _tags(g, CFG)
            has_pad = any(x.target is aten.constant_pad_nd.default for x in g.nodes)
            assert any("constant_pad" in t for t in tags) == has_pad, tags
            per_rank.append(tuple(t for t in tags if "constant_pad" not in t))
        assert len(set(per_rank)) == 1 and any("slice" in t for t in per_rank[0]), per_rank


def _gate_verdicts(g: fx.Graph, cfg: Config, is_inference: bool):
    return [None if s.reason is None else s.reason.code for s in gate.gate(g, cfg, is_inference)]


def test_unread_gather_is_dropped_on_every_rank():
    """NOTE [unread gathers]: a gather nobody reads, uneven (only the short ranks pad) or
    even, cast or not: untagged for the reshard and dropped by the gate on every rank."""
    for cast in (False, True):
        for training in (True, False):
            cfg = Config(host_transport=True, training=True, cast_slots=True)
            for rows in (6, 7, 2):
                for n in _shards(rows):
                    g = _joint(n, rows, cast=cast, unread=True)
                    ctx = (cast, training, rows, n)
                    assert _verdict(g, cfg) == Reason.UNREAD, ctx
                    assert _tags(g, cfg) == [], ctx
                    seeds = gate.gate(g, cfg, is_inference=not training)
                    assert [s.unread for s in seeds] == [True], ctx
                    gate.drop_unread(g, seeds)
                    assert [x.op for x in g.nodes] == ["placeholder", "output"], (ctx, list(g.nodes))


def test_serving_refusal_is_the_gates_verdict():
    """Uneven (pad or not, empty shard included) and cast gathers, in training and in
    inference with cast_slots on and off: serving_refusal says what the post-grad gate
    says, on every rank alike."""
    for cast in (False, True):
        for training in (True, False):
            for slots in (False, True):
                cfg = Config(host_transport=True, training=True, cast_slots=slots)
                for rows in (6, 7, 2):
                    got = set()
                    for n, pad_all in ((n, p) for n in _shards(rows) for p in (False, True)):
                        g = _joint(n, rows, cast=cast, pad_all=pad_all)
                        ag = next(x for x in g.nodes if x.target is c10d.all_gather_into_tensor.default)
                        why = gate.serving_refusal(ag, cfg, training=training,
                                                   ph_index=gate._placeholder_index(g), mutated=set())
                        [want] = _gate_verdicts(g, cfg, is_inference=not training)
                        mine = None if why is None else why.code
                        assert (mine is None) == (want is None), (cast, training, slots, rows, n, mine, want)
                        got.add(mine)
                    assert len(got) == 1, (cast, training, slots, rows, got)
                    served = not cast or training or slots
                    assert (got == {None}) == served, (cast, training, slots, rows, got)


def test_refusal_codes_survive_the_graph():
    why = Refusal(Reason.UNEVEN_SHARD, "uneven Shard(0) (gathered rows are sliced)")
    assert decode(encode(why)) == why
    assert encode(None) == "" and decode("") is None
    assert decode("free text") == Refusal(Reason.OTHER, "free text")


def test_descriptor_round_trip_and_agreement():
    class C:
        def __init__(self, reason=None):
            self.reason = reason

    d = agreement.Descriptor((0, 1), (4, 8), "torch.float32", "cpu", 0, "")
    assert agreement.Descriptor.from_json(d.to_json()) == d
    refused = agreement.Descriptor((0, 1), (4, 8), "torch.float32", "cpu", int(Reason.EMPTY), "empty")
    other = agreement.Descriptor((0, 1), (5, 8), "torch.float32", "cpu", 0, "")
    assert agreement.agree([C()], [d], {0: [d], 1: [d]}) == [None]
    [why] = agreement.agree([C()], [d], {0: [d], 1: [refused]})
    assert why.code == Reason.PEER_REFUSED and "empty" in why.text
    [why] = agreement.agree([C()], [d], {0: [d], 1: [other]})
    assert why.code == Reason.DISAGREEMENT
