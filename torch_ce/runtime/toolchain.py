"""How csrc/ is built: which CUDA headers, which compiler, for which GPUs, and the one
command that builds it.

Read by ``setup.py`` (loaded by file path: the package is not importable while it
installs) and by ``runtime/native.py`` (the "how to build" line of ``explain()`` and of the
bind-time warning). Plain functions over a ``torch`` module and an environment passed in, so
a CPU test can check every choice (test/test_build.py); nothing here imports torch_ce.

# NOTE [building without nvcc]
The gather needs no device code: csrc/'s host sources (setup.py HOST_SOURCES, .cu by the
design card's name, read as C++ with ``-x c++``) are host C++ that calls the CUDA runtime
(``cudaMemcpyBatchAsync``, events, streams). So any host C++ compiler builds them against
torch's headers and CUDA's *runtime* headers, and links torch's libraries and the
``libcudart`` torch already loads. What it needs from CUDA is headers whose version is the
runtime's: CUDA 13 changed ``cudaMemcpyBatchAsync``'s signature (it dropped ``failIdx``),
so 12.8 headers against a 13.0 runtime link and load, and the first gather fails with
"invalid resource handle" (the stream lands in another argument's slot). The build
therefore reads ``CUDART_VERSION`` from the headers it will use and refuses, before
compiling, headers of another major version than ``torch.version.cuda`` or of a newer
minor one (calls the runtime may lack); csrc/ce_native.h repeats the major check with
``#error`` in case the compiler finds another ``cuda_runtime_api.h`` first.

Where the headers come from, first found wins:
  1. ``TORCH_CE_CUDA_INCLUDE`` (a directory, or several joined by ``:``);
  2. with nvcc (a system CUDA toolkit): the toolkit's own include directory;
  3. the CUDA wheels torch's install brought: ``site-packages/nvidia/cu<major>/include``
     (CUDA 13 wheels: ``cuda_runtime_api.h`` from nvidia-cuda-runtime, the ``crt/`` headers
     it includes from nvidia-cuda-crt, which torch does not depend on) or
     ``nvidia/cuda_runtime/include`` + ``nvidia/cuda_nvcc/include`` (CUDA 12 wheels);
  4. ``$CUDA_HOME/include``, ``/usr/local/cuda/include``.
Triton bundles a full header set (``triton/backends/nvidia/include``) but of its own CUDA
version (12.8 in triton 3.6), so it is never picked by default.

Without nvcc the row gather's CUDA kernel (csrc/ce_rows.cu) is not built; the Triton
kernel (runtime/rows_triton.py) serves instead.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys

CRT_HEADER = os.path.join("crt", "host_defines.h")
TOOLKIT_ROOTS = ("/usr/local/cuda",)  # after $CUDA_HOME; a system toolkit's headers
RUNTIME_HEADER = "cuda_runtime_api.h"


# ---------------------------------------------------------------------------------------
# Which GPUs to build for (the CUDA row kernel's SASS; the host-compiled gather has none)
# ---------------------------------------------------------------------------------------


def parse_arch_list(text: str) -> list[str]:
    """``"90;100"``, ``"9.0 10.0+PTX"``, ``"sm_90,sm_100a"`` -> ``["90", "100"]`` (order kept,
    duplicates dropped); anything else raises ValueError."""
    out = []
    for tok in re.split(r"[;,\s]+", text.strip()):
        if not tok:
            continue
        a = tok.removesuffix("+PTX").removeprefix("sm_").removeprefix("compute_").replace(".", "")
        if not re.fullmatch(r"\d+[af]?", a):
            raise ValueError(f"bad CUDA arch {tok!r} in {text!r} (expected e.g. '90' or '9.0;10.0')")
        if a not in out:
            out.append(a)
    return out


def default_arch_list(torch, environ=None) -> tuple[list[str], str]:
    """(archs, where they came from) for the CUDA row kernel: ``TORCH_CE_CUDA_ARCH`` if set,
    else every visible GPU's compute capability (H100/H200 -> 90, A100 -> 80, B200 ->
    100), else ``TORCH_CUDA_ARCH_LIST`` (torch's extension builds' variable), else the
    archs this torch was built for (``torch.cuda.get_arch_list()``); ``[]`` when none says
    (nvcc's default)."""
    environ = os.environ if environ is None else environ
    own = environ.get("TORCH_CE_CUDA_ARCH", "").strip()
    if own:
        return parse_arch_list(own), "TORCH_CE_CUDA_ARCH"
    cuda = getattr(torch, "cuda", None)
    try:
        n = cuda.device_count() if cuda is not None and cuda.is_available() else 0
    except Exception:  # noqa: BLE001 (no driver: fall through to the lists)
        n = 0
    if n:
        caps = [cuda.get_device_capability(i) for i in range(n)]
        names = sorted({f"{a}{b}" for a, b in caps}, key=lambda s: int(s))
        return names, "the visible GPU(s)"
    listed = environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if listed:
        return parse_arch_list(listed), "TORCH_CUDA_ARCH_LIST"
    try:
        built = [a for a in cuda.get_arch_list() if a.startswith("sm_")] if cuda is not None else []
    except Exception:  # noqa: BLE001
        built = []
    if built:
        return parse_arch_list(",".join(built)), "torch.cuda.get_arch_list()"
    return [], "nvcc's default (no GPU visible, no arch list)"


def gencode_flags(archs: list[str]) -> list[str]:
    """SASS for every arch, plus PTX for the highest (forward compatible)."""
    if not archs:
        return []
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    top = max(archs, key=lambda a: int(re.match(r"\d+", a).group()))
    return flags + ["-gencode", f"arch=compute_{top},code=compute_{top}"]


# ---------------------------------------------------------------------------------------
# The C++ standard: the one torch's headers ask for
# ---------------------------------------------------------------------------------------

# NOTE [the C++ standard follows torch's headers]
# torch's headers say which standard they need, in the guard at the top of ATen/ATen.h
# (and torch/all.h): ``#error C++17 or later compatible compiler is required to use ATen.``
# on 2.11 and 2.13, ``#error C++20 ...`` on 2.14 and 2.15, whose headers then use
# std::strong_ordering and std::bit_width. csrc/ is compiled (nvcc, the host compiler, the
# CPU-torch compile check) with the standard that line names, read from the very headers it
# compiles against. The ``#error`` text, not the ``#if`` above it: 2.15 rewrote the
# condition (``_MSVC_LANG`` first) and kept the message. Not the alternatives:
#   - torch.__version__: a table to edit for every release, and a guess for a nightly or a
#     source build, which has new headers before the release number says so;
#   - torch.utils.cpp_extension's flags, or the "C++ Version" of torch.__config__.show():
#     how torch builds its users' extensions and itself (C++20 already on 2.13), not the
#     least its headers accept;
#   - a trial compile: a compiler run per install, and any other error reads as "needs a
#     newer standard".
# The least standard the headers accept keeps the C++17 torches' kernels built as they
# were tested (their headers take C++20 too: torch's own extension builds use it), and
# lets an older compiler build them. No such line (a torch that moves it): C++20, the
# newest any supported torch has asked for.
CXX_GUARD_HEADERS = (os.path.join("ATen", "ATen.h"),
                     os.path.join("torch", "csrc", "api", "include", "torch", "all.h"))
DEFAULT_CXX_STANDARD = "c++20"
_CXX_GUARD = re.compile(r"^\s*#\s*error\s+C\+\+\s*(\d+) or later compatible compiler is required", re.M)


def torch_include_dir(torch) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "include")


