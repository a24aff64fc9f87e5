"""The package as a user installs it: `python -m build` makes an sdist and a wheel (no build isolation: the
setuptools of this environment), the wheel holds the package and its metadata (version, license, entry point) and
nothing of the repository's development tree, and, installed on its own into an empty folder, it imports and
trains two steps of the small model from its entry module."""
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

import moeblaze

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytest.importorskip("build")


def test_wheel_and_sdist_build_install_and_run(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)], check=True,
                   capture_output=True, text=True, timeout=600)
    (wheel,) = dist.glob("moeblaze-*.whl")
    (sdist,) = dist.glob("moeblaze-*.tar.gz")
    assert wheel.name.startswith(f"moeblaze-{moeblaze.__version__}-py3-none-any")
    assert sdist.name == f"moeblaze-{moeblaze.__version__}.tar.gz"
    names = zipfile.ZipFile(wheel).namelist()
    assert "moeblaze/experts/op.py" in names and "moeblaze/cli/__main__.py" in names
    assert not [n for n in names if n.split("/")[0] in ("tests", "scripts", "benchmarks", "docs")], names
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert f"Version: {moeblaze.__version__}" in meta and "Apache-2.0" in meta
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "moeblaze = moeblaze.cli:main" in entry

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", "import moeblaze, sys; print(moeblaze.__file__, moeblaze.__version__)"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(str(site)), run.stdout  # the installed copy, not the source tree
    train = subprocess.run([sys.executable, "-m", "moeblaze.cli", "train", "--steps", "2", "--batch-size", "2",
                            "--seq-len", "16", "--eval-every", "2", "--eval-batches", "1", "--save", ""],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr[-2000:]
    assert "val" in train.stdout + train.stderr
