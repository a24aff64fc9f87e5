"""A sharded save stopped at every step of its protocol (before each write, rename and delete, and inside each
delete and write), in one process and with two ranks: afterwards the next run can start on the same path, a
resume reads the newest complete checkpoint (the new one once its manifest is on disk, else the one before), and
the next save leaves one clean checkpoint. Also the leftover an earlier version's killed delete left (an `.old`
folder with some shards and no manifest beside a complete checkpoint): `train --resume` resumes."""
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moeblaze.cli import checkpoint as ck
from moeblaze.cli import main, train, train_setup

from helpers import run_ranks


class Killed(BaseException):
    """The process died here (BaseException: no `except Exception` of the code under test catches it)."""


class Faults:
    """Counts the save's steps (file-system mutations) and kills it at step `kill_at` (-1: never). A delete or a
    write killed "inside" has done part of its work."""

    def __init__(self, monkeypatch, kill_at: int = -1, inside: bool = False, after_shards: bool = False):
        self.n, self.kill_at, self.inside, self.manifest_written = 0, kill_at, inside, False
        self.counting = not after_shards  # after_shards: count only the steps after DCP has written the shards
        real_replace, real_rmtree = os.replace, shutil.rmtree
        real_manifest, real_save = ck._write_manifest, dcp.save

        def step(partial=None):
            if not self.counting:
                return
            self.n += 1
            if self.n - 1 == self.kill_at:
                if self.inside and partial is not None:
                    partial()
                raise Killed(self.n - 1)

        def replace(a, b):
            step()
            real_replace(a, b)

        def rmtree(p, ignore_errors=False):
            if os.path.isdir(p):
                step(lambda: os.remove(os.path.join(p, sorted(os.listdir(p))[0])) if os.listdir(p) else None)
            real_rmtree(p, ignore_errors=ignore_errors)

        def manifest(folder):
            def half():
                with open(os.path.join(folder, ck.MANIFEST), "w") as f:
                    f.write("0" * 10)
            step(half)
            real_manifest(folder)
            self.manifest_written = True

        def save(state, checkpoint_id, **kw):
            def partial():  # the shards on disk, DCP's own metadata not yet
                real_save(state, checkpoint_id=checkpoint_id, **kw)
                os.remove(os.path.join(checkpoint_id, ".metadata"))
            step(partial)
            real_save(state, checkpoint_id=checkpoint_id, **kw)
            self.counting = True

        monkeypatch.setattr(ck.os, "replace", replace)
        monkeypatch.setattr(ck.shutil, "rmtree", rmtree)
        monkeypatch.setattr(ck, "_write_manifest", manifest)
        monkeypatch.setattr(dcp, "save", save)


def _state(step: int) -> dict:
    return {"train": {"step": torch.tensor(step)}, "w": torch.full((64,), float(step))}


def _loaded_step(path: str) -> int:
    state = _state(0)
    ck.load_newest_sharded(path, state, 0)
    assert torch.equal(state["w"], torch.full((64,), float(state["train"]["step"])))
    return int(state["train"]["step"])


def _check_after_kill(path: str, faults: Faults) -> None:
    ck.probe_writable_folder(path)  # the next run may start here
    got = _loaded_step(path)
    assert got == 2 if faults.manifest_written else got in (1, 2), (faults.kill_at, got)
    ck.save_sharded(path, _state(3), 0)
    parent = os.path.dirname(path)
    assert sorted(os.listdir(parent)) == ["ck"], (faults.kill_at, os.listdir(parent))
    assert _loaded_step(path) == 3


def _steps_of_one_save(tmp_path, monkeypatch) -> int:
    path = str(tmp_path / "count" / "ck")
    os.makedirs(os.path.dirname(path))
    ck.save_sharded(path, _state(1), 0)
    with pytest.MonkeyPatch.context() as m:
        faults = Faults(m)
        ck.save_sharded(path, _state(2), 0)
    return faults.n


@pytest.mark.parametrize("inside", [False, True], ids=["before each step", "inside each step"])
def test_a_save_killed_at_any_step_leaves_a_checkpoint_that_resumes(tmp_path, monkeypatch, inside):
    n = _steps_of_one_save(tmp_path, monkeypatch)
    assert n >= 6  # the save of DCP, the manifest, two renames, the deletes
    for k in range(n):
        path = str(tmp_path / f"{k}" / "ck")
        os.makedirs(os.path.dirname(path))
        ck.save_sharded(path, _state(1), 0)
        with pytest.MonkeyPatch.context() as m:
            faults = Faults(m, k, inside)
            with pytest.raises(Killed):
                ck.save_sharded(path, _state(2), 0)
        _check_after_kill(path, faults)


