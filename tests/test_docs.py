"""The documentation as a user meets it: every Python snippet in the README and docs/ runs as pasted (in a fresh
interpreter, in an empty folder; on this machine's CPU, as each snippet picks its device), and every relative link
in a Markdown file of the repository points to a file that exists."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_DIRS = {".venv", ".git", ".baseline", ".peers", "node_modules", "build", "dist"}


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def snippets():
    for path in DOCS:
        for i, m in enumerate(re.finditer(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)):
            yield pytest.param(m.group(1), id=f"{path.relative_to(ROOT)}-{i}")


@pytest.mark.parametrize("code", list(snippets()))
def test_snippet_runs_as_pasted(code, tmp_path):
    # as a user pastes it into `python`: nothing of torchrun's (RANK, WORLD_SIZE, MASTER_*) in the environment
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="error::DeprecationWarning:moeblaze")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def markdown_files():
    for path in ROOT.rglob("*.md"):
        if not SKIP_DIRS & set(path.relative_to(ROOT).parts[:-1]):
            yield path


def test_relative_links_point_to_files():
    broken, seen = [], 0
    for path in markdown_files():
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # links inside code are code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            seen += 1
            file = target.split("#")[0]
            if not (path.parent / file).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert seen > 10, seen  # the walk found the links
    assert not broken, broken


QUOTED = re.compile(r"(?<![\w./-])((?:benchmarks|scripts|docs|tools|tests|src)/[\w./-]*\w"
                    r"\.(?:py|md|sh|log|txt|jsonl|png)"
                    r"|(?:reference|routing|experts|nn|distributed|integrations|bench|cli)/[\w/]*\w\.py)")


def test_paths_quoted_in_the_source_exist():
    """Every repository file a comment or docstring in src/ names (benchmarks/..., docs/..., experts/op.py, ...)
    exists: a pointer to a deleted file is a dead end for the reader."""
    src = ROOT / "src" / "moeblaze"
    missing = []
    for path in sorted(src.rglob("*.py")):
        for m in QUOTED.finditer(path.read_text()):
            name = m.group(1)
            if not ((ROOT / name).exists() or (src / name).exists()):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing
