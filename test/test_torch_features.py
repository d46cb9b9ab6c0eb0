"""What torch_ce asks of this torch, asked of it (on every CI leg: .ci/legs.sh's fast subset
and the full suite): the Inductor settings torch_ce turns off exist wherever the feature they
switch does (``passes/install.py`` ``_OFF``), the census's ops resolve wherever the module
that makes graphs hold them does (``passes/census.py`` ``CENSUS_OPS``), and an
out-of-process FX compile is refused with a message, not served by nothing."""
from __future__ import annotations

import logging
import types

import pytest
import torch


def test_off_list_settings_exist_where_their_features_do():
    from torch_ce.passes import install

    rows = install.off_list()
    assert [r[0] for r in rows] == [k for k, _, _ in install._OFF]
    renamed = [(k, feature) for k, _, feature, has_setting, has_feat in rows if has_feat and not has_setting]
    assert not renamed, f"torch {torch.__version__} has these features but not the settings that turn them off: {renamed}"
    # The oldest settings are on every supported torch, with their features.
    have = {k: (s, f) for k, _, _, s, f in rows}
    for k in ("reorder_for_locality", "bucket_all_gathers_fx"):
        assert have[k] == (True, True), (k, have[k])


def test_census_ops_resolve():
    from torch_ce.passes import census

    assert census.missing_ops() == [], torch.__version__
    for name, producer in census.CENSUS_OPS.items():
        if producer.startswith("torch.distributed."):  # on every supported torch
            assert census._op(name) is not None, name
    assert census._OUT and census._COALESCED and census._REDUCE_SCATTER


def test_missing_settings_are_said(caplog):
    """A setting this torch lacks: a debug line when the feature is absent too, a warning
    when the feature is here (a rename)."""
    from torch_ce.passes import install

    fake = types.SimpleNamespace(reorder_for_locality=True, aten_distributed_optimizations=types.SimpleNamespace())
    with caplog.at_level(logging.DEBUG, logger="torch_ce"):
        install._say_missing(fake)
    by_level = {r.levelno: [] for r in caplog.records}
    for r in caplog.records:
        by_level[r.levelno].append(r.getMessage())
    warned = " ".join(by_level.get(logging.WARNING, []))
    debug = " ".join(by_level.get(logging.DEBUG, []))
    # bucket_all_gathers_fx's feature (bucketing.bucket_all_gather) is on every supported torch
    assert "no Inductor setting bucket_all_gathers_fx to turn it off" in warned, caplog.text
    assert "reorder_for_locality" not in caplog.text
    for k, _, feature, _, has_feat in install.off_list():
        if k.startswith("aten_distributed_optimizations."):
            assert k in (warned if has_feat else debug), (k, caplog.text)


@pytest.mark.parametrize("mode", ["subprocess", "async+subprocess"])
def test_out_of_process_fx_compile_is_refused(monkeypatch, mode):
    import torch._inductor.compile_fx as cf

    import torch_ce
    from torch_ce.passes import install

    if not hasattr(cf, "FxCompileMode"):
        pytest.skip(f"torch {torch.__version__} has no out-of-process FX compile (compile_fx.FxCompileMode)")
    monkeypatch.setenv("TORCHINDUCTOR_FX_COMPILE_MODE", mode)
    monkeypatch.setattr(cf, "fx_compile_mode", cf.FxCompileMode.SUBPROCESS)
    monkeypatch.setattr(cf, "fx_compile_async", mode.startswith("async"))
    with pytest.raises(RuntimeError, match="compiles FX graphs in a subprocess") as e:
        torch_ce.enable(transport="copy_engine")
    assert mode in str(e.value) and "Unset TORCHINDUCTOR_FX_COMPILE_MODE" in str(e.value)
    assert not install.is_enabled()
    monkeypatch.setattr(cf, "fx_compile_mode", cf.FxCompileMode.NORMAL)
    monkeypatch.setattr(cf, "fx_compile_async", False)
    torch_ce.enable(transport="copy_engine")
    try:
        assert install.is_enabled()
    finally:
        torch_ce.disable()
