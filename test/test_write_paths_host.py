"""Every way a user writes a bound weight is covered by the protocol or caught on the
writing rank (NOTE [what the net sees] in torch_ce/runtime/versions.py, NOTE [updating
bound weights] in updates.py), on CPU ranks (gloo, host transport), one rank seconds late.

The models are torchtitan's SimpleFSDP under plain ``torch.compile`` (inference), as in
``test_weight_updates_host.py``; every call of every rank is compared with eager on the
weights of that moment, or must raise ``StaleWeightError``: never a wrong output.

- ``test_public_state_dict_writes``: every rank overwrites every weight through the public
  state dict, ``model.state_dict()[k].to_local().copy_(new)`` and
  ``get_model_state_dict(model)[k].to_local().copy_(new)``, rank 1 three seconds after
  rank 0, outside the protocol: each rank's next call raises ``StaleWeightError`` naming
  the weight (before this, the fast rank returned wrong outputs), and so does
  ``p.to_local().copy_(new)`` on the parameters and ``dcp.load`` into
  ``get_model_state_dict(model)`` (loaded in place, no ``set_model_state_dict``); the same
  writes inside
  ``updating_weights`` are exact on every rank. fp32 (in place) and bf16 ``param_dtype``
  (cast slots).
- ``test_inference_tensor_weights``: weights made under ``torch.inference_mode()`` (no
  version counter): bound, exact, updated inside the protocol with a late rank and with
  cross-call prefetch on, exact after every update on every rank.
- ``test_data_assignment_inside_the_protocol``: 20 updates by ``.data =`` (the local
  shard given new storage), a late rank: every call exact, the windows' bytes flat, every
  weight still in its slot; a re-pointed weight of another shape is an ``UpdateError`` on
  every rank.
- ``test_store_keys_stay_flat``: 200 updates leave the store's key count where 10 left it.
"""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("torchtitan")

from mp_harness import run_ranks, seed_base, setup_compile  # noqa: E402
from test_weight_updates_host import _assert_exact, _compared, _eager, _fsdp_chain, _new_full, _rows  # noqa: E402

DELAY = 3.0  # seconds the late rank writes after its peer
LATE = 1
ENV = {"TORCH_CE_COST_MODE": "default"}
DIMS = {"fp32": [16, 32, 24, 8], "bf16": [8, 24, 16, 4]}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _setup(rank, world, seed, root, inference=False, **cfg):
    setup_compile(root, rank)
    from torch.distributed.device_mesh import init_device_mesh

    import torch_ce

    mesh = init_device_mesh("cpu", (world,))
    models, fulls = {}, {}
    for j, k in enumerate(DIMS):
        if inference:
            with torch.inference_mode():
                models[k], fulls[k] = _fsdp_chain(DIMS[k], seed + j, mesh, None if k == "fp32" else torch.bfloat16)
        else:
            models[k], fulls[k] = _fsdp_chain(DIMS[k], seed + j, mesh, None if k == "fp32" else torch.bfloat16)
    torch_ce.enable(transport="copy_engine", **cfg)
    compiled = {k: torch.compile(m, fullgraph=True) for k, m in models.items()}
    return mesh, models, fulls, compiled


def _calls(res, label, compiled, models, fulls, gen, n=2, catch=False):
    """``n`` calls of each model against eager on ``fulls``; with ``catch``, a
    StaleWeightError is recorded instead of a result."""
    import torch_ce

    for k, c in compiled.items():
        for _ in range(n):
            x = torch.randn(3, DIMS[k][0], generator=gen).to(DTYPES[k])
            try:
                y = c(x)
            except torch_ce.StaleWeightError as e:
                if not catch:
                    raise
                res["stale"].append((label, k, str(e)))
                continue
            res["calls"].append(_compared(label, k, y, _eager(fulls[k], x)))


HOWS = ("state_dict", "get_model_state_dict", "to_local", "dcp")


