"""The one compiled piece, the library built from csrc/ (setup.py's SOURCES; csrc/ce_ops.cu
registers its ops): built and loaded against a CUDA torch (by nvcc, or by the host compiler
against CUDA headers of torch's runtime version: NOTE [building without nvcc] in
torch_ce/runtime/toolchain.py), compile-checked (not installed) against a CPU torch.

The install itself runs the compile check on CPU machines with nvcc (dev, CI), so a broken
source fails there; these tests check that the check can fail, what is loaded, and, with a
stand-in torch, every build choice: the arch list, the headers (a version mismatch refused
naming both versions), and the one command that builds the kernels.
"""

import importlib.util
import os
import sys
import types

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
T = S.T  # torch_ce/runtime/toolchain.py, as setup.py loads it
_build_expected = os.environ.get("TORCH_CE_SKIP_CUDA_BUILD", "0") in ("", "0")
requires_nvcc = pytest.mark.skipif(S.find_nvcc() is None, reason="needs nvcc")


def _check(tmp_path, text: str) -> None:
    src = tmp_path / "tu.cpp"
    src.write_text(text)
    flags = S.torch_flags()
    cwd = os.getcwd()
    os.chdir(ROOT)  # the check includes csrc/ relative to the source tree, as setup.py does
    try:
        S.compile_check(S.find_nvcc(), str(src), flags, str(tmp_path / "build"))
    finally:
        os.chdir(cwd)


@requires_nvcc
def test_compile_check_accepts_the_copy_header_with_torch_cuda_headers(tmp_path):
    """ce_copy.h and torch's c10/cuda headers (with the shim a CPU wheel needs) compile
    through nvcc: what the install's check of csrc/ stands on."""
    _check(tmp_path, '#include <c10/cuda/CUDAStream.h>\n#include "ce_copy.h"\n'
                     "bool f() { return torch_ce_copy::batch_supported(); }\n")
    assert (tmp_path / "build" / "ce_torch_check.o").stat().st_size > 0


@requires_nvcc
def test_compile_check_fails_on_a_broken_source(tmp_path):
    with pytest.raises(SystemExit, match="compiling .* with nvcc failed"):
        _check(tmp_path, '#include "ce_copy.h"\n'
                         "int f() { return torch_ce_copy::no_such_function(); }\n")


def test_torch_kernels_follow_the_torch_build():
    """The library of csrc/ links torch's CUDA libraries: built and loaded with a CUDA torch
    (and nvcc), absent with a CPU torch, where CUDA gathers stay on the collective."""
    from torch_ce.runtime import gather, native

    if torch.version.cuda is None or not _build_expected:
        assert native.library_path() is None
        assert not native.load() and native.slot_count() == 0
        with native.split_local_copy_as(False):  # no kernels to push to, never an error
            assert not native.split_local_copy()
    else:
        assert native.library_path() is not None, "csrc/ was not built"
        assert native.load() == (os.environ.get("TORCH_CE_NATIVE", "1") != "0")
        if native.loaded():  # says how it was built, and which row kernel serves
            tool, headers, rows = native.build_info()
            # Headers the build admits: torch's CUDA version, or an older minor of its major
            # (nvcc 13.0 against torch 2.15's CUDA 13.2).
            built = tuple(int(x) for x in headers.split("."))
            assert T.version_problem(built, T.runtime_version(torch), "the build") is None, (
                headers, torch.version.cuda)
            assert rows == ("cuda" if tool == "nvcc" else "none"), (tool, rows)
            assert gather.row_path()[0] == ("cuda" if rows == "cuda" else "triton"), gather.row_path()
            print("kernel path:", gather.kernel_path("cuda"))
    # The Python kernel is reachable under its own name either way.
    assert torch.ops.torch_ce.gather_python.default is not None



