"""The one compiled piece, csrc/ce_torch.cpp: built and loaded against a CUDA torch,
compile-checked (not installed) against a CPU torch with nvcc, absent without nvcc.

The install itself runs the compile check on CPU machines with nvcc (dev, CI), so a broken
source fails there; these tests check that the check can fail, and what is loaded.
"""

import importlib.util
import os

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _setup_module():
    """setup.py's helpers (its ``setup()`` call runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("torch_ce_setup", os.path.join(ROOT, "setup.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


S = _setup_module()
_build_expected = S.find_nvcc() is not None and os.environ.get("TORCH_CE_SKIP_CUDA_BUILD", "0") in ("", "0")
requires_nvcc = pytest.mark.skipif(S.find_nvcc() is None, reason="needs nvcc")


def _check(tmp_path, text: str) -> None:
    src = tmp_path / "tu.cpp"
    src.write_text(text)
    flags, _ = S.torch_flags()
    cwd = os.getcwd()
    os.chdir(ROOT)  # the check includes csrc/ relative to the source tree, as setup.py does
    try:
        S.compile_check(S.find_nvcc(), str(src), flags, str(tmp_path / "build"))
    finally:
        os.chdir(cwd)


@requires_nvcc
def test_compile_check_accepts_the_copy_header_with_torch_cuda_headers(tmp_path):
    """ce_copy.h and torch's c10/cuda headers (with the shim a CPU wheel needs) compile
    through nvcc: what the install's check of ce_torch.cpp stands on."""
    _check(tmp_path, '#include <c10/cuda/CUDAStream.h>\n#include "ce_copy.h"\n'
                     "bool f() { return torch_ce_copy::batch_supported(); }\n")
    assert (tmp_path / "build" / "ce_torch_check.o").stat().st_size > 0


@requires_nvcc
def test_compile_check_fails_on_a_broken_source(tmp_path):
    with pytest.raises(SystemExit, match="compiling .* with nvcc failed"):
        _check(tmp_path, '#include "ce_copy.h"\n'
                         "int f() { return torch_ce_copy::no_such_function(); }\n")


def test_torch_kernels_follow_the_torch_build():
    """csrc/ce_torch.cpp links torch's CUDA libraries: built and loaded with a CUDA torch
    (and nvcc), absent with a CPU torch, where CUDA gathers stay on the collective."""
    from torch_ce.runtime import native

    if torch.version.cuda is None or not _build_expected:
        assert native.library_path() is None
        assert not native.load() and native.slot_count() == 0
        native.set_split_local_copy(False)  # a no-op without the kernels, never an error
    else:
        assert native.library_path() is not None, "csrc/ce_torch.cpp was not built"
        assert native.load() == (os.environ.get("TORCH_CE_NATIVE", "1") != "0")
    # The Python kernel is reachable under its own name either way.
    assert torch.ops.torch_ce.gather_python.default is not None



_PLAN_MAIN = r"""
#include "ce_copy.h"
#include <cstdio>
using namespace torch_ce_copy;
static void show(const char* tag, int rank, int world, const size_t* bytes, size_t members,
                 size_t chunk, int order, bool own) {
  std::printf("%s %d %d", tag, world, rank);
  for (const auto& p : read_plan(rank, world, bytes, members, chunk, order, own))
    std::printf(" %d:%zu:%zu:%zu", p.source, p.member, p.offset, p.size);
  std::printf("\n");
}
int main() {
  const size_t one = 1024;
  for (int w : {2, 4, 8})
    for (int r = 0; r < w; ++r) {
      show("rotated", r, w, &one, 1, 0, kRotated, false);
      show("fixed", r, w, &one, 1, 0, kFixed, false);
    }
  const size_t two[2] = {1024, 1536};
  show("peer_major", 1, 3, two, 2, 0, kRotated, false);
  show("member_major", 1, 3, two, 2, 0, kRotatedMember, false);
  show("chunked", 1, 3, two, 2, 1024, kRotated, false);
  show("fixed_own", 1, 3, two, 2, 0, kFixed, true);
}
"""


