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


def probe_writable(path: str) -> None:
    """Raise CheckpointError unless a checkpoint can be written at `path` (its folder is created if missing)."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory; give the checkpoint's file path")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=os.path.basename(path) + ".probe."):
            pass
    except (FileExistsError, NotADirectoryError) as e:
        blocker = folder
        while not os.path.exists(blocker):
            blocker = os.path.dirname(blocker)
        raise CheckpointError(f"can't write a checkpoint at {path}: {blocker} is a file, not a folder") from e
    except OSError as e:
        raise CheckpointError(f"can't write a checkpoint at {path}: {e.strerror or e} ({e.filename or folder})") from e


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
