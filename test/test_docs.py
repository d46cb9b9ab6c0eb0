"""The docs name what exists (fast, from the source).

* Every ``NOTE [topic]`` reference names a NOTE that is defined somewhere, and a reference
  that names its file (``NOTE [topic] in runtime/agreement.py``, ``NOTE [topic]
  (ops.py)``) names the file that defines it. A NOTE is defined by a line holding only
  ``NOTE [topic]`` (after a comment marker): see ../shared/STYLE.md.
* Every repository path that docs/DESIGN.md or README.md names exists (DESIGN's layout
  block is checked both ways by test/test_layout.py).

The checkers take a root and file list, so they are tested on synthetic trees below: a
planted stale reference must fail.
"""
from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DEFINITION = re.compile(r"^\s*(?:(?://|#)\s*)*(?:#\s*)?NOTE \[([^\]\n]+)\]\s*$", re.M)
# A comment marker at a line start: references may wrap across comment lines.
_WRAP = re.compile(r"[ \t]*\n[ \t]*(?:(?://|#|\*)[ \t]?)?[ \t]*")
_REFERENCE = re.compile(r"NOTE \[([^\]]+)\](?:\s*(?:in|\()\s*`?([\w./-]+\.(?:py|h|cu|cpp|md))`?)?")
_PATH = re.compile(r"(?<![\w./~-])((?:[\w-]+/)+(?:[\w.-]+\.(?:py|h|cu|cpp|md|sh|json|png|log))?)(?![\w/-])")


def _git(root: str, *args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


# Walked when git cannot list the tree: what .gitignore leaves out (builds, caches) and
# hidden folders other than .ci/.
_NOT_SOURCE = ("__pycache__", "build", "dist")


def _walk(root: str) -> list[str]:
    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _NOT_SOURCE and not d.endswith(".egg-info")
                         and (not d.startswith(".") or (here == root and d == ".ci")))
        out += [os.path.relpath(os.path.join(here, f), root) for f in files]
    return sorted(out)


def _tracked(root: str) -> list[str]:
    """The repository's source files: git's tracked files when ``root`` is its own checkout
    (the git toplevel); else (an unpacked archive, a copy inside another repository, where
    git would list the outer repository's files or none) every file under ``root``."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is not None and os.path.realpath(top.strip()) == os.path.realpath(root):
        listed = _git(root, "ls-files") or ""
        paths = listed.split()
    else:
        paths = _walk(root)
    return [p for p in paths if p.endswith((".py", ".h", ".cu", ".cpp", ".md", ".sh"))
            or p.startswith(".ci/")]


def _read(root: str, rel: str) -> str:
    try:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return ""


def note_definitions(root: str, files: list[str]) -> dict[str, set[str]]:
    """topic -> the files that define it."""
    defs: dict[str, set[str]] = {}
    for rel in files:
        for m in _DEFINITION.finditer(_read(root, rel)):
            defs.setdefault(" ".join(m.group(1).split()), set()).add(rel)
    return defs


def _resolve(named: str, referrer: str, files: list[str]) -> set[str]:
    """The tracked files a reference's path can mean: relative to the root, to torch_ce/,
    to the referrer's folder or its parent, or (a bare name) any file of that name."""
    here = os.path.dirname(referrer)
    cands = {os.path.normpath(p) for p in (named, os.path.join("torch_ce", named), os.path.join(here, named),
                                            os.path.join(os.path.dirname(here), named))}
    hits = {f for f in files if f in cands}
    if not hits and "/" not in named:
        hits = {f for f in files if os.path.basename(f) == named}
    if not hits:  # a tail of a path: "runtime/agreement.py" from the repo root's docs
        hits = {f for f in files if f.endswith("/" + named)}
    return hits


def stale_note_references(root: str, files: list[str]) -> list[str]:
    defs = note_definitions(root, files)
    bad = []
    for rel in files:
        text = _WRAP.sub(" ", _read(root, rel))
        for m in _REFERENCE.finditer(text):
            topic, named = " ".join(m.group(1).split()), m.group(2)
            if topic not in defs:
                bad.append(f"{rel}: NOTE [{topic}] is defined nowhere")
            elif named is not None and not (_resolve(named, rel, files) & defs[topic]):
                bad.append(f"{rel}: NOTE [{topic}] is not in {named} (it is in {sorted(defs[topic])})")
    return bad


# Paths inside other projects (prior art, torch's own sources, the CUDA wheels' headers), not this repository's.
EXTERNAL = ("torch/", "torchtitan/", "experiments/", "magi_compiler/", "crt/", "nvidia/")