def test_compile_check_with_the_host_compiler(tmp_path):
    """The no-nvcc build's compiler: ce_copy.h and torch's c10/cuda headers compile with the
    host C++ compiler against the CUDA runtime headers toolchain.choose_headers picks (of
    torch's CUDA version on a CUDA torch; skipped where none are installed)."""
    h = T.choose_headers(torch, None)
    if not h.dirs or T.find_cxx() is None:
        pytest.skip(f"no CUDA runtime headers with crt/ for the host compiler ({h.problem})")
    src = tmp_path / "tu.cpp"
    src.write_text('#include <c10/cuda/CUDAStream.h>\n#include "ce_copy.h"\n'
                   "bool f() { return torch_ce_copy::batch_supported(); }\n")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        S.compile_check(None, str(src), S.torch_flags(), str(tmp_path / "build"), include_dirs=h.dirs)
    finally:
        os.chdir(cwd)
    assert (tmp_path / "build" / "ce_torch_check.o").stat().st_size > 0


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
    """NOTE [experiment knobs]: TORCH_CE_PEER_ORDER / TORCH_CE_PEER_CHUNK_MIB read once
    (a later change of the environment does nothing), bad values raise, ``peer_order_as``
    and ``split_local_copy_as`` change and restore the previous setting (whether or not the
    kernels are loaded)."""
    from torch_ce.runtime import native

    monkeypatch.setattr(native, "_knobs", {})
    monkeypatch.setattr(native, "_now", {})
    monkeypatch.setenv("TORCH_CE_PEER_ORDER", "fixed")
    monkeypatch.setenv("TORCH_CE_PEER_CHUNK_MIB", "0.25")
    assert native.peer_order() == ("fixed", 2**18)
    monkeypatch.setenv("TORCH_CE_PEER_ORDER", "rotated")  # read once: no effect now
    assert native.peer_order() == ("fixed", 2**18)
    with native.peer_order_as("rotated-member", chunk_mib=0):
        assert native.peer_order() == ("rotated-member", 0)
        with native.peer_order_as(chunk_mib=1e-6):
            assert native.peer_order() == ("rotated-member", 512)
        assert native.peer_order() == ("rotated-member", 0)
    assert native.peer_order() == ("fixed", 2**18)
    with pytest.raises(ValueError, match="peer order"):
        with native.peer_order_as("backwards"):
            pass
    assert native.split_local_copy()
    with native.split_local_copy_as(False):
        with native.split_local_copy_as(True):
            assert native.split_local_copy()
        assert not native.split_local_copy()  # the previous value, not the default
    assert native.split_local_copy()
    good = {"TORCH_CE_PEER_ORDER": "rotated", "TORCH_CE_PEER_CHUNK_MIB": "0"}
    assert native.read_knobs(good) == dict(native=True, order="rotated", chunk_bytes=0)
    assert not native.read_knobs(dict(good, TORCH_CE_NATIVE="0"))["native"]
    for env, bad in (("TORCH_CE_PEER_ORDER", "reverse"), ("TORCH_CE_PEER_CHUNK_MIB", "-1"),
                     ("TORCH_CE_PEER_CHUNK_MIB", "lots")):
        with pytest.raises(ValueError, match=env):
            native.read_knobs(dict(good, **{env: bad}))


def _csrc(*exts):
    return sorted(f"csrc/{n}" for n in os.listdir(os.path.join(ROOT, "csrc")) if n.endswith(exts))