def _state_dict_write(how, model, full):
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if how == "dcp":  # a checkpoint of ``full`` loaded into the model's state dict, in place
        import os
        import tempfile

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from test_weight_updates_host import _dtensors

        mesh = next(iter(model.parameters())).device_mesh
        ckpt = os.path.join(tempfile.mkdtemp(), f"rank{rank}")
        dcp.save(_dtensors(model, full, mesh), checkpoint_id=ckpt, no_dist=True)  # no object collectives: no numpy
        dcp.load(get_model_state_dict(model), checkpoint_id=ckpt, no_dist=True)
        return
    if how == "to_local":
        sd = dict(model.named_parameters())
    elif how == "state_dict":
        sd = model.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd = get_model_state_dict(model)
    for (k, v), f in zip(sd.items(), full, strict=True):
        v.to_local().copy_(_rows(f, world, rank))


def _rank_state_dict(rank, world, seed, root):
    import torch.distributed as dist

    import torch_ce

    mesh, models, fulls, compiled = _setup(rank, world, seed, root)
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    res = dict(calls=[], stale=[])
    params = [p for m in models.values() for p in m.parameters()]
    try:
        with torch.no_grad():
            _calls(res, "bound", compiled, models, fulls, gen)
            for i, how in enumerate(HOWS):
                # Outside the protocol: rank 1 writes DELAY s after rank 0, each calls at
                # once after its own write (its peer may still hold the old weights).
                dist.barrier()
                if rank == LATE:
                    time.sleep(DELAY)
                new = {k: _new_full(f, seed + 10 * i + j) for j, (k, f) in enumerate(fulls.items())}
                for k, m in models.items():
                    _state_dict_write(how, m, new[k])
                n_stale = len(res["stale"])
                _calls(res, f"unprotected {how}", compiled, models, new, gen, n=1, catch=True)
                res.setdefault("stale_per_write", []).append(len(res["stale"]) - n_stale)
                # Inside it: the same writes, a late rank, exact everywhere.
                new = {k: _new_full(f, seed + 10 * i + j + 5) for j, (k, f) in enumerate(fulls.items())}
                with torch_ce.updating_weights(params):
                    if rank == LATE:
                        time.sleep(DELAY)
                    for k, m in models.items():
                        _state_dict_write(how, m, new[k])
                fulls = new
                _calls(res, f"protocol {how}", compiled, models, fulls, gen)
    finally:
        torch_ce.disable()
    return res


def test_public_state_dict_writes(tmp_path):
    res = run_ranks(_rank_state_dict, 2, seed_base(), str(tmp_path.resolve()), timeout=300, env=ENV)
    for rank, r in enumerate(res):
        _assert_exact(rank, r["calls"])
        labels = {(c[0], c[1]) for c in r["calls"]}
        for how in HOWS:
            for k in DIMS:
                assert (f"protocol {how}", k) in labels, labels
                # the unprotected write is caught on this (writing) rank: no result at all
                assert (f"unprotected {how}", k) not in labels, (rank, how, k)
        assert r["stale_per_write"] == [2] * len(HOWS), r["stale_per_write"]
        for label, k, msg in r["stale"]:
            assert "layers.0.weight" in msg and "updating_weights" in msg, msg


def _rank_inference(rank, world, seed, root):
    import torch_ce
    from torch_ce.runtime import prefetch
    from torch_ce.runtime import windows as W

    mesh, models, fulls, compiled = _setup(rank, world, seed, root, inference=True, prefetch_next_call_mib=64)
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    res = dict(calls=[], stale=[])
    params = [p for m in models.values() for p in m.parameters()]
    res["inference"] = all(p._local_tensor.is_inference() for p in params)
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        with torch.inference_mode():
            _calls(res, "bound", compiled, models, fulls, gen, n=3)
            res["in_place"] = sum(isinstance(W.lookup(p._local_tensor), W.Slot) for p in models["fp32"].parameters())
            for i in range(3):
                new = {k: _new_full(f, seed + 10 * i + j) for j, (k, f) in enumerate(fulls.items())}
                with torch_ce.updating_weights(params):
                    if rank == LATE:
                        time.sleep(DELAY)
                    for k, m in models.items():
                        for p, f in zip(m.parameters(), new[k], strict=True):
                            p._local_tensor.copy_(_rows(f, world, rank))
                fulls = new
                _calls(res, f"update {i}", compiled, models, fulls, gen, n=3)
        res["prefetch"] = dict(prefetch.stats)
    finally:
        torch_ce.disable()
    return res


def test_inference_tensor_weights(tmp_path):
    res = run_ranks(_rank_inference, 2, seed_base(), str(tmp_path.resolve()), timeout=300, env=ENV)
    for rank, r in enumerate(res):
        assert r["inference"], "the weights were meant to be inference tensors"
        _assert_exact(rank, r["calls"])
        assert {c[0] for c in r["calls"]} == {"bound", "update 0", "update 1", "update 2"}
        assert r["in_place"] == 3, r
        assert r["prefetch"]["prefetched"] > 0 and r["prefetch"]["taken"] > 0, r["prefetch"]


def _window_bytes():
    from torch_ce.runtime import window_pools as WP

    return sum(p.reserved for p in WP.pools().values()), sum(p.used for p in WP.pools().values())


def _rank_data_assignment(rank, world, seed, root):
    import torch.distributed as dist

    import torch_ce
    from torch_ce.runtime import windows as W

    mesh, models, fulls, compiled = _setup(rank, world, seed, root)
    gen = torch.Generator().manual_seed(seed + 1000 + rank)
    res = dict(calls=[], stale=[], bytes=[])
    params = [p for m in models.values() for p in m.parameters()]
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        with torch.no_grad():
            _calls(res, "bound", compiled, models, fulls, gen)
            res["bytes"].append(_window_bytes())
            for i in range(20):
                new = {k: _new_full(f, seed + 10 * i + j) for j, (k, f) in enumerate(fulls.items())}
                with torch_ce.updating_weights(params):
                    if rank == LATE and i % 5 == 0:
                        time.sleep(DELAY)
                    for k, m in models.items():
                        for p, f in zip(m.parameters(), new[k], strict=True):
                            p._local_tensor.data = _rows(f, world, rank).clone()
                fulls = new
                _calls(res, f"update {i}", compiled, models, fulls, gen, n=1)
                res["bytes"].append(_window_bytes())
            res["in_place"] = sum(isinstance(W.lookup(p._local_tensor), W.Slot) for p in models["fp32"].parameters())
            # Another shape cannot go back into its slot: an UpdateError on every rank.
            try:
                with torch_ce.updating_weights(params):
                    p = models["fp32"].layers[0]._parameters["weight"]
                    p._local_tensor.data = torch.randn(p._local_tensor.shape[0] + 1, p._local_tensor.shape[1])
            except torch_ce.UpdateError as e:
                res["reshaped"] = str(e)
            else:
                res["reshaped"] = None
    finally:
        torch_ce.disable()
    return res


def test_data_assignment_inside_the_protocol(tmp_path):
    res = run_ranks(_rank_data_assignment, 2, seed_base(), str(tmp_path.resolve()), timeout=300, env=ENV)
    for rank, r in enumerate(res):
        _assert_exact(rank, r["calls"])
        assert len(r["calls"]) == 4 + 20 * 2, len(r["calls"])
        assert len(set(r["bytes"])) == 1, f"rank {rank}: window bytes moved: {r['bytes']}"
        assert r["in_place"] == 3, r
        assert r["reshaped"] and "layers.0.weight" in r["reshaped"] and "shape" in r["reshaped"], r["reshaped"]


def _rank_store_keys(rank, world, seed, root):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import torch_ce

    mesh, models, fulls, compiled = _setup(rank, world, seed, root)
    gen = torch.Generator().manual_seed(seed + rank)
    res = dict(calls=[], stale=[], keys={})
    params = [p for m in models.values() for p in m.parameters()]
    store = c10d._get_default_store()
    try:
        with torch.no_grad():
            _calls(res, "bound", compiled, models, fulls, gen, n=1)
            for i in range(200):
                with torch_ce.updating_weights(params):
                    pass
                if i + 1 in (10, 200):
                    dist.barrier()
                    res["keys"][i + 1] = store.num_keys()
                    dist.barrier()
            _calls(res, "after", compiled, models, fulls, gen, n=1)
    finally:
        torch_ce.disable()
    return res


def test_store_keys_stay_flat(tmp_path):
    res = run_ranks(_rank_store_keys, 2, seed_base(), str(tmp_path.resolve()), timeout=300, env=ENV)
    for rank, r in enumerate(res):
        _assert_exact(rank, r["calls"])
        assert r["keys"][200] <= r["keys"][10], r["keys"]
