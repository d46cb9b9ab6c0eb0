"""The package's import boundaries and DESIGN.md's layout, checked from the source (fast).

* ``torch_ce/runtime/`` never imports the compile side (``torch_ce.passes``,
  ``torch_ce.inductor_lowering``), at module level or inside a function: the run time
  must work (and be testable) without Inductor's pass machinery, and a cycle between the
  two is how the lowering <-> cost tangle started.
* ``torch_ce/passes/`` decides only: it may read ``runtime.eligibility`` and
  ``runtime.cost_model``, never a module that opens windows, binds, gathers or measures
  (``runtime.calibration`` runs gathers; a compile
  pass that did would run collectives at compile time, which hangs on an FX-cache hit).
* ``torch_ce/runtime/`` reads one way down: no module of it imports a sibling that imports
  it back, directly or through other siblings, at module level or inside a function
  (``native`` wraps the C++ library and imports only ``toolchain`` and ``eligibility``;
  ``gather``, which chooses the kernels, imports ``native`` and ``windows`` and neither
  imports it). A loop is how a reader following one lookup went gather -> native ->
  gather -> windows.
* ``runtime/native.py`` holds every call of the C++ library: no other module of
  ``torch_ce/`` names ``torch.ops.torch_ce_native`` (an attribute, an import or the
  library's name as a string, as ``getattr(torch.ops, "torch_ce_native")``; prose in a
  docstring is not a call). A kernel choice reaches the library through ``native.*`` only.
  Tests and benches outside the package may call it.
* The fenced block under "## Layout" in docs/DESIGN.md names every file of
  ``git ls-files torch_ce csrc`` and nothing that does not exist.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "torch_ce")

RUNTIME_FORBIDDEN = ("torch_ce.passes", "torch_ce.inductor_lowering")
PASSES_MAY_USE = ("torch_ce.runtime.eligibility", "torch_ce.runtime.cost_model")


def _modules(sub: str) -> list[str]:
    d = os.path.join(PKG, sub)
    return sorted(os.path.join(sub, f) for f in os.listdir(d) if f.endswith(".py"))


def imported(rel_path: str, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``torch_ce/<rel_path>``, anywhere in the
    file. ``from X import a`` counts as importing ``X.a`` (``a`` may be a submodule);
    relative imports are resolved against the file's package."""
    if source is None:
        with open(os.path.join(PKG, rel_path)) as f:
            source = f.read()
    parts = ["torch_ce", *rel_path[:-3].split("/")]
    package = parts[:-1]  # the same for a module and for its folder's __init__.py
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def runtime_violations(rel_path: str, source: str | None = None) -> list[str]:
    return [f"{rel_path}:{ln} imports {m}" for ln, m in imported(rel_path, source)
            if any(_under(m, p) for p in RUNTIME_FORBIDDEN)]


def passes_violations(rel_path: str, source: str | None = None) -> list[str]:
    return [f"{rel_path}:{ln} imports {m}" for ln, m in imported(rel_path, source)
            if _under(m, "torch_ce.runtime") and not any(_under(m, p) for p in PASSES_MAY_USE)]