def _read(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def test_no_getenv_in_the_gather():
    """No knob is read from the environment in C++ (NOTE [experiment knobs]: Python reads
    them once and pushes them)."""
    for rel in _csrc(".cu", ".cpp", ".h"):
        assert "getenv" not in _read(rel), rel


def test_setup_builds_every_source_of_csrc():
    """Every csrc/ source is in setup.py's lists, so the install builds it (nvcc: all of
    SOURCES; the host compiler: HOST_SOURCES) and compile-checks it against a CPU torch (CI's
    leg of the README's install), and a change of any header rebuilds. The host sources hold
    no device code (the host compiler reads them as C++); the kernels are only in
    KERNEL_SOURCES; the ops are registered in one file, ce_ops.cu; no file of csrc/ grows past
    800 lines (split by concern instead)."""
    assert sorted(S.SOURCES) == _csrc(".cu", ".cpp"), (S.SOURCES, _csrc(".cu", ".cpp"))
    assert sorted(S.HEADERS) == _csrc(".h"), (S.HEADERS, _csrc(".h"))
    assert set(S.HOST_SOURCES) | set(S.KERNEL_SOURCES) == set(S.SOURCES)
    assert not set(S.HOST_SOURCES) & set(S.KERNEL_SOURCES)
    # Link order is static construction order: the event pool (ce_gather.cu) outlives the
    # reduce-scatter's handle maps (ce_reduce_scatter.cu), whose calls return events at exit;
    # the op registrations are built last.
    assert S.SOURCES.index("csrc/ce_gather.cu") < S.SOURCES.index("csrc/ce_reduce_scatter.cu")
    assert S.HOST_SOURCES[-1] == S.TORCH_SOURCE
    for rel in S.HOST_SOURCES:
        src = _read(rel)
        assert "__global__" not in src and "<<<" not in src, f"{rel}: device code in a host source"
    for rel in S.KERNEL_SOURCES:
        assert "__global__" in _read(rel), rel
    registers = [rel for rel in S.SOURCES if "TORCH_LIBRARY" in _read(rel)]
    assert registers == [S.TORCH_SOURCE] == ["csrc/ce_ops.cu"], registers
    for rel in _csrc(".cu", ".cpp", ".h"):
        lines = _read(rel).count("\n")
        assert lines <= 800, f"{rel}: {lines} lines (at most 800: split it by concern)"


# ---------------------------------------------------------------------------------------
# Build choices, with a stand-in torch (no GPU, no CUDA toolkit needed)
# ---------------------------------------------------------------------------------------


def _fake_torch(tmp_path, cuda="13.0", caps=(), arch_list=()):
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True, exist_ok=True)
    cuda_mod = types.SimpleNamespace(
        is_available=lambda: bool(caps), device_count=lambda: len(caps),
        get_device_capability=lambda i: caps[i], get_arch_list=lambda: list(arch_list))
    return types.SimpleNamespace(__file__=str(site / "torch" / "__init__.py"), __version__="2.11.0",
                                 version=types.SimpleNamespace(cuda=cuda), cuda=cuda_mod)


def _headers(root, version: int, crt: bool = True):
    """A CUDA header set: cuda_runtime_api.h of CUDART_VERSION ``version`` (+ crt/)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cuda_runtime_api.h").write_text(f"#pragma once\n#define CUDART_VERSION  {version}\n")
    if crt:
        (root / "crt").mkdir(exist_ok=True)
        (root / "crt" / "host_defines.h").write_text("#pragma once\n")
    return str(root)


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """Only the stand-in's site dir and no system toolkit are looked at."""
    monkeypatch.setattr(T, "_site_dirs", lambda torch: [str(tmp_path / "site")])
    monkeypatch.setattr(T, "TOOLKIT_ROOTS", ())
    return tmp_path


# The guard at the top of ATen/ATen.h, as each torch writes it.
_GUARD_2_13 = """#pragma once

#if !defined(_MSC_VER) && __cplusplus < 201703L
#error C++17 or later compatible compiler is required to use ATen.
#endif
"""
_GUARD_2_15 = """#pragma once

// MSVC keeps __cplusplus at 199711L unless /Zc:__cplusplus is passed, so check
#if (defined(_MSVC_LANG) && _MSVC_LANG < 202002L) || \\
    (!defined(_MSVC_LANG) && __cplusplus < 202002L)
#error C++20 or later compatible compiler is required to use ATen.
#endif
"""
# What each supported torch's headers ask for (NOTE [the C++ standard follows torch's
# headers]); every CI leg checks its own torch against this.
CXX_STANDARD = {(2, 11): "c++17", (2, 13): "c++17", (2, 14): "c++20", (2, 15): "c++20"}