def cxx_standard(torch) -> tuple[str, str]:
    """(``"c++17"`` or ``"c++20"``, where it was read) for building against ``torch``'s
    headers (NOTE [the C++ standard follows torch's headers])."""
    inc = torch_include_dir(torch)
    found = []  # (standard, header)
    for rel in CXX_GUARD_HEADERS:
        path = os.path.join(inc, rel)
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                found += [(int(m.group(1)), path) for m in _CXX_GUARD.finditer(f.read())]
    if not found:
        return DEFAULT_CXX_STANDARD, f"no C++ guard in {os.path.join(inc, CXX_GUARD_HEADERS[0])}"
    std, path = max(found, key=lambda f: f[0])
    return f"c++{std}", f"the #error guard in {path}"


# ---------------------------------------------------------------------------------------
# Compilers and CUDA headers
# ---------------------------------------------------------------------------------------


def find_nvcc(environ=None) -> str | None:
    """$CUDA_HOME/bin/nvcc, then nvcc on PATH. Not /usr/local/cuda/bin unless one of those
    says so: hiding nvcc (PATH without it, CUDA_HOME unset) must choose the host-compiler
    build."""
    environ = os.environ if environ is None else environ
    candidates = []
    if environ.get("CUDA_HOME"):
        candidates.append(os.path.join(environ["CUDA_HOME"], "bin", "nvcc"))
    candidates.append(shutil.which("nvcc", path=environ.get("PATH", os.defpath)))
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def find_cxx(environ=None) -> str | None:
    """The host C++ compiler: $CXX, else c++, g++ or clang++ on PATH."""
    environ = os.environ if environ is None else environ
    for name in ([environ["CXX"]] if environ.get("CXX") else []) + ["c++", "g++", "clang++"]:
        path = shutil.which(name.split()[0], path=environ.get("PATH", os.defpath))
        if path:
            return path
    return None