def runtime_siblings(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module name -> the sibling modules of ``torch_ce/runtime/`` it imports, anywhere in
    the file. ``sources``: ``{"runtime/x.py": text}`` in place of the files on disk."""
    if sources is None:
        sources = {rel: None for rel in _modules("runtime")}
    names = {os.path.basename(rel)[:-3] for rel in sources} - {"__init__"}
    out = {}
    for rel, text in sources.items():
        me = os.path.basename(rel)[:-3]
        if me == "__init__":
            continue
        found = {m.split(".")[2] for _, m in imported(rel, text) if _under(m, "torch_ce.runtime")
                 and m.count(".") >= 2}
        out[me] = (found & names) - {me}
    return out


def runtime_loops(sources: dict[str, str] | None = None) -> list[str]:
    """Each import of a sibling that leads back to the importer, as its shortest loop
    ("gather -> native -> gather"); [] when the run time reads one way down."""
    graph = runtime_siblings(sources)
    loops = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            paths, seen = [[b]], {b}  # breadth first from b, back to a
            while paths:
                path = paths.pop(0)
                if path[-1] == a:
                    loops.append(" -> ".join([a, *path]))
                    break
                for n in sorted(graph.get(path[-1], ())):
                    if n not in seen:
                        seen.add(n)
                        paths.append([*path, n])
    return loops


def test_runtime_reads_one_way_down():
    assert not runtime_loops()
    # The leaf over the C++ library: which kernel serves is chosen above it (gather.py).
    assert runtime_siblings()["native"] <= {"toolchain", "eligibility"}


def test_the_loop_check_catches_loops():
    """Direct and longer loops, through module-level, in-function and from-imports."""
    two = {"runtime/gather.py": "from . import native\nfrom .windows import Slot\n",
           "runtime/windows.py": "def f():\n    from . import native\n",
           "runtime/native.py": "def g():\n    from . import gather, windows\n"}
    assert runtime_loops(two) == ["gather -> native -> gather", "gather -> windows -> native -> gather",
                                  "native -> gather -> native", "native -> windows -> native",
                                  "windows -> native -> windows"]
    three = {"runtime/a.py": "import torch_ce.runtime.b\n", "runtime/b.py": "from .c import x\n",
             "runtime/c.py": "from torch_ce.runtime import a\n", "runtime/__init__.py": "from . import a\n"}
    assert runtime_loops(three) == ["a -> b -> c -> a", "b -> c -> a -> b", "c -> a -> b -> c"]
    down = {"runtime/gather.py": "from . import native, windows\n",
            "runtime/windows.py": "from . import native\nfrom ..config import config\n",
            "runtime/native.py": "from . import toolchain\nfrom .. import runtime\n"}
    assert runtime_loops(down) == []


@pytest.mark.parametrize("rel_path", _modules("runtime"))
def test_runtime_never_imports_the_compile_side(rel_path):
    assert not runtime_violations(rel_path)


@pytest.mark.parametrize("rel_path", _modules("passes"))
def test_passes_never_open_windows(rel_path):
    assert not passes_violations(rel_path)


def test_the_import_checks_catch_violations():
    """The checks above can fail: relative, absolute, from-package and in-function forms."""
    bad_runtime = ("from ..passes import gate\n"
                   "import torch_ce.inductor_lowering\n"
                   "def f():\n    from ..inductor_lowering import ce_launch_info\n"
                   "from .. import passes\n")
    assert len(runtime_violations("runtime/x.py", bad_runtime)) == 4
    assert not runtime_violations("runtime/x.py", "from ..config import config\nfrom . import windows\n")
    bad_passes = ("from ..runtime import binding\n"
                  "def f():\n    from ..runtime.host import HostTransport\n"
                  "import torch_ce.runtime.bind_step\n"
                  "from ..runtime.window_pools import WindowPool\n")
    assert len(passes_violations("passes/x.py", bad_passes)) == 4
    assert len(passes_violations("passes/x.py", "from ..runtime.calibration import calibrate\n")) == 1
    assert not passes_violations("passes/x.py", "from ..runtime.cost_model import curve_for\n"
                                                "from ..runtime import eligibility\n")


# ---------------------------------------------------------------------------------------
# The C++ library's calls: runtime/native.py only
# ---------------------------------------------------------------------------------------

NATIVE_LIBRARY = "torch_ce_native"
NATIVE_LEAF = os.path.join("runtime", "native.py")


def _package_modules() -> list[str]:
    out = []
    for d, subdirs, files in os.walk(PKG):
        subdirs[:] = sorted(s for s in subdirs if s != "__pycache__")
        out += [os.path.relpath(os.path.join(d, f), PKG) for f in sorted(files) if f.endswith(".py")]
    return out


def native_library_uses(rel_path: str, source: str | None = None) -> list[str]:
    """Each place where ``torch_ce/<rel_path>`` reaches the C++ library's ops, as
    "path:line what" in line order: an attribute ``torch_ce_native``
    (``torch.ops.torch_ce_native``, through any alias), an import of that name, or a
    string that is the library's name or one of its ops (``"torch_ce_native"``,
    ``"torch_ce_native::gather_rows"``)."""
    if source is None:
        with open(os.path.join(PKG, rel_path)) as f:
            source = f.read()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == NATIVE_LIBRARY:
            found.append((node.lineno, f".{NATIVE_LIBRARY}"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(NATIVE_LIBRARY in n.split(".") for n in names):
                found.append((node.lineno, f"imports {NATIVE_LIBRARY}"))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and (node.value == NATIVE_LIBRARY or node.value.startswith(NATIVE_LIBRARY + "::"))):
            found.append((node.lineno, repr(node.value)))
    return [f"{rel_path}:{ln} {what}" for ln, what in sorted(found)]


def test_only_native_calls_the_cpp_library():
    assert NATIVE_LEAF in _package_modules()
    assert native_library_uses(NATIVE_LEAF), "the check no longer sees native.py's own calls"
    found = [u for rel in _package_modules() if rel != NATIVE_LEAF for u in native_library_uses(rel)]
    assert not found, f"call the C++ library through runtime/native.py: {found}"


def test_the_native_check_catches_calls():
    """Direct, aliased, imported and by-name forms; prose mentioning the library is not a call."""
    bad = ("import torch\n"
           "x = torch.ops.torch_ce_native.dim_strategy()\n"
           "def f():\n    ops = torch.ops\n    return ops.torch_ce_native.gather_bound_dim\n"
           "g = getattr(torch.ops, 'torch_ce_native')\n"
           "from torch.ops import torch_ce_native\n"
           "torch.library.register_fake('torch_ce_native::gather_rows')\n")
    assert [u.split(" ", 1)[0] for u in native_library_uses("runtime/x.py", bad)] == [
        "runtime/x.py:2", "runtime/x.py:5", "runtime/x.py:6", "runtime/x.py:7", "runtime/x.py:8"]
    fine = ('"""native.py holds the torch.ops.torch_ce_native calls."""\n'
            "from . import native\nn = native.dim_strategy()\n# torch.ops.torch_ce_native\n")
    assert native_library_uses("runtime/x.py", fine) == []


# ---------------------------------------------------------------------------------------
# DESIGN.md's layout block
# ---------------------------------------------------------------------------------------

_ENTRY = re.compile(r"^( *)([\w.\-]+/?)(?:\s|$)")


def layout_files(design_text: str) -> list[str]:
    """Paths named by the fenced block under "## Layout": an entry is a name at an even
    indent below 8 (two spaces per folder level), a folder ends with "/"; description
    lines are indented further."""
    m = re.search(r"^## Layout.*?\n```\n(.*?)\n```", design_text, re.S | re.M)
    assert m, 'no fenced block under "## Layout" in docs/DESIGN.md'
    paths, stack = [], []
    for line in m.group(1).splitlines():
        e = _ENTRY.match(line)
        if not e or len(e.group(1)) % 2 or len(e.group(1)) >= 8:
            continue
        depth = len(e.group(1)) // 2
        stack = stack[:depth] + [e.group(2)]
        paths.append("".join(stack))
    return paths


def test_layout_parser():
    text = "## Layout\n\n```\na/\n  b.py     x\n           y.py continues\n  c/\n    d.py\ne.py\n```\n"
    assert layout_files(text) == ["a/", "a/b.py", "a/c/", "a/c/d.py", "e.py"]


def test_design_layout_lists_the_tree():
    try:
        tracked = subprocess.run(["git", "ls-files", "torch_ce", "csrc"], cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    with open(os.path.join(ROOT, "docs", "DESIGN.md")) as f:
        listed = layout_files(f.read())
    files = {p for p in listed if not p.endswith("/")}
    missing = sorted(set(tracked) - files)
    assert not missing, f"docs/DESIGN.md's layout block does not list {missing}"
    gone = sorted(p for p in listed if not os.path.exists(os.path.join(ROOT, p)))
    assert not gone, f"docs/DESIGN.md's layout block lists what does not exist: {gone}"


def test_the_design_cards_top_level_is_there():
    """The design card names the package's top level; a reader with it in hand finds each,
    the ops' C++/CUDA source at csrc/ce_ops.cu, and no leftover csrc/ce_torch.cpp."""
    for rel in ("torch_ce/ops.py", "torch_ce/fake_impls.py", "torch_ce/inductor_lowering.py",
                "torch_ce/passes/__init__.py", "csrc/ce_ops.cu", "setup.py", "test"):
        assert os.path.exists(os.path.join(ROOT, rel)), f"{rel} is missing"
    src = open(os.path.join(ROOT, "csrc", "ce_ops.cu")).read()
    assert "TORCH_LIBRARY_IMPL(magi" in src or "TORCH_LIBRARY_FRAGMENT(magi" in src, \
        "csrc/ce_ops.cu does not register the magi ops' kernels"
    assert not os.path.exists(os.path.join(ROOT, "csrc", "ce_torch.cpp"))