def test_cxx_standard_is_read_from_the_headers_guard(tmp_path):
    """The standard named by the ``#error`` guard of the headers the build compiles against:
    C++17 in 2.13's form, C++20 in 2.15's (its ``#if`` rewritten), C++20 with no guard."""
    torch_ = _fake_torch(tmp_path)
    assert T.cxx_standard(torch_)[0] == "c++20"  # no headers at all
    aten = tmp_path / "site" / "torch" / "include" / "ATen"
    aten.mkdir(parents=True)
    (aten / "ATen.h").write_text(_GUARD_2_13)
    std, where = T.cxx_standard(torch_)
    assert std == "c++17" and str(aten / "ATen.h") in where, (std, where)
    (aten / "ATen.h").write_text(_GUARD_2_15)
    assert T.cxx_standard(torch_)[0] == "c++20"
    (aten / "ATen.h").write_text("#pragma once\n")
    assert T.cxx_standard(torch_)[0] == T.DEFAULT_CXX_STANDARD


def test_cxx_standard_of_this_torch():
    """This torch's headers ask for the standard its release is known to need (C++17 on 2.11
    and 2.13, C++20 on 2.14 and 2.15), and every compile of csrc/ (nvcc, host compiler,
    compile check: setup.torch_flags) passes it."""
    std, where = T.cxx_standard(torch)
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if release in CXX_STANDARD:
        assert std == CXX_STANDARD[release], (torch.__version__, std, where)
    else:
        assert std in ("c++17", "c++20", "c++23"), (torch.__version__, std, where)
    assert f"-std={std}" in S.torch_flags(torch)


def test_arch_list_comes_from_the_visible_gpus(tmp_path):
    """No TORCH_CE_CUDA_ARCH: the visible GPUs' capabilities (an H200 and a B200: 90 and
    100), else TORCH_CUDA_ARCH_LIST, else torch's own arch list, else nvcc's default."""
    env = {}
    h200_b200 = _fake_torch(tmp_path, caps=[(10, 0), (9, 0), (9, 0)], arch_list=["sm_80"])
    assert T.default_arch_list(h200_b200, env) == (["90", "100"], "the visible GPU(s)")
    assert T.default_arch_list(_fake_torch(tmp_path, caps=[(8, 0)]), env)[0] == ["80"]  # A100
    no_gpu = _fake_torch(tmp_path, arch_list=["sm_80", "sm_90", "sm_100", "compute_120"])
    assert T.default_arch_list(no_gpu, env) == (["80", "90", "100"], "torch.cuda.get_arch_list()")
    assert T.default_arch_list(no_gpu, {"TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX"}) == (["80", "90"], "TORCH_CUDA_ARCH_LIST")
    assert T.default_arch_list(h200_b200, {"TORCH_CE_CUDA_ARCH": "9.0 10.0"}) == (["90", "100"], "TORCH_CE_CUDA_ARCH")
    assert T.default_arch_list(_fake_torch(tmp_path), env)[0] == []
    assert T.gencode_flags(["90", "100"]) == ["-gencode", "arch=compute_90,code=sm_90", "-gencode",
                                              "arch=compute_100,code=sm_100", "-gencode",
                                              "arch=compute_100,code=compute_100"]
    assert T.gencode_flags([]) == []
    with pytest.raises(ValueError, match="bad CUDA arch"):
        T.parse_arch_list("hopper")
    with pytest.raises(SystemExit, match="TORCH_CE_CUDA_ARCH"):
        S.gencode_flags("90;x")


def test_headers_of_another_cuda_version_are_refused_naming_both(isolated):
    """CUDA 12.8 headers (triton's bundle) against a 13.0 runtime: refused at build time,
    the message naming both versions and the wheel that brings matching crt/ headers."""
    torch13 = _fake_torch(isolated)
    triton = _headers(isolated / "triton_include", 12080)
    h = T.choose_headers(torch13, None, {"TORCH_CE_CUDA_INCLUDE": triton})
    assert h.dirs == [] and "CUDA 12.8" in h.problem and "CUDA 13.0" in h.problem, h
    assert "nvidia-cuda-crt==13.0.*" in h.problem, h
    # A newer minor than the runtime's is refused too; an older one of the same major is not.
    assert T.version_problem((13, 1), (13, 0), "x") is not None
    assert T.version_problem((13, 0), (13, 2), "x") is None
    assert T.version_problem((12, 8), None, "x") is None  # a CPU torch links nothing


