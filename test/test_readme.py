"""The README's first two commands are what CI runs, verbatim."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _commands(path, fence=True):
    lines = open(os.path.join(ROOT, path)).read().splitlines()
    if fence:
        start = lines.index("```bash") + 1
        lines = lines[start:lines.index("```", start)]
    return [l for l in lines if l.strip() and not l.startswith(("#", "set ", "cd "))]


def test_ci_runs_the_readme_commands():
    readme = _commands("README.md")[:2]
    ci = _commands(".ci/run", fence=False)
    assert ci == readme, (ci, readme)
