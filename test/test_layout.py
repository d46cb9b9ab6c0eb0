"""The package's import boundaries and DESIGN.md's layout, checked from the source (fast).

* ``torch_ce/runtime/`` never imports the compile side (``torch_ce.passes``,
  ``torch_ce.inductor_lowering``), at module level or inside a function: the run time
  must work (and be testable) without Inductor's pass machinery, and a cycle between the
  two is how the lowering <-> cost tangle started.
* ``torch_ce/passes/`` decides only: it may read ``runtime.eligibility`` and
  ``runtime.cost_model``, never a module that opens windows, binds, gathers or measures
  (``runtime.calibration`` runs gathers; a compile
  pass that did would run collectives at compile time, which hangs on an FX-cache hit).
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
                  "from ..runtime.windows import WindowPool\n")
    assert len(passes_violations("passes/x.py", bad_passes)) == 4
    assert len(passes_violations("passes/x.py", "from ..runtime.calibration import calibrate\n")) == 1
    assert not passes_violations("passes/x.py", "from ..runtime.cost_model import curve_for\n"
                                                "from ..runtime import eligibility\n")


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
