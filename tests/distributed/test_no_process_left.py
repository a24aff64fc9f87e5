"""The suite leaves no process behind: a pytest session that starts a pool of gloo ranks and then ends as an xdist
worker can, without Python's exit handlers (multiprocessing's, which would stop daemonic children, among them),
ends with every rank stopped."""
import os
import subprocess
import sys
import textwrap
import time


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_session_that_started_ranks_leaves_none_even_without_exit_handlers(tmp_path):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pids = tmp_path / "pids"
    (tmp_path / "test_ranks.py").write_text(textwrap.dedent(f"""
        import os
        from helpers import run_ranks

        def record(rank, world, found, path):
            with open(path, "a") as f:
                f.write(str(os.getpid()) + "\\n")

        def test_ranks():
            run_ranks(record, 2, {str(pids)!r})
    """))
    (tmp_path / "hard_exit.py").write_text("import os\n\ndef pytest_unconfigure(config):\n    os._exit(0)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "hard_exit", "-p",
                        "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(tmp_path),
                        str(tmp_path / "test_ranks.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = [int(p) for p in pids.read_text().split()]
    assert len(ranks) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in ranks if _alive(p)]
    for p in left:  # stopped here, so that a failure of this test leaves none either
        os.kill(p, 9)
    assert not left, "ranks outlived pytest"
