"""CI runs the README's two commands, verbatim, in a fresh virtual environment, then the same
install on every other supported torch (.ci/legs.sh)."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CI = os.path.join(ROOT, ".ci", "run")
LEGS = os.path.join(ROOT, ".ci", "legs.sh")


def _readme_block() -> list[str]:
    """The non-empty lines of README.md's first ```bash block."""
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    start = lines.index("```bash") + 1
    return [ln for ln in lines[start:lines.index("```", start)] if ln.strip()]


def test_ci_runs_the_readme_commands():
    block = _readme_block()
    assert len(block) == 2, f"README's first bash block must be install + test, got {block}"
    assert block[0].startswith("pip install torch=="), block[0]  # torch pinned first: no upgrade
    assert "--no-build-isolation" in block[0], block[0]
    assert block[1].startswith("python -m pytest"), block[1]
    out = subprocess.run(["bash", CI, "--print"], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == block, (out.stdout, block)


def _code(path: str) -> str:
    return "\n".join(ln for ln in open(path).read().splitlines() if not ln.lstrip().startswith("#"))


def test_ci_uses_a_fresh_venv_and_keeps_no_copy_of_the_commands():
    """Every leg (.ci/legs.sh) gets a fresh venv in a temp dir, removed after it; .ci/run and
    the legs hold no copy of the README's commands (the legs derive theirs from it)."""
    run, legs = _code(CI), _code(LEGS)
    assert not any("pip install torch==" in ln or "-m pytest" in ln or "torchtitan" in ln
                   for ln in run.splitlines()), ".ci/run must read its commands from README.md, not repeat them"
    assert not any("torchtitan" in ln or "--no-build-isolation" in ln
                   for ln in legs.splitlines()), ".ci/legs.sh must take the README's install line, not repeat it"
    assert ". .ci/legs.sh" in run and re.search(r'ci_legs "\$\{CMDS\[0\]\}" "\$\{CMDS\[1\]\}"', run)
    assert re.search(r'python3 -m venv "\$venv"', legs) and re.search(r'venv="\$tmp/venv"', legs), "no fresh venv"
    assert re.search(r'tmp="\$\(mktemp -d ', legs), "the venv is not in a temp dir"
    assert re.search(r'rm -rf "\$tmp"', legs) and "trap ci_cleanup EXIT" in legs, "temp dirs are not removed"
    assert "system-site-packages" not in run + legs
    assert '-eq 5' in legs, "pytest's exit 5 (no tests) must fail CI"


def test_ci_legs_cover_the_supported_torches():
    """A leg per supported release (README.md's platform table names each), every one but the
    README's pinned by a requirements file; the README's and the newest run the whole default
    suite, the oldest a subset that still holds the build, the passes, the no-hang fuzz, the
    uneven tests and the zoo's default case, 2.14.1 the build and the passes."""
    legs = open(LEGS).read()
    table = open(os.path.join(ROOT, "README.md")).read()
    found = dict(re.findall(r'^\s+"([0-9.]+)\|([^|]+)\|', legs, re.M))
    assert found.get("2.13") == "README", found
    for release in ("2.11", "2.13", "2.14.1", "2.15"):
        assert release in found, (release, found)
        assert re.search(rf"^\| +{re.escape(release)} +\|", table, re.M), f"README's table has no row for torch {release}"
        if found[release] != "README":
            req = os.path.join(ROOT, found[release])
            pins = [ln.strip() for ln in open(req) if ln.strip() and not ln.startswith("#")]
            want = f"torch=={release}" + (".0" if release.count(".") == 1 else "")
            assert [p for p in pins if p.startswith("torch")] == [want], (req, pins)
    fast = re.search(r'^FAST_TESTS="([^"]+)"', legs, re.M).group(1).split()
    for f in ("test/test_build.py", "test/test_no_hang.py", "test/test_uneven_host.py", "test/test_zoo_matrix.py",
              "test/test_passes_golden.py"):
        assert f in fast, f
    assert all(os.path.isfile(os.path.join(ROOT, f)) for f in fast), fast
    for release in ("2.11", "2.14.1"):  # the fast legs
        assert re.search(rf'"{re.escape(release)}\|[^|]+\|\$FAST_TESTS[ |]', legs), release
    assert re.search(r'"2\.15\|[^|]+\|README\|', legs), "the newest release runs the whole default suite"
    # The node ids a fast leg adds (its share of the slow cases) name files that exist.
    ids = re.findall(r"(test/[\w/]+\.py)::", legs)
    assert ids and all(os.path.isfile(os.path.join(ROOT, f)) for f in ids), ids