def missing_paths(root: str, doc: str) -> list[str]:
    """Repository paths a doc names (``a/b.py``, ``bench/results/``) that do not exist,
    relative to the root or to torch_ce/ (other projects' paths, ``EXTERNAL``, aside)."""
    text = _read(root, doc)
    text = re.sub(r"https?://\S+", "", text)
    layout = re.search(r"^## Layout.*?\n```\n(.*?)\n```", text, re.S | re.M)
    if layout:  # its entries name files within their folder (test/test_layout.py checks them both ways)
        entries = re.sub(r"^( {0,6})[\w.\-]+/?(?=\s|$)", r"\1", layout.group(1), flags=re.M)
        text = text[:layout.start(1)] + entries + text[layout.end(1):]
    out = []
    for m in _PATH.finditer(text):
        p = m.group(1)
        if p.startswith(EXTERNAL):
            continue
        if not any(os.path.exists(os.path.join(root, base, p))
                                               for base in ("", "torch_ce")):
            out.append(p)
    return sorted(set(out))


def test_note_references_name_existing_notes():
    files = [f for f in _tracked(ROOT) if f != "test/test_docs.py"]  # its samples are planted
    assert note_definitions(ROOT, files), "no NOTE definitions found: the parser is broken"
    bad = stale_note_references(ROOT, files)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", ["docs/DESIGN.md", "README.md"])
def test_docs_name_only_existing_paths(doc):
    gone = missing_paths(ROOT, doc)
    assert not gone, f"{doc} names paths that do not exist: {gone}"


def _tree(tmp_path, files: dict[str, str]) -> list[str]:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return sorted(files)


def test_the_note_checker_catches_a_planted_stale_reference(tmp_path):
    good = {
        "torch_ce/runtime/agreement.py": '"""Agree.\n\n# NOTE [agreement before anything moves]\nWhy.\n"""\n',
        "csrc/ce_copy.h": "// # NOTE [peer order]\n// Why.\n",
        "torch_ce/passes/gate.py": ("# The bind lists it (NOTE [agreement before anything moves] in\n"
                                    "# agreement.py); the order: NOTE [peer order] in csrc/ce_copy.h.\n"),
        "docs/DESIGN.md": "See NOTE [agreement before anything\n  moves] in runtime/agreement.py.\n",
    }
    files = _tree(tmp_path, good)
    assert stale_note_references(str(tmp_path), files) == []
    # The stale forms: the NOTE is in another file; the NOTE no longer exists.
    planted = dict(good)
    planted["torch_ce/ops.py"] = "# refused: NOTE [agreement before anything moves] in binding.py\n"
    planted["torch_ce/runtime/binding.py"] = "x = 1\n"
    planted["torch_ce/runtime/cuda.py"] = "# NOTE [copy-engine gather] (ce_copy.h) says how.\n"
    files = _tree(tmp_path, planted)
    bad = stale_note_references(str(tmp_path), files)
    assert len(bad) == 2, bad
    assert any("ops.py" in b and "not in binding.py" in b for b in bad), bad
    assert any("cuda.py" in b and "defined nowhere" in b for b in bad), bad


def test_the_path_checker_catches_a_missing_file(tmp_path):
    _tree(tmp_path, {"docs/DESIGN.md": "Measured by `probes/e2e.py`; see runtime/windows.py, `bench/results/`.\n",
                     "torch_ce/runtime/windows.py": "", "bench/results/README.md": ""})
    assert missing_paths(str(tmp_path), "docs/DESIGN.md") == ["probes/e2e.py"]


def test_a_tree_inside_another_repository_is_walked(tmp_path):
    """Unpacked inside another git repository, the tree's files are walked (that git would
    list none of them); in its own checkout, git's tracked files are listed."""
    if _git(str(tmp_path), "--version") is None:
        pytest.skip("no git")
    inner = tmp_path / "outer" / "vendor" / "torch_ce"
    _tree(inner, {"torch_ce/a.py": "# NOTE [a]\n", ".ci/run": "", "README.md": "",
                  "torch_ce/__pycache__/a.py": "", ".git_like/b.py": "", "build/c.py": ""})
    assert _git(str(tmp_path / "outer"), "init", "-q") is not None
    assert _tracked(str(inner)) == [".ci/run", "README.md", "torch_ce/a.py"]
    assert note_definitions(str(inner), _tracked(str(inner))) == {"a": {"torch_ce/a.py"}}
    assert _git(str(inner), "init", "-q") is not None and _git(str(inner), "add", "README.md") is not None
    assert _tracked(str(inner)) == ["README.md"]
