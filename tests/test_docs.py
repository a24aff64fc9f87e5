"""The documentation as a user meets it: every Python snippet in the README and docs/ runs as pasted (as the main
module of a process of its own, in an empty folder; on this machine's CPU, as each snippet picks its device), and
every relative link in a Markdown file of the repository points to a file that exists.

The snippets' processes are forked from a server that has imported torch, Triton and moeblaze's kernels once
(helpers.preloaded_processes: ~5 CPU-seconds a snippet otherwise); what a snippet imports beyond those (moeblaze's
integrations, which register themselves, transformers, Megatron, torchtitan) it imports itself."""
import os
import pathlib
import re
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


def _as_main(code: str, folder: str, output: str) -> None:
    """Run code as `python -c` would (a fresh __main__, argv ["-c"]) in folder, its output into the file output, with
    nothing of torchrun's in the environment (RANK, WORLD_SIZE, MASTER_*), as a user pastes it into `python`, and
    a DeprecationWarning that moeblaze's top-level module raises made an error."""
    import warnings

    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(folder)
    for name in TORCHRUN_ENV:
        os.environ.pop(name, None)
    warnings.filterwarnings("error", category=DeprecationWarning, module=r"moeblaze\Z")
    sys.argv = ["-c"]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


@pytest.mark.parametrize("code", list(snippets()))
def test_snippet_runs_as_pasted(code, tmp_path):
    from helpers import preloaded_processes

    output = tmp_path / "output"
    p = preloaded_processes().Process(target=_as_main, args=(code, str(tmp_path / "cwd"), str(output)))
    (tmp_path / "cwd").mkdir()
    p.start()
    p.join(600)
    if p.exitcode is None:
        p.kill()
        p.join()
    assert p.exitcode == 0, output.read_text()[-3000:]


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