@requires_nvcc
def test_read_plan_of_the_cpp_gather(tmp_path):
    """csrc/ce_copy.h's read_plan, the submission order of the C++ gather (NOTE [peer
    order]), built and run on the host: its peer order is the Python fallback's
    (``gather.peer_order``) at every world size, rotated by default; and peer-major,
    member-major, chunked and fixed plans of a two-member bucket are as documented."""
    import subprocess

    from torch_ce.runtime.gather import peer_order

    src, exe = tmp_path / "plan.cpp", tmp_path / "plan"
    src.write_text(_PLAN_MAIN)
    subprocess.run([S.find_nvcc(), f"-I{os.path.join(ROOT, 'csrc')}", "-o", str(exe), str(src)], check=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    got = {}
    for ln in lines:
        tag, world, rank, *pieces = ln.split()
        got[tag, int(world), int(rank)] = [tuple(int(x) for x in p.split(":")) for p in pieces]
    for world in (2, 4, 8):
        for rank in range(world):
            for order in ("rotated", "fixed"):
                assert [p[0] for p in got[order, world, rank]] == peer_order(rank, world, order)
    assert peer_order(1, 4) == [2, 3, 0] and peer_order(1, 4, "fixed") == [0, 2, 3]
    # Rotated: at each step every rank reads a different peer (no egress serves two).
    for world in (4, 8):
        for k in range(world - 1):
            assert sorted(peer_order(r, world)[k] for r in range(world)) == list(range(world))
    # (source, member, offset, size); rank 1 of 3, members of 1024 and 1536 bytes.
    assert got["peer_major", 3, 1] == [(2, 0, 0, 1024), (2, 1, 0, 1536), (0, 0, 0, 1024), (0, 1, 0, 1536)]
    assert got["member_major", 3, 1] == [(2, 0, 0, 1024), (0, 0, 0, 1024), (2, 1, 0, 1536), (0, 1, 0, 1536)]
    assert got["chunked", 3, 1] == [(2, 0, 0, 1024), (0, 0, 0, 1024), (2, 1, 0, 1024), (0, 1, 0, 1024),
                                    (2, 1, 1024, 512), (0, 1, 1024, 512)]
    assert got["fixed_own", 3, 1] == [(0, 0, 0, 1024), (1, 0, 0, 1024), (2, 0, 0, 1024),
                                      (0, 1, 0, 1536), (1, 1, 0, 1536), (2, 1, 0, 1536)]


def test_peer_order_knobs(monkeypatch):
    """TORCH_CE_PEER_ORDER / TORCH_CE_PEER_CHUNK_MIB: read once, bad values raise,
    ``peer_order_as`` changes and restores them (whether or not the kernels are loaded)."""
    from torch_ce.runtime import native

    monkeypatch.setattr(native, "_peer", {})
    monkeypatch.setenv("TORCH_CE_PEER_ORDER", "fixed")
    monkeypatch.setenv("TORCH_CE_PEER_CHUNK_MIB", "0.25")
    assert native.peer_order() == ("fixed", 2**18)
    monkeypatch.setenv("TORCH_CE_PEER_ORDER", "rotated")  # read once: no effect now
    assert native.peer_order() == ("fixed", 2**18)
    with native.peer_order_as("rotated-member", chunk_mib=0):
        assert native.peer_order() == ("rotated-member", 0)
        with native.peer_order_as(chunk_mib=1e-6):
            assert native.peer_order() == ("rotated-member", 512)
    assert native.peer_order() == ("fixed", 2**18)
    with pytest.raises(ValueError, match="peer order"):
        with native.peer_order_as("backwards"):
            pass
    for env, bad in (("TORCH_CE_PEER_ORDER", "reverse"), ("TORCH_CE_PEER_CHUNK_MIB", "-1"),
                     ("TORCH_CE_PEER_CHUNK_MIB", "lots")):
        monkeypatch.setattr(native, "_peer", {})
        monkeypatch.setenv("TORCH_CE_PEER_ORDER", "rotated")
        monkeypatch.setenv("TORCH_CE_PEER_CHUNK_MIB", "0")
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            native.peer_order()
