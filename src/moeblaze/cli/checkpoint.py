"""Training checkpoints that can't lie: written atomically, verified when read.

File format: one header line `moeblaze-checkpoint 1 <sha256 of the payload, hex>`, then the payload (what
torch.save writes for the state dict). A file whose header or checksum doesn't match (a flipped byte, a
truncation, random bytes written into it) is refused with CheckpointError, never loaded.

Writes go to `<path>.tmp.<pid>` in the same folder, are fsynced, then renamed over `<path>` (and the folder
fsynced), so a crash or a kill mid-save leaves the previous checkpoint whole. A kill leaves its temporary
behind; the next save of the same path removes every temporary whose process no longer runs.

Memory: the serialized payload once in host memory while saving or loading.
"""
from __future__ import annotations

import glob
import hashlib
import io
import os
import shutil
import tempfile

import torch

MAGIC = b"moeblaze-checkpoint 1 "


class CheckpointError(ValueError):
    """A checkpoint file that is not one, or not the one that was written."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(path: str) -> list[str]:
    """Delete `<path>.tmp.<pid>` files left by killed saves (their pid no longer runs); the removed paths."""
    removed = []
    for tmp in glob.glob(glob.escape(path) + ".tmp.*"):
        pid = tmp.rsplit(".", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            os.remove(tmp)
            removed.append(tmp)
    return removed


def probe_writable(path: str, what: str = "checkpoint") -> None:
    """Raise CheckpointError unless a file (a checkpoint, or `what`) can be written at `path` (its folder is
    created if missing)."""
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise CheckpointError(f"{path} is a directory; give the {what}'s file path")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=os.path.basename(path) + ".probe."):
            pass
    except (FileExistsError, NotADirectoryError) as e:
        blocker = folder
        while not os.path.exists(blocker):
            blocker = os.path.dirname(blocker)
        raise CheckpointError(f"can't write the {what} at {path}: {blocker} is a file, not a folder") from e
    except OSError as e:
        raise CheckpointError(f"can't write the {what} at {path}: {e.strerror or e} ({e.filename or folder})") from e


def save_checkpoint(path: str, state: dict) -> None:
    """Write `state` to `path` atomically, with its checksum."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    remove_stale_temporaries(path)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n")
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power loss
    finally:
        os.close(fd)


def check_header(path: str) -> None:
    """CheckpointError unless the file at `path` starts as a checkpoint does (its first line only: a cheap check
    before any work; load_checkpoint verifies the whole file)."""
    with open(path, "rb") as f:
        header = f.readline(len(MAGIC) + 80)
    if not header.startswith(MAGIC):
        raise CheckpointError(f"{path} is not a moeblaze checkpoint (no 'moeblaze-checkpoint 1' header): "
                              "written by another program, or its first bytes are damaged")


def load_checkpoint(path: str, map_location=None) -> dict:
    """The state saved at `path`, after its checksum is verified (CheckpointError otherwise)."""
    with open(path, "rb") as f:
        data = f.read()
    header, sep, payload = data.partition(b"\n")
    if not sep or not header.startswith(MAGIC):
        raise CheckpointError(f"{path} is not a moeblaze checkpoint (no 'moeblaze-checkpoint 1' header): "
                              "written by another program, or its first bytes are damaged")
    if hashlib.sha256(payload).hexdigest().encode() != header[len(MAGIC):]:
        raise CheckpointError(f"{path} is corrupted: its contents don't match the checksum written with them "
                              "(changed or truncated after it was saved); refusing to load it")
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)


# Sharded checkpoints (training under torchrun): one folder written by torch.distributed.checkpoint (DCP), every
# rank writing its own shards, with a manifest of each file's sha256 that rank 0 writes last. A save goes to
# `<path>.tmp`; once every rank has written and the manifest is on disk, rank 0 swaps it in: `<path>` -> `<path>.old`,
# `<path>.tmp` -> `<path>`, and the earlier folder is deleted by way of a rename to `<path>.trash` (so a kill inside
# a delete leaves only a folder whose name says it is garbage). Every state a kill can leave holds a complete
# checkpoint: `<path>.tmp` with its manifest (the newest), else `<path>`, else `<path>.old`; a load takes the newest
# that verifies (load_newest_sharded), and the next save first finishes or clears what a killed one left (the only
# folders it deletes are its own names: `.tmp`, `.trash`, and an `.old` beside a `<path>` with its manifest). A load
# verifies the manifest first (rank 0, one broadcast) and refuses a changed, truncated or missing file. DCP reshards
# on load: a checkpoint written at one mesh shape loads at another. Assumes, as DCP does, one file system every rank
# sees.
MANIFEST = "moeblaze-manifest.sha256"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def probe_writable_folder(path: str) -> None:
    """Raise CheckpointError unless a sharded checkpoint (a folder) can be written at `path`: a save writes
    `<path>.tmp` beside it and renames, so the parent folder must take new entries (probed with a file of a unique
    name, so that every rank can probe at once)."""
    if os.path.isfile(path.rstrip("/" + os.sep) or path):
        raise CheckpointError(f"{path} is a file; a sharded checkpoint is a folder (give a folder path)")
    path = path.rstrip("/" + os.sep) or path
    complete = os.path.isfile(os.path.join(path, MANIFEST))
    # an .old beside a complete checkpoint is what a save killed inside its last delete leaves: its own, not foreign
    for folder in (path,) if complete else (path, path + ".old"):
        if os.path.isdir(folder) and os.listdir(folder) and not os.path.isfile(os.path.join(folder, MANIFEST)):
            raise CheckpointError(f"{folder} holds files but no {MANIFEST}: a damaged or foreign checkpoint, which a "
                                  "run would overwrite; move it away or give another path")
    probe_writable(os.path.join(os.path.dirname(os.path.abspath(path)), os.path.basename(path) + ".probe"))