def nvcc_include_dirs(nvcc: str) -> list[str]:
    """The CUDA include dirs ``nvcc`` compiles against: what its dry run says (``#$
    INCLUDES=...``: right for wrappers and symlinked toolkits too), else ``<root>/include``
    and ``<root>/targets/*/include`` beside it."""
    try:
        p = subprocess.run([nvcc, "-v", "-E", "-x", "c++", os.devnull, "-o", os.devnull],
                           capture_output=True, text=True, timeout=60)
        m = re.search(r'^#\$ INCLUDES="([^"]*)"', p.stdout + p.stderr, re.M)
        dirs = [d[2:] for d in m.group(1).split() if d.startswith("-I")] if m else []
        if dirs:
            return dirs
    except (OSError, subprocess.SubprocessError):
        pass
    root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return [os.path.join(root, "include")] + glob.glob(os.path.join(root, "targets", "*", "include"))


def runtime_version(torch) -> tuple[int, int] | None:
    """torch's CUDA runtime as (major, minor) (``torch.version.cuda``), None on a CPU torch."""
    v = getattr(torch.version, "cuda", None)
    if not v:
        return None
    major, minor = (v.split(".") + ["0"])[:2]
    return int(major), int(minor)


def header_version(include_dirs) -> tuple[int, int] | None:
    """The (major, minor) of the first ``cuda_runtime_api.h`` in ``include_dirs``, from its
    ``CUDART_VERSION`` (13000 -> (13, 0)); None when there is none."""
    for d in include_dirs:
        path = os.path.join(d, RUNTIME_HEADER)
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                m = re.search(r"#\s*define\s+CUDART_VERSION\s+(\d+)", f.read())
            if m:
                n = int(m.group(1))
                return n // 1000, n % 1000 // 10
    return None


def _site_dirs(torch) -> list[str]:
    """site-packages directories to look for CUDA wheels in: torch's own first."""
    dirs = [os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))]
    for p in sys.path:
        if p and os.path.basename(p) in ("site-packages", "dist-packages") and p not in dirs:
            dirs.append(p)
    return dirs


def _with_crt(dirs: list[str]) -> bool:
    return any(os.path.isfile(os.path.join(d, CRT_HEADER)) for d in dirs)


def header_candidates(torch, nvcc: str | None, environ=None) -> list[tuple[list[str], str]]:
    """(include dirs, where from) in the order of NOTE [building without nvcc]; only sets
    that hold ``cuda_runtime_api.h``."""
    environ = os.environ if environ is None else environ
    out = []
    own = environ.get("TORCH_CE_CUDA_INCLUDE", "").strip()
    if own:
        out.append(([d for d in own.split(os.pathsep) if d], "TORCH_CE_CUDA_INCLUDE"))
    if nvcc:
        out.append((nvcc_include_dirs(nvcc), f"nvcc ({nvcc})"))
    rt = runtime_version(torch)
    for site in _site_dirs(torch):
        nv = os.path.join(site, "nvidia")
        if rt:
            out.append(([os.path.join(nv, f"cu{rt[0]}", "include")], f"the CUDA {rt[0]} wheels in {site}"))
        out.append(([os.path.join(nv, "cuda_runtime", "include"), os.path.join(nv, "cuda_nvcc", "include")],
                     f"the CUDA 12 wheels in {site}"))
    for root in ([environ["CUDA_HOME"]] if environ.get("CUDA_HOME") else []) + list(TOOLKIT_ROOTS):
        out.append(([os.path.join(root, "include")], f"the CUDA toolkit at {root}"))
    return [(dirs, src) for dirs, src in out
            if any(os.path.isfile(os.path.join(d, RUNTIME_HEADER)) for d in dirs)]


def version_problem(headers: tuple[int, int] | None, runtime: tuple[int, int] | None,
                    where: str) -> str | None:
    """Why headers of version ``headers`` (found ``where``) must not build against
    ``runtime`` (NOTE [building without nvcc]); None when they may."""
    if runtime is None:
        return None  # a CPU torch: a compile check links nothing
    fmt = "{}.{}".format
    if headers is None:
        return f"the CUDA headers from {where} have no CUDART_VERSION"
    if headers[0] != runtime[0] or headers[1] > runtime[1]:
        return (f"the CUDA headers from {where} are CUDA {fmt(*headers)}, but torch's CUDA runtime "
                f"is CUDA {fmt(*runtime)} (torch.version.cuda): the gather would link against the "
                f"CUDA {fmt(*headers)} API and fail at run time (CUDA 13 changed cudaMemcpyBatchAsync). "
                f"Use headers of CUDA {fmt(*runtime)}: {crt_install_command(runtime)}, or a CUDA "
                f"{fmt(*runtime)} nvcc")
    return None


