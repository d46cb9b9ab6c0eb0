"""Cheap CPU checks of the GPU benchmarks (torch_ce/bench): imports, argument parsing, and
the helpers that need no GPU (results JSON, targets, trace-overlap arithmetic)."""
import json

import pytest

from torch_ce.bench import common as C
from torch_ce.bench import e2e, e2e_report, e2e_variant, ops, ops_report, scaling, trace
from torch_ce.bench import ranks as R


@pytest.mark.parametrize("mod", [ops, e2e, scaling])
def test_help_exits_0(mod, capsys):
    with pytest.raises(SystemExit) as e:
        mod.parse_args(["--help"])
    assert e.value.code == 0
    assert "torch-ce bench" in capsys.readouterr().out


@pytest.mark.parametrize("sub", ["ops", "e2e", "fsdp2", "plot-scaling"])
def test_cli_help_exits_0(sub):
    from torch_ce.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", sub, "--help"])
    assert e.value.code == 0


def test_arg_defaults_and_lists():
    a = ops.parse_args([])
    assert C.parse_list(a.sizes, float) == [1, 4, 16, 64, 256]
    assert a.out == C.DEFAULT_OUT and a.device == "cuda" and not a.no_contention
    b = e2e.parse_args(["--tokens", "1024, 4096", "--trace", "--out", "/tmp/x"])
    assert C.parse_list(b.tokens, int) == [1024, 4096]
    assert b.trace and b.layers == 8 and b.dim == 4096 and b.ffn == 14336 and b.out == "/tmp/x"
    assert e2e.main(["--variants", "nccl,bogus"]) == 2  # rejected before anything launches


def test_write_json_roundtrip(tmp_path):
    p = tmp_path / "sub" / "r.json"
    out = C.write_json(str(p), {"x": 1, "nan": float("nan"), "t": (1, 2), "obj": object}, C.env_info(2))
    d = json.loads(p.read_text())
    assert out == str(p) and d["x"] == 1 and d["t"] == [1, 2] and d["nan"] == "nan"
    env = d["env"]
    assert env["world_size"] == 2 and env["torch"] and env["date"] and isinstance(env["argv"], list)
    assert "torch_ce" in env
    assert not list(p.parent.glob("*.tmp*"))  # atomic write left nothing behind


def test_gpu_tag_and_targets():
    assert C.gpu_tag("NVIDIA H200") == "h200"
    assert C.gpu_tag("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert C.gpu_tag() == "cpu"  # no device set in this process
    t = C.target("lat", 0.5, "<=", 0.65)
    assert t["ok"] is True and "[PASS]" in C.format_target(t)
    assert C.target("bw", 1.1, ">=", 1.2)["ok"] is False
    assert C.target("none", None, ">=", 1.0)["ok"] is None
    s = C.format_table(["a", "bb"], [[1, None], ["xyz", 2]])
    assert s.splitlines()[0].split() == ["a", "bb"] and len(s.splitlines()) == 4


def test_time_stats_cpu():
    calls = []
    st = C.time_stats(lambda: calls.append(1), iters=7, warmup=2)
    assert len(calls) == 9 and st["iters"] == 7 and st["min_ms"] <= st["median_ms"] <= st["max_ms"]
    assert C.time_ms(lambda: None, 3, 0) >= 0


def test_save_png_optional(tmp_path, capsys):
    p = tmp_path / "f.png"

    def draw(plt):
        fig, ax = plt.subplots()
        ax.plot([1, 2], [3, 4])
        return fig

    got = C.save_png(str(p), draw)
    try:
        import matplotlib

        assert matplotlib.__version__
    except ImportError:
        assert got is None and "matplotlib not installed" in capsys.readouterr().out
    else:
        assert got == str(p) and p.stat().st_size > 0


def test_interval_arithmetic():
    assert trace.merge_intervals([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7)]) == [(0, 4), (5, 6)]
    assert trace.union_length([(0, 2), (1, 3), (10, 11)]) == 4
    a = [(0, 10), (20, 30)]
    b = [(5, 25), (8, 9), (29, 40)]
    assert trace.overlap_length(a, b) == pytest.approx(5 + 5 + 1)
    assert trace.overlap_length(a, []) == 0
    assert trace.overlap_length([(0, 1)], [(1, 2)]) == 0


def _x(cat, name, ts, dur, stream, **args):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=0, tid=stream,
                args=dict(stream=stream, **args))


