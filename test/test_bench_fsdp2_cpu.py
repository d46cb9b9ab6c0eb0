"""``torch-ce bench fsdp2`` on CPU: the smoke run (2 gloo ranks, host transport, tiny dims)
and ``--loopback`` on the host transport. The numbers mean nothing here; what is checked
is that every variant runs, equals FSDP2's default on every rank (inference outputs bit
for bit, training losses step by step), that torch_ce's rows are on the copy engines,
and that what cannot run here (``set_symm_mem_for_comm``) is a row with its reason."""
from __future__ import annotations

import json

from torch_ce.bench import fsdp2 as B

TINY = ["--device", "cpu", "--dim", "64", "--vocab", "256", "--layers", "1", "--blocks", "1",
        "--ctx", "8", "--tokens", "16", "--steps", "2", "--warmup", "0"]


def test_smoke_run_on_two_cpu_ranks(tmp_path, capfd):
    assert B.main([*TINY, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fsdp2_cpu_w2.json").read_text())
    rows = data["summary"]
    assert len(rows) == len(B.MODELS) * len(B.MODES) * len(B.VARIANTS), sorted(rows)
    for key, r in rows.items():
        model, mode, name = key.split("/")
        assert not r["error"], (key, r["error"])
        if name == "symm_mem":
            assert "set_symm_mem_for_comm needs CUDA" in r["skipped"], (key, r)
            continue
        if name == "ce_rs" and mode == "inference":
            assert r["skipped"] == "no reduce-scatter in inference", (key, r)
            continue
        assert r["ms"] > 0 and r["equal"] is True, (key, r)
        if name in ("ce", "ce_rs"):
            assert r["gather_share"] == 1.0 and not r["refused"], (key, r)
        if name == "ce_rs":
            assert r["rs_ce_bytes"] > 0 and r["rs_collective_bytes"] == 0, (key, r)
    losses = data["per_rank"][0]["llama3_8b/training"]["fsdp2"]["losses"]
    assert len(losses) == 2 and losses != data["per_rank"][1]["llama3_8b/training"]["fsdp2"]["losses"]
    out = capfd.readouterr().out  # rank 0's table (a child process)
    assert "llama3_8b/training/ce_rs" in out and "wan_dit/inference/ce" in out


def test_loopback_on_the_host_transport(tmp_path, capsys):
    assert B.main(["--device", "cpu", "--loopback", "--sizes-mib", "0.25", "--calls", "20",
                   "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fsdp2_loopback_cpu.json").read_text())
    r = data["per_size"]["0.25"]
    assert r["exact"] is True and r["ce_us"] > 0 and r["collective_us"] > 0, r
    assert "static hook us/call" in capsys.readouterr().out


def test_loopback_without_a_gpu_says_why(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert B.main(["--loopback", "--out", str(tmp_path / "out")]) == 2
    assert "skipped: needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_arguments():
    a = B.parse_args([])
    assert a.models == list(B.MODELS) and a.variants == list(B.VARIANTS)
    assert B.dit_dims(vars(a)) == dict(dim=5120, heads=40, ffn=13824)
    assert B.dit_dims(dict(dim=256)) == dict(dim=256, heads=2, ffn=688)
    for bad in (["--variants", "ce,fsdp2"], ["--models", "gpt2"]):
        try:
            B.parse_args(bad)
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(bad)