def test_headers_from_the_torch_wheels_and_an_older_nvcc_passed_over(isolated):
    """torch's CUDA 13 wheels hold cuda_runtime_api.h but not crt/ (a problem, with the
    fix); with nvidia-cuda-crt installed beside them they build. A system nvcc of CUDA 12.8
    is passed over for them, and a matching nvcc is chosen first."""
    torch13 = _fake_torch(isolated)
    wheels = isolated / "site" / "nvidia" / "cu13" / "include"
    _headers(wheels, 13000, crt=False)
    h = T.choose_headers(torch13, None, {})
    assert h.dirs == [] and "crt/host_defines.h" in h.problem and "nvidia-cuda-crt==13.0.*" in h.problem, h
    _headers(wheels, 13000)
    h = T.choose_headers(torch13, None, {})
    assert h.dirs == [str(wheels)] and not h.nvcc and "CUDA 13 wheels" in h.where, h
    old = isolated / "cuda-12.8"
    _headers(old / "include", 12080)
    (old / "bin").mkdir()
    nvcc = old / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    assert T.choose_headers(torch13, str(nvcc), {}).dirs == [str(wheels)]
    new = isolated / "cuda-13.0"
    _headers(new / "include", 13000)
    (new / "bin").mkdir()
    assert T.choose_headers(torch13, str(new / "bin" / "nvcc"), {}).nvcc
    # Nothing at all: the problem names the runtime and the wheel.
    T._site_dirs = lambda torch: []  # (monkeypatched by the fixture: restored after)
    h = T.choose_headers(torch13, None, {})
    assert h.dirs == [] and "no CUDA 13.0 runtime headers" in h.problem and "nvidia-cuda-crt" in h.problem, h


def test_the_one_command_that_builds_the_kernels(isolated):
    """explain() and the bind-time warning name one command: this interpreter's pip (never a
    bare `pip`, which may belong to another Python) on the source tree, after the crt/
    headers' wheel when no matching headers are there."""
    torch13 = _fake_torch(isolated)
    pkg = os.path.join(ROOT, "torch_ce")
    py = sys.executable
    install = f"{py} -m pip install --no-build-isolation --no-deps -e {os.path.abspath(ROOT)}"
    env = {"PATH": ""}  # no nvcc
    assert T.build_command(torch13, pkg, environ=env) == f"{py} -m pip install 'nvidia-cuda-crt==13.0.*' && {install}"
    _headers(isolated / "site" / "nvidia" / "cu13" / "include", 13000)
    assert T.build_command(torch13, pkg, environ=env) == install
    cpu = _fake_torch(isolated, cuda=None)
    assert T.build_command(cpu, pkg, environ=env) == f"install a CUDA build of torch (>= 2.11), then: {install}"
    assert T.crt_wheel((12, 8)) == "nvidia-cuda-nvcc-cu12==12.8.*"
    # The runtime's wording: the warning and explain() carry the same command.
    from torch_ce.runtime import native

    assert native.build_command().startswith(f"{py} -m pip install") or "then:" in native.build_command()


def test_setup_fails_loudly_without_bdist_wheel(monkeypatch):
    """A setuptools older than 70.1 without the wheel package (what torch 2.11 leaves in a new
    venv) cannot install without build isolation: setup.py says which package to add instead
    of setuptools' "invalid command 'bdist_wheel'"."""
    S.require_bdist_wheel()  # this environment can
    monkeypatch.setitem(sys.modules, "setuptools.command.bdist_wheel", None)  # setuptools < 70.1
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wheel" else real(name, *a))
    with pytest.raises(SystemExit, match=r"no bdist_wheel .* -m pip install wheel"):
        S.require_bdist_wheel()


def test_setup_fails_loudly_without_torch(monkeypatch):
    """A Python without torch (a `pip` of another interpreter, build isolation) fails the
    install, naming the interpreter, instead of installing nothing in 1 s."""
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(SystemExit, match="cannot import torch with .*--no-build-isolation"):
        S.torch_module()