def crt_wheel(runtime: tuple[int, int]) -> str:
    """The pip requirement that brings the ``crt/`` headers of CUDA ``runtime``."""
    major, minor = runtime
    if major >= 13:
        return f"nvidia-cuda-crt=={major}.{minor}.*"
    return f"nvidia-cuda-nvcc-cu{major}=={major}.{minor}.*"  # CUDA 12 ships crt/ with nvcc


def crt_install_command(runtime: tuple[int, int], python: str | None = None) -> str:
    return f"{python or sys.executable} -m pip install '{crt_wheel(runtime)}'"


@dataclasses.dataclass
class Headers:
    """The CUDA headers a build uses: ``dirs`` (empty when none fits), where they came from,
    whether they are nvcc's own, and ``problem``: why no set can build (None: ``dirs`` can)."""

    dirs: list
    where: str = ""
    nvcc: bool = False
    problem: str | None = None


def choose_headers(torch, nvcc: str | None, environ=None) -> Headers:
    """The first candidate set of the runtime's version with its crt/ headers. A set named
    by TORCH_CE_CUDA_INCLUDE is taken or refused as it is; a found one of another version
    (an older system nvcc, say) is passed over for the next."""
    environ = os.environ if environ is None else environ
    rt = runtime_version(torch)
    found = header_candidates(torch, nvcc, environ)
    if not found:
        want = f"CUDA {rt[0]}.{rt[1]}" if rt else "CUDA"
        fix = f" ({crt_install_command(rt)} brings the crt/ headers; torch's own wheels the rest)" if rt else ""
        return Headers([], problem=f"no {want} runtime headers (cuda_runtime_api.h) found{fix}")
    first = None
    for dirs, where in found:
        problem = version_problem(header_version(dirs), rt, where)
        if problem is None and not _with_crt(dirs):
            problem = (f"the CUDA headers from {where} lack the crt/ headers that "
                       f"cuda_runtime_api.h includes (crt/host_defines.h)"
                       + (f": {crt_install_command(rt)}" if rt else ""))
        if problem is None:
            return Headers(dirs, where, where.startswith("nvcc"))
        first = first or problem
        if where == "TORCH_CE_CUDA_INCLUDE":
            break  # named by hand: used as it is, or refused
    return Headers([], problem=first)


def cudart_library(torch, include_dirs) -> str | None:
    """The ``libcudart.so.<major>`` to link: beside the headers (``../lib``, ``../lib64``),
    else in the CUDA wheels' lib dirs; None (link through torch's libraries) if none."""
    rt = runtime_version(torch)
    if rt is None:
        return None
    roots = [os.path.dirname(d) for d in include_dirs]
    for site in _site_dirs(torch):
        roots += [os.path.join(site, "nvidia", f"cu{rt[0]}"), os.path.join(site, "nvidia", "cuda_runtime")]
    for root in roots:
        for lib in ("lib", "lib64"):
            path = os.path.join(root, lib, f"libcudart.so.{rt[0]}")
            if os.path.isfile(path):
                return path
    return None


# ---------------------------------------------------------------------------------------
# The one command that builds the kernels (explain(), the bind-time warning)
# ---------------------------------------------------------------------------------------


def source_root(package_dir: str) -> str | None:
    """The torch_ce source tree an editable install runs from (setup.py beside the package),
    else None (a wheel install)."""
    root = os.path.dirname(os.path.abspath(package_dir))
    return root if os.path.isfile(os.path.join(root, "setup.py")) else None


def build_command(torch, package_dir: str, python: str | None = None, environ=None) -> str:
    """The one shell command that builds csrc/ for this interpreter and torch: the missing
    crt headers' wheel first when no nvcc and no matching header set is there, then the
    install with *this* interpreter's pip (a ``pip`` of another Python builds nothing)."""
    py = python or sys.executable
    root = source_root(package_dir) or "<the torch_ce source tree>"
    install = f"{py} -m pip install --no-build-isolation --no-deps -e {root}"
    rt = runtime_version(torch)
    if rt is None:
        return f"install a CUDA build of torch (>= 2.11), then: {install}"
    if choose_headers(torch, find_nvcc(environ), environ).problem is not None:
        return f"{crt_install_command(rt, py)} && {install}"
    return install
