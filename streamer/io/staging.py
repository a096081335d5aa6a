"""A folder written whole or not at all: an export (a Hugging Face folder, a PEFT adapter) goes to a hidden
sibling first and replaces the destination only once every file in it is written and synced.

Call order:

    StagedFolder.refuse(directory, overwrite, hint)   # optional, before any work: a file, a link, a full folder
    with StagedFolder(directory, overwrite, hint) as folder:
        ... write into folder.path ...
        folder.commit()                                 # sync, then swap in (the old folder goes after the rename)

Leaving the block without `commit` (an error, a kill's exception) removes the staging folder; one a SIGKILL left
is removed by the next export to the same destination, unless an export in progress holds its lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import uuid
from pathlib import Path

from streamer.errors import CheckpointError
from streamer.store.slabfile import fsync_path


class StagedFolder:
    """`directory`, written through a staging folder beside it. `overwrite`: a folder holding files may be
    replaced; `hint` is how the caller's user asks for that (`pass --overwrite`, `pass overwrite=True`)."""

    def __init__(self, directory: str | Path, overwrite: bool = False, hint: str = "pass overwrite=True") -> None:
        self.directory, self.overwrite, self.hint = Path(directory), overwrite, hint
        self.refuse(self.directory, overwrite, hint)
        self.path = self.directory.parent / f".{self.directory.name}.partial-{uuid.uuid4().hex[:8]}"
        self._lock = -1  # the staging folder's descriptor, locked from its creation to the block's end

    @staticmethod
    def refuse(directory: Path, overwrite: bool, hint: str) -> None:
        """A file, a symbolic link (the swap would replace the link, not where it points) or, without
        `overwrite`, a folder holding files: refused in one line."""
        if directory.exists() and not directory.is_dir():
            raise CheckpointError(f"{directory} is a file; choose a folder to export to")
        if not overwrite and directory.is_dir() and any(directory.iterdir()):
            raise CheckpointError(f"{directory} is not empty; choose a new folder or {hint}")
        if directory.is_symlink():
            raise CheckpointError(f"{directory} is a symbolic link; export to the folder it points to "
                                  f"({directory.resolve()}) or choose a new folder")

    def __enter__(self) -> StagedFolder:
        """Create the staging folder, locked while this block lives, and remove the staging folders of earlier
        exports to the same folder that a kill left behind (no live export holds their lock).

        Under an exclusive lock on the parent folder, which exports beside it hold only for this: no export is
        then between creating its staging folder and locking it, so a fresh one is never taken for stale."""
        try:
            self.directory.parent.mkdir(parents=True, exist_ok=True)
            parent = os.open(self.directory.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(parent, fcntl.LOCK_EX)
                self._remove_stale()
                self.path.mkdir()
                self._lock = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(parent)  # and with it the parent's lock
        except OSError as exc:
            raise CheckpointError(f"cannot create {self.path} ({exc.strerror}); "
                                  "choose a folder you can write to") from None
        return self

    def _remove_stale(self) -> None:
        pattern = glob.escape(f".{self.directory.name}.partial-") + "*"
        for path in self.directory.parent.glob(pattern):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError:  # not a folder (nor one we made)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # an export in progress
                continue
            finally:
                os.close(fd)
            shutil.rmtree(path, ignore_errors=True)

    def commit(self) -> None:
        """Sync every file written, then replace the destination with the staging folder, the old one removed
        only after the rename. A full disk is one line; the staging folder is removed on any failure."""
        try:
            for path in [*self.path.iterdir(), self.path]:
                fsync_path(path)
            self.refuse(self.directory, self.overwrite, self.hint)  # again: something may have been written there
            if self.directory.exists():
                retired = self.directory.parent / f".{self.directory.name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(self.directory, retired)
                os.replace(self.path, self.directory)
                shutil.rmtree(retired)
            else:
                os.replace(self.path, self.directory)
            fsync_path(self.directory.parent)
        except OSError as exc:
            raise CheckpointError(f"writing {self.directory} failed ({exc.strerror}: {exc.filename}); "
                                  "free disk space or choose another folder") from None

    def __exit__(self, *_: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)  # nothing left there once committed
        with contextlib.suppress(OSError):
            os.close(self._lock)
