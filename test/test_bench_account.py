"""The per-gather account of ``bench e2e --trace`` (torch_ce/bench/account.py, timeline.py)
on small synthetic Chrome traces whose numbers are worked out by hand in the comments."""
import json

from torch_ce.bench import account as A
from torch_ce.bench import timeline

MB = 10**6


def _x(cat, name, ts, dur, tid=1, **args):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=0, tid=tid, args=args)


def _gpu(cat, name, ts, dur, stream, corr, **args):
    return _x(cat, name, ts, dur, tid=stream, stream=stream, correlation=corr, **args)


def _kernels(durs, launches=None, starts=None):
    """Compute kernels on stream 7 (launched on the CPU thread, correlations 200...)."""
    ev = []
    for j, (name, dur) in enumerate(durs):
        if launches:
            ev.append(_x("cuda_driver", "cuLaunchKernelEx", launches[j], 2, correlation=200 + j))
        ev.append(_gpu("kernel", name, starts[j] if starts else 10 * j, dur, 7, 200 + j))
    return ev


NAMES = ["embedding", "gemm_qkv", "gemm_o", "triton_late"]


def ce_trace():
    """One iteration [0, 1000) on the CPU. Gather 0 (peer reads [100, 300), 64 MB; own rows
    [100, 150)) and gather 1 (peer reads [300, 400), 30 MB). Compute on stream 7:
    embedding [60, 90) launched at 50; gemm_qkv [310, 360) launched at 70: idle 90..310,
    held by gather 0 (ends 300): exposed 300 - 90 = 210; gemm_o [405, 505) launched at 80:
    idle 360..405, held by gather 1 (ends 400): 40; triton_late [610, 640) launched at 600:
    idle 505..610 is CPU issue (95 us from 505 to 600), no gather ends in (600, 610]."""
    return [
        _x("user_annotation", "torch_ce_iter0", 0, 1000),
        _x("cpu_op", "magi::ce_all_gather", 10, 20),
        _x("cuda_runtime", "cudaMemcpyBatchAsync", 15, 2, correlation=100),
        _x("cuda_runtime", "cudaMemcpyBatchAsync", 20, 2, correlation=101),
        _gpu("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 100, 200, 20, 100, bytes=64 * MB),
        _gpu("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 100, 50, 21, 101, bytes=64 * MB),
        _x("cpu_op", "magi::ce_all_gather_coalesced", 40, 8),
        _x("cuda_runtime", "cudaMemcpyBatchAsync", 45, 2, correlation=102),
        _gpu("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 300, 100, 20, 102, bytes=30 * MB),
        _x("cpu_op", "aten::mm", 0, 900),  # not a gather
        *_kernels(zip(NAMES, [30, 50, 100, 30], strict=True), launches=[50, 70, 80, 600], starts=[60, 310, 405, 610]),
    ]


def bound_trace():
    """The same kernels without communication; gemm_qkv takes 40 us instead of 50."""
    return [_x("user_annotation", "torch_ce_iter0", 0, 500),
            *_kernels(zip(NAMES, [30, 40, 100, 30], strict=True), launches=[1, 2, 3, 4])]


def test_ce_account_by_hand():
    acct = A.account(A.compact({"traceEvents": ce_trace()}), ["L0 wqkv", "L0 wo+L0 w1"],
                     A.compact({"traceEvents": bound_trace()}))
    g0, g1 = acct["gathers"][0]
    assert (g0["label"], g0["bytes"], g0["copy_us"], g0["gbps"]) == ("L0 wqkv", 64 * MB, 200.0, 320.0)
    assert (g0["start_us"], g0["end_us"], g0["exposed_us"], g0["consumer"]) == (100.0, 300.0, 210.0, "gemm_qkv")
    assert (g1["label"], g1["bytes"], g1["copy_us"], g1["gbps"]) == ("L0 wo+L0 w1", 30 * MB, 100.0, 300.0)
    assert (g1["exposed_us"], g1["consumer"]) == (40.0, "gemm_o")
    # Only gemm_qkv [310, 360) runs beside a copy (gather 1's [300, 400)): 50 us vs 40 in bound.
    assert (g1["compute_under_us"], g1["compute_under_bound_us"], g1["slowdown"]) == (50.0, 40.0, 1.25)
    assert g0["slowdown"] is None  # no kernel ran beside gather 0's copies
    it = acct["iterations"][0]
    assert acct["compute_stream"] == "7" and it["kernels"] == 4 and it["kernels_unmatched"] == 0
    assert (it["idle_us"], it["issue_us"], it["exposed_us"]) == (60 + 220 + 45 + 105, 50 + 95, 250.0)
    assert (it["span_us"], it["compute_us"], it["copy_us"]) == (640.0, 210.0, 300.0)
    assert (it["slowdown_under_copy"], it["slowdown_not_under"]) == (1.25, 1.0)
    gaps = acct["gaps"][0]
    assert [(g["at_us"], g["us"], g["issue_us"], g["wait_us"], g["gather"]) for g in gaps] == [
        (0.0, 60.0, 50.0, 0.0, None), (90.0, 220.0, 0.0, 210.0, "L0 wqkv"),
        (360.0, 45.0, 0.0, 40.0, "L0 wo+L0 w1"), (505.0, 105.0, 95.0, 0.0, None)]
    # Gather 0's own rows [100, 150) lie inside the idle gap 90..310: 50 us beside own rows.
    assert [g["beside_own_rows_us"] for g in gaps] == [0.0, 50.0, 0.0, 0.0]
    assert it["idle_beside_own_rows_us"] == 50.0
    assert acct["uncorrelated_copies"] == 0
    # Labels that do not fit the ops (another graph's code): numbered instead.
    assert [g["label"] for g in A.account(A.compact({"traceEvents": ce_trace()}), ["x"])["gathers"][0]] == [
        "gather 0", "gather 1"]


def nccl_trace():
    """An NCCL gather of 1e6 bf16 elements at world 2 (0.5e6 * 2 bytes from the peer),
    kernel [100, 200) on stream 30, longer than the compute: still not the compute stream.
    The gemm, launched at 40, starts at 210: exposed 200 - 40 = 160."""
    return [
        _x("user_annotation", "torch_ce_iter0", 0, 300),
        _x("cpu_op", "_c10d_functional::all_gather_into_tensor", 10, 20),
        _x("cpu_op", "record_param_comms", 12, 10, **{"Out msg nelems": 10**6, "dtype": "BFloat16",
                                                     "Group size": 2}),
        _x("cuda_runtime", "cudaLaunchKernel", 15, 2, correlation=300),
        _gpu("kernel", "ncclDevKernel_AllGather_RING_LL", 100, 100, 30, 300),
        *_kernels([("gemm", 50)], launches=[40], starts=[210]),
    ]


def test_nccl_account_by_hand():
    acct = A.account(A.compact({"traceEvents": nccl_trace()}))
    (g,) = acct["gathers"][0]
    assert (g["bytes"], g["copy_us"], g["gbps"], g["exposed_us"]) == (10**6, 100.0, 10.0, 160.0)
    assert acct["compute_stream"] == "7" and acct["iterations"][0]["slowdown_under_copy"] is None
    assert acct["iterations"][0]["idle_beside_own_rows_us"] == 0.0  # NCCL copies no own rows apart


def test_timeline_files(tmp_path):
    traced = {2048: {"ce": dict(events=A.compact({"traceEvents": ce_trace()}), labels=["L0 wqkv", "L0 wo+L0 w1"]),
                     "nccl": dict(events=A.compact({"traceEvents": nccl_trace()})),
                     "bound": dict(events=A.compact({"traceEvents": bound_trace()}))}}
    path, png = timeline.write(str(tmp_path), traced, 2, "llama3_8b")
    assert path.endswith("account_llama3_8b_2.json")
    d = json.loads(open(path).read())
    assert set(d["tokens"]["2048"]) == {"ce", "nccl"} and d["world_size"] == 2
    assert d["tokens"]["2048"]["ce"]["gathers"][0][0]["exposed_us"] == 210.0
    rows = A.timeline_rows(traced[2048]["ce"]["events"], d["tokens"]["2048"]["ce"], 0)
    assert rows["exposed"] == [(90.0, 210.0), (360.0, 40.0)]
    assert rows["lanes"] == {"peer reads": [(100.0, 200.0), (300.0, 100.0)], "own rows": [(100.0, 50.0)]}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert png is None
    else:
        assert png.endswith("timeline_llama3_8b_2.png") and (tmp_path / "timeline_llama3_8b_2.png").stat().st_size


def test_short_label():
    assert timeline.short_label(["layers.3.feed_forward.w1.weight"]) == "L3 w1"
    assert timeline.short_label(["tok_embeddings.weight", "layers.0.attention_norm.weight"]) == \
        "tok_embeddings+L0 attention_norm"


def test_gather_args_in_code_order():
    from torch_ce.bench import e2e_variant

    code = """
        buf1 = torch.ops.magi.ce_all_gather.default(arg2_1, 2, '0')
        buf2 = torch.ops.magi.ce_all_gather_coalesced.default([arg3_1, arg4_1], 2, '0')
        assert_size_stride(buf1, (8, 4), (4, 1), 'torch.ops.magi.ce_all_gather.default')
        torch.ops._c10d_functional.all_gather_into_tensor_out.default(arg5_1, 2, '0', out=buf3)
    """
    assert e2e_variant.gather_args(code) == [["arg2_1"], ["arg3_1", "arg4_1"], ["arg5_1"]]