def _two_ranks(rank, world, errors, root, inside):
    """Each kill point of rank 0 where it works alone, after every rank's shards are written (the manifest, the
    renames, the deletes; a kill before leaves a .tmp without a manifest, as in one process), under two ranks whose
    shards DCP writes as in a real run; the killed rank still meets the last barrier, which a dead rank's peers
    would time out of."""
    import torch.distributed as dist

    k = 0
    while True:
        path = os.path.join(root, f"{int(inside)}-{k}", "ck")
        if rank == 0:
            os.makedirs(os.path.dirname(path))
        dist.barrier()
        ck.save_sharded(path, _state(1), rank)
        faults = None
        with pytest.MonkeyPatch.context() as m:
            if rank == 0:
                faults = Faults(m, k, inside, after_shards=True)
            try:
                ck.save_sharded(path, _state(2), rank)
                killed = False
            except Killed:
                killed = True
                dist.barrier()  # the one save_sharded's other rank waits at
        done = [killed]
        dist.broadcast_object_list(done, src=0)
        if not done[0]:
            return
        got = _loaded_step(path)  # both ranks: a load is collective
        if rank == 0:
            try:
                ck.probe_writable_folder(path)
                if not (got == 2 if faults.manifest_written else got in (1, 2)):
                    errors.put(f"kill at {k}: resumed step {got}")
            except Exception as e:  # reported; the ranks go on together
                errors.put(f"kill at {k}: {type(e).__name__}: {e}")
        dist.barrier()
        ck.save_sharded(path, _state(3), rank)
        if rank == 0 and sorted(os.listdir(os.path.dirname(path))) != ["ck"]:
            errors.put(f"kill at {k}: left {os.listdir(os.path.dirname(path))}")
        k += 1


@pytest.mark.parametrize("inside", [False, True], ids=["before each step", "inside each step"])
def test_two_ranks_a_save_killed_at_any_step_of_rank_0_leaves_a_checkpoint_that_resumes(tmp_path, inside):
    run_ranks(_two_ranks, 2, str(tmp_path), inside, timeout_s=300)


def _views_differ(rank, world, errors, root):
    """Rank 0 sees a complete CK.tmp (step 2) beside CK (step 1); rank 1 lists the folders before CK.tmp appears
    (a killed run's rank still renaming, a file system's lag): both load rank 0's choice, the same step."""
    import torch.distributed as dist

    path = os.path.join(root, "ck")
    ck.save_sharded(os.path.join(root, "newer"), _state(2), rank)
    ck.save_sharded(path, _state(1), rank)
    if rank == 0:
        os.replace(os.path.join(root, "newer"), path + ".tmp")
    dist.barrier()
    with pytest.MonkeyPatch.context() as m:
        if rank == 1:
            m.setattr(ck, "sharded_candidates", lambda p: [p])
        state = _state(0)
        folder = ck.load_newest_sharded(path, state, rank)
    got = int(state["train"]["step"])
    if (os.path.basename(folder), got) != ("ck.tmp", 2) or not torch.equal(state["w"], torch.full((64,), 2.0)):
        errors.put(f"rank {rank} loaded step {got} from {folder}")


def test_ranks_that_see_the_folders_differently_load_the_same_checkpoint(tmp_path):
    run_ranks(_views_differ, 2, str(tmp_path), timeout_s=300)


def test_resume_beside_a_half_deleted_old_folder(tmp_path, monkeypatch, capsys):
    """The repro: a complete sharded checkpoint CK and, beside it, CK.old with some of its shards and no manifest
    (an earlier version's save killed inside its last delete): train --resume resumes from CK, and its save
    leaves CK alone."""
    for mod in (train, train_setup):  # one process writing a sharded checkpoint, as a run on several GPUs does
        monkeypatch.setattr(mod, "sharded_save", lambda save, dist_run: True)
    from test_train import TINY

    path = str(tmp_path / "CK")
    assert main(["train", *TINY, "--save", path]) == 0
    shutil.copytree(path, path + ".old")
    os.remove(os.path.join(path + ".old", ck.MANIFEST))
    os.remove(os.path.join(path + ".old", sorted(n for n in os.listdir(path + ".old") if n.endswith(".distcp"))[0]))
    capsys.readouterr()
    steps = TINY[TINY.index("--steps") + 1]
    assert main(["train", *TINY[:TINY.index("--steps")], "--steps", str(int(steps) + 2),
                 *TINY[TINY.index("--steps") + 2:], "--save", path, "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {path} at step {steps}" in out, out
    assert sorted(os.listdir(tmp_path)) == ["CK"]
    ck.verify_sharded(path)
