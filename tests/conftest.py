"""Shared test setup: seeds, the Triton interpreter for CPU runs, NaN-poisoned allocations."""
import os

import pytest


def pytest_configure(config):
    # The Triton kernels run under the interpreter on the CPU; it must be set before triton is imported.
    # `pytest -m gpu` (tests/gpu, on a CUDA machine) runs the compiled kernels instead.
    # One torch thread per test process (pytest -n runs one process per core; more threads would wait on each
    # other at every barrier): for this process and the commands the tests start.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    markexpr = config.getoption("-m") or ""
    if "gpu" not in markexpr or "not gpu" in markexpr:
        os.environ["TRITON_INTERPRET"] = "1"
    import triton.language.core as core  # after the switch above

    _CORE.update(vars(core))
    from helpers import speed_up_triton_interpreter

    speed_up_triton_interpreter()


@pytest.fixture(autouse=True)
def _own_working_folder(tmp_path_factory, monkeypatch):
    """Every test runs in a fresh empty working folder: what the clone holds (a checkpoint `moeblaze train` left in
    checkpoints/, say) never decides a test, and nothing a test writes by a relative path lands in the clone."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


# triton.language.core's functions as imported, before any kernel ran under the interpreter
_CORE: dict = {}


@pytest.fixture
def triton_core_restored():
    """Triton's interpreter leaves triton.language.core's functions patched once a kernel that calls the library's
    own jit helpers (cdiv, cumsum, ...) has run in this process; a kernel compiled ahead of time afterwards, in
    the same process, would be built with the patched ones and fail (unless Triton's cache already holds it).
    Put the originals back first."""
    import triton.language.core as core

    for name, value in _CORE.items():
        if getattr(core, name, None) is not value:
            setattr(core, name, value)


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)


@pytest.fixture
def poison_alloc(monkeypatch):
    """Make fresh float tensors NaN and fresh int tensors -77777 while a test runs, so that an output row
    a kernel forgets to write shows up instead of hiding behind zeros."""
    import torch
    import torch._dynamo  # noqa: F401  its rules map torch's functions when first imported: the real ones, not these

    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(-77777)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: fill(real_new_empty(self, *a, **k)))


@pytest.fixture(scope="session", autouse=True)
def _no_rank_outlives_the_session():
    """The gloo ranks of helpers.run_ranks are stopped when this test process's session ends: an xdist worker exits
    without multiprocessing's exit handler, which would otherwise stop them, so they would outlive pytest."""
    yield
    from helpers import close_pools

    close_pools()
