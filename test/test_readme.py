"""CI runs the README's two commands, verbatim, in a fresh virtual environment."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CI = os.path.join(ROOT, ".ci", "run")


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


def test_ci_uses_a_fresh_venv_and_keeps_no_copy_of_the_commands():
    text = open(CI).read()
    code = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    assert not any("pip install" in ln or "-m pytest" in ln for ln in code), (
        ".ci/run must read its commands from README.md, not repeat them")
    assert re.search(r'python3 -m venv "\$tmp/venv"', text), "no fresh venv in a temp dir"
    assert "system-site-packages" not in "\n".join(code)
    assert re.search(r"trap 'rm -rf \"\$tmp\"' EXIT", text), "the temp dir is not removed on exit"
    assert "exit 5" in text or '-eq 5' in text, "pytest's exit 5 (no tests) must fail CI"