def sharded_candidates(path: str) -> list[str]:
    """The folders a killed save can leave a complete checkpoint in, newest first, those with a manifest."""
    return [p for p in (path + ".tmp", path, path + ".old") if os.path.isfile(os.path.join(p, MANIFEST))]


def sharded_checkpoint_path(path: str) -> str | None:
    """The newest folder with a manifest among `<path>.tmp`, `<path>` and `<path>.old` (None if none has one)."""
    found = sharded_candidates(path)
    return found[0] if found else None


def load_newest_sharded(path: str, state: dict, rank: int) -> str:
    """load_sharded from the newest folder of `path`'s save that verifies (a killed save may have left a newer or
    an older one than `path`); that folder. CheckpointError on every rank, naming what was wrong, if none does.
    Rank 0's view of the folders decides for every rank (broadcast): ranks that list them at different moments (a
    killed run's processes still renaming, a file system's lag) would otherwise load different folders."""
    import torch.distributed as dist

    found = [sharded_candidates(path) if rank == 0 else None]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    problems = []
    for folder in found[0]:
        try:
            load_sharded(folder, state, rank)
            return folder
        except CheckpointError as e:
            problems.append(str(e))
    raise CheckpointError(f"no complete checkpoint at {path}: {'; '.join(problems) or 'no manifest'}")


def _discard(folder: str, path: str) -> None:
    """Delete a folder of `path`'s save: renamed to `<path>.trash` first, then removed."""
    trash = path + ".trash"
    if os.path.isdir(folder):
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _swap_in(path: str) -> None:
    """`<path>.tmp` (complete, with its manifest) becomes `<path>`; the folder it replaces is discarded."""
    old = path + ".old"
    _discard(old, path)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(path + ".tmp", path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    _discard(old, path)


def finish_interrupted_save(path: str) -> None:
    """Rank 0, before a save: a complete `<path>.tmp` is swapped in (a save killed after its manifest), then a
    partial `.tmp`, a `.trash` and an `.old` beside a complete `<path>` are removed (a save killed earlier, or inside
    a delete). Nothing else is touched."""
    tmp = path + ".tmp"
    if os.path.isfile(os.path.join(tmp, MANIFEST)):
        try:
            verify_sharded(tmp)
            _swap_in(path)
        except (CheckpointError, OSError):
            pass
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(path + ".trash", ignore_errors=True)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        _discard(path + ".old", path)


def _write_manifest(folder: str) -> None:
    names = sorted(n for n in os.listdir(folder) if n != MANIFEST)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        f.writelines(f"{_sha256(os.path.join(folder, n))}  {n}\n" for n in names)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(folder)


def save_sharded(path: str, state: dict, rank: int) -> None:
    """Every rank calls it with its state dict (DTensors for sharded values); see the section's comment."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    together = dist.is_available() and dist.is_initialized()
    barrier = dist.barrier if together else (lambda: None)
    if rank == 0:
        finish_interrupted_save(path)
    barrier()
    dcp.save(state, checkpoint_id=path + ".tmp", no_dist=not together)
    barrier()  # every rank's files are written
    if rank == 0:
        _write_manifest(path + ".tmp")
        _swap_in(path)
    barrier()


def verify_sharded(path: str) -> None:
    """CheckpointError unless every file the manifest lists is there with its checksum, and no other."""
    listed = {}
    with open(os.path.join(path, MANIFEST)) as f:
        for line in f:
            digest, _, name = line.rstrip("\n").partition("  ")
            listed[name] = digest
    present = set(os.listdir(path)) - {MANIFEST}
    if present != set(listed):
        raise CheckpointError(f"{path} is incomplete or has foreign files: missing {sorted(set(listed) - present)}, "
                              f"unexpected {sorted(present - set(listed))}")
    for name, digest in listed.items():
        if _sha256(os.path.join(path, name)) != digest:
            raise CheckpointError(f"{path}/{name} is corrupted: its contents don't match the checksum written with "
                                  "them; refusing to load the checkpoint")


def load_sharded(path: str, state: dict, rank: int) -> None:
    """Load the sharded checkpoint at `path` into `state` in place (every rank, or one process without a process
    group: DCP reshards to whatever the state's tensors are), after rank 0 has verified it; CheckpointError on
    every rank if it is not whole."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    together = dist.is_available() and dist.is_initialized()
    problem = [None]
    if rank == 0:
        try:
            verify_sharded(path)
        except (CheckpointError, OSError) as e:
            problem = [str(e)]
    if together:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0])
    dcp.load(state, checkpoint_id=path, no_dist=not together)
