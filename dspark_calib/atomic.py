"""Atomic file writes: temp file in the destination directory, fsync, rename.

Readers (an operator's `inspect`, a vLLM starting from a table directory, the
profile driver polling a worker's capture) see the old file or the new one,
never half of one; a writer killed mid-write leaves only a hidden temp file.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, BinaryIO, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, durable: bool = True) -> str:
    """durable=False skips the fsyncs: still never half a file, but may be lost on power failure
    (progress reports written inside a timed loop must not stall it).

    An OSError (here or from `write`) names `path`, never the temp file: the user
    knows the path they gave, not ours.
    """
    path = os.fspath(path)
    try:
        return _write(path, write, durable)
    except OSError as exc:
        if exc.strerror is None or exc.filename == path:
            raise
        raise type(exc)(exc.errno, exc.strerror, path) from None


def _write(path: str, write: Callable[[BinaryIO], None], durable: bool) -> str:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".dspark-calib-", suffix=".tmp", dir=directory)
    try:
        # mkstemp makes the file 0600; a table must be readable like any file we write
        # (a vLLM server may run as another user), so give it open()'s mode.
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        _fsync_dir(directory)
    return path


def atomic_write_json(path: str | os.PathLike, obj: Any, *, durable: bool = True) -> str:
    return atomic_write(path, lambda fh: fh.write(json.dumps(obj).encode()), durable=durable)


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask would, process-wide)
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _fsync_dir(directory: str) -> None:
    # The rename itself is durable only once the directory entry is on disk.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