def test_summarize_trace():
    MB = 10**6
    ev = [
        # compute on stream 7: [0,100) and [150,250)
        _x("kernel", "sm90_xmma_gemm_bf16", 0, 100, 7),
        _x("kernel", "triton_poi_fused_add", 150, 100, 7),
        # CE copies on stream 20: [50,120) [110,200) -> union [50,200) = 150us
        _x("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 50, 70, 20, bytes=70 * MB),
        _x("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 110, 90, 20, bytes=90 * MB),
        # a local DtoD copy on the compute stream: not the copy stream
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 260, 10, 7, bytes=MB),
        _x("kernel", "ncclDevKernel_AllGather_RING_LL", 300, 5, 30),
        dict(ph="X", cat="cpu_op", name="aten::mm", ts=0, dur=1000, pid=1, tid=1),
        dict(ph="i", cat="kernel", name="instant", ts=0),
    ]
    s = trace.summarize_trace({"traceEvents": ev}, iterations=2)
    assert s["copy_stream"] == "20" and s["ce_copies"] == 2
    assert s["ce_copy_sum_us"] == 160 and s["ce_copy_busy_us"] == 150
    assert s["ce_copy_busy_us_per_iter"] == 75
    # overlap of [50,200) with kernels not on stream 20: [0,100) u [150,250) u [300,305)
    assert s["overlap_with_compute_us"] == 50 + 50
    assert s["overlap_fraction"] == pytest.approx(100 / 150, abs=1e-4)
    assert s["exposed_copy_us_per_iter"] == 25
    assert s["nccl_kernels"] == 1 and s["kernels"] == 3 and s["kernels_on_copy_stream"] == 0
    assert s["ptop_gbps"] == pytest.approx(160 * MB / 150 / 1e3, rel=1e-3)
    assert s["memcpy_names"]["Memcpy PtoP (Device -> Device)"] == 2
    assert s["copy_streams"]["20"]["PtoP"] == dict(n=2, us=160.0, bytes=160 * MB)
    assert s["copy_streams"]["7"]["DtoD"]["n"] == 1
    assert s["compute_busy_us_per_iter"] == 102.5 and s["gpu_span_us_per_iter"] == 152.5
    # Compute idle: [100,150) while a copy ran, [250,300) without one.
    g = s["compute_gaps"]
    assert g["idle_us_per_iter"] == 50 and g["idle_with_copy_us_per_iter"] == 25
    assert g["gaps_over_20us_per_iter"] == 1
    assert g["largest"] == [[50.0, 50.0, 0, "sm90_xmma_gemm_bf16", "triton_poi_fused_add"],
                            [50.0, 0.0, 0, "triton_poi_fused_add", "ncclDevKernel_AllGather_RING_LL"]]
    empty = trace.summarize_trace({"traceEvents": []})
    assert empty["ce_copies"] == 0 and empty["overlap_fraction"] is None and empty["gpu_span_us_per_iter"] == 0


def test_code_call_counts():
    code = """
        # Topologically Sorted Source Nodes: [redistribute], Original ATen: [_c10d_functional.all_gather_into_tensor]
        torch.ops.magi.ce_bind.default([arg2_1], [2], ['0'], ['arg2_1'])
        buf1 = torch.ops.magi.ce_all_gather.default(arg2_1, 2, '0')
        buf2 = torch.ops.magi.ce_all_gather_coalesced.default([arg3_1, arg4_1], 2, '0')
        assert_size_stride(buf1, (768, 256), (256, 1), 'torch.ops.magi.ce_all_gather.default')
        torch.ops._c10d_functional.all_gather_into_tensor_out.default(arg5_1, 2, '0', out=buf3)
    """
    assert e2e_variant.code_call_counts(code) == dict(
        code_magi_ce_all_gather_calls=2, code_magi_ce_bind_calls=1, code_nccl_all_gather_calls=1)


def test_ops_targets():
    def v(us, gbps):
        return dict(us=us, gbps=gbps)

    res = dict(sizes=[
        dict(mib=1, exact=True, ce1_over_nccl_latency=0.6, nccl=v(44, 1), ce1=v(26, 2)),
        dict(mib=64, exact=True, ce1_over_nccl_bw=1.27, nccl=v(291, 230), ce1=v(229, 294)),
        dict(mib=256, exact=False, errors=dict(ce8="x")),
    ], contention=dict(ce=dict(slowdown=1.046)))
    t = {x["name"]: x["ok"] for x in ops_report.targets(res)}
    assert t["CE1/NCCL latency @ 1 MiB"] is True
    assert t["CE1/NCCL bandwidth @ 64 MiB"] is True and t["CE1 GB/s @ 64 MiB"] is False
    assert t["CE1 GB/s @ 256 MiB"] is None
    assert t["matmul slowdown beside CE"] is False
    assert t["CE exact vs NCCL @ 256 MiB"] is False and t["CE exact vs NCCL @ 1 MiB"] is True
    assert ops._gbps(2, 2**20, 26.5) == pytest.approx(2**20 / 26.5e-6 / 1e9)
    assert ops._iters_for(256 * 2**20, 2, 50) == 16 and ops._iters_for(2**20, 2, 50) == 50


def test_e2e_merge_previous(tmp_path):
    a = vars(e2e.parse_args(["--tokens", "4096"]))
    p = tmp_path / "e2e.json"
    C.write_json(str(p), dict(bench="e2e", args=dict(a, tokens="1024"), world_size=2,
                              results={"1024": {"tokens": 1024, "nccl": {"ms": 14.9}}}), {"date": "d0"})
    r = dict(args=a, world_size=2, results={})
    e2e_report.merge_previous(str(p), r, [4096])
    assert r["results"]["1024"]["nccl"]["ms"] == 14.9 and r["results"]["1024"]["from_previous_run"] == "d0"
    r2 = dict(args=dict(a, dim=1024), world_size=2, results={})
    e2e_report.merge_previous(str(p), r2, [4096])  # another model: nothing kept
    assert r2["results"] == {}
    r3 = dict(args=a, world_size=2, results={})
    e2e_report.merge_previous(str(p), r3, [1024])  # re-measured: nothing kept
    assert r3["results"] == {}


def test_short_error():
    try:
        raise ValueError("boom " * 10)
    except ValueError as e:
        s = C.short_error(e, limit=300)
    assert s.startswith("ValueError: boom") and len(s) <= 320


def test_agree_errors_single_process():
    assert R.agree_errors(None) is None
    assert R.agree_errors("boom") == "[rank 0] boom"
    assert R.exchange({"a": 1}) == [{"a": 1}]


def test_compare_tolerances():
    import torch

    ref = torch.tensor([5.75, 0.01, -2.0, 0.0], dtype=torch.bfloat16)
    ulp = ref.clone()
    ulp[1] += 0.046875  # about one bf16 ulp at the largest magnitude, on a small element
    c = e2e_report.compare(ulp, ref)
    assert not c["equal"] and not c["allclose"] and c["within_bf16_tol"] and c["finite"]
    wrong = ref.clone()
    wrong[2] = 2.0  # a wrong shard: O(max|ref|)
    c = e2e_report.compare(wrong, ref)
    assert not c["within_bf16_tol"] and c["max_abs_diff"] == 4.0
    assert e2e_report.compare(ref, ref)["equal"]


def _rank_exchange(rank, world):
    import torch.distributed as dist

    def pickled(*a, **k):
        raise AssertionError("all_gather_object pickles through numpy")

    dist.all_gather_object = dist.distributed_c10d.all_gather_object = pickled
    sg = R.status_group()
    obj = dict(rank=rank, t=(rank, "é" * (5 + 40 * rank)), none=None, ok=rank == 0)
    return R.exchange(obj, sg), R.agree_errors("boom" if rank == 1 else None, sg)


def test_exchange_two_ranks():
    """JSON over uint8 tensors, payloads of different lengths (non-ASCII), no pickle."""
    from mp_harness import run_ranks

    for everyone, err in run_ranks(_rank_exchange, 2, timeout=60):
        assert everyone == [dict(rank=r, t=[r, "é" * (5 + 40 * r)], none=None, ok=r == 0) for r in range(2)]
        assert err == "[rank 1] boom"


def _ops_json(path, world, sizes):
    """A results file shaped like ops_h200_w2.json: per size, us and GB/s per variant."""
    entries = []
    for mib, per in sizes.items():
        e = dict(mib=mib, errors={}, exact=True)
        for v, gbps in per.items():
            e[v] = dict(us=round((world - 1) * mib * 2**20 / (gbps * 1e3), 2), gbps=gbps)
        entries.append(e)
    C.write_json(str(path), dict(bench="ops", world_size=world, sizes=entries), dict(world_size=world))


def test_plot_scaling(tmp_path, capsys):
    _ops_json(tmp_path / "ops_h200_w2.json", 2, {1: dict(nccl=51.0, ce1=67.0), 64: dict(nccl=230.0, ce1=337.0)})
    _ops_json(tmp_path / "ops_h200_w4.json", 4, {1: dict(nccl=79.0, ce1=152.0, ce1_fixed=140.0),
                                                 64: dict(nccl=303.0, ce1=340.0, ce1_fixed=224.0),
                                                 256: dict(ce1=350.0)})
    _ops_json(tmp_path / "run6_ops_h200_w8.json", 8, {1: dict(ce1=1.0)})  # an old run: left out
    (tmp_path / "ops_h200_w8.json").write_text(json.dumps(dict(world_size=8, sizes=[dict(mib=1, errors={"x": "y"})])))
    lines = scaling.series(scaling.load(str(tmp_path), "h200"))
    got = {(ln["world"], ln["transport"]): list(zip(ln["mib"], ln["gbps"], strict=True)) for ln in lines}
    assert got == {(2, "nccl"): [(1, 51.0), (64, 230.0)], (2, "ce1"): [(1, 67.0), (64, 337.0)],
                   (4, "nccl"): [(1, 79.0), (64, 303.0)], (4, "ce1"): [(1, 152.0), (64, 340.0), (256, 350.0)],
                   (4, "ce1_fixed"): [(1, 140.0), (64, 224.0)]}
    rc = scaling.main(["--results", str(tmp_path)])
    png = tmp_path / "ops_scaling_h200.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rc == 1 and not png.exists() and "matplotlib not installed" in capsys.readouterr().out
    else:
        assert rc == 0 and png.stat().st_size > 0
    assert scaling.main(["--results", str(tmp_path), "--gpu", "h100"]) == 1  # nothing to plot


def test_peer_order_variants():
    """bench ops' A/B variants pin their order (the library's may come from the environment)."""
    v = ops.order_variants(1.0)
    assert v["ce1_fixed"] == ("ce1", dict(order="fixed", chunk_mib=0))
    assert v["ce8_member"] == ("ce8", dict(order="rotated-member", chunk_mib=0))
    assert v["ce8_chunk"] == ("ce8", dict(order="rotated", chunk_mib=1.0))
    assert set(ops.order_variants(0)) == {"ce1_fixed", "ce8_fixed", "ce8_member"}
    a = dict(peer_chunk_mib=2.0)
    assert e2e_variant.peer_order_of("ce_fixed", a) == dict(order="fixed", chunk_mib=0)
    assert e2e_variant.peer_order_of("ce_chunk_cg", a) == dict(order="rotated", chunk_mib=2.0)
    assert e2e_variant.peer_order_of("ce", a) == {} and e2e_variant.peer_order_of("nccl", a) == {}
    assert not e2e_variant.split_local_of("ce_inbatch") and not e2e_variant.split_local_of("ce_inbatch_cg")
    assert e2e_variant.split_local_of("ce") and e2e_variant.split_local_of("ce_chunk")


def test_ops_summary_prints_the_peer_order_ab(capsys):
    rec = lambda us, gbps: dict(us=us, gbps=gbps, us_issue=us, cpu_enqueue_us_per_call=1.0)  # noqa: E731
    e = dict(mib=64, errors={}, exact=True, kernel="C++", peer_order=["rotated", 0],
             nccl=rec(664.0, 303.0), ce1=rec(600.0, 335.0), ce8=rec(610.0, 330.0),
             ce1_fixed=rec(901.0, 224.0), ce8_member=rec(615.0, 327.0), ce1_over_fixed_bw=1.502)
    ops_report.print_summary(dict(sizes=[e], args=dict(peer_chunk_mib=1.0), targets=[]), 4)
    out = capsys.readouterr().out
    ab = out[out.index("peer order A/B"):]
    assert "['rotated', 0]" in ab and "901.0 / 224" in ab and "1.502" in ab and "615.0 / 327" in ab


@pytest.mark.parametrize("sub", ["ops", "e2e", "train", "fsdp2"])
def test_bench_on_fewer_than_two_gpus_exits_with_one_line(sub, tmp_path, capsys, monkeypatch):
    """Without 2 GPUs (and no --device cpu) a bench refuses in one line and writes nothing:
    one rank would time nothing and write an empty JSON / PNG."""
    from torch_ce.cli import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(R, "default_nprocs", lambda backend: 1 if backend == "nccl" else 2)
    assert main(["bench", sub, "--out", str(tmp_path / "out")]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1, cap
    assert f"torch-ce bench {sub}: needs 2 or more GPUs, found 1" in cap.err
    assert not (tmp_path / "out").exists()
    # One rank asked for by hand, on any device: refused the same way.
    assert main(["bench", sub, "--device", "cpu", "--nprocs", "1", "--out", str(tmp_path / "out")]) == 2
    assert "needs 2 or more ranks, got 1" in capsys.readouterr().err
