"""Opening an input file that may be hostile: never block, never follow surprises silently.

Tables (and start-up JSONs) come from shared directories and buckets. A FIFO or a
device named ``x.parquet`` must be refused before anything reads it (a FIFO would
block the open or the first read forever), and the errors a user can act on
(permission, symlink loop, a name that is not UTF-8) are said as such.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any, BinaryIO

from dspark_calib.errors import CalibError, display_path, first_line


def os_reason(exc: OSError) -> str:
    """An OSError as the few words a one-line error shows (every reader of local paths uses it)."""
    if isinstance(exc, FileNotFoundError):
        return "no such file"
    if isinstance(exc, PermissionError):
        return "permission denied"
    if exc.errno == errno.ELOOP:
        return "symlink loop (too many levels of symbolic links)"
    if isinstance(exc, IsADirectoryError):
        return "is a directory, not a file"
    return f"cannot open ({exc.strerror or type(exc).__name__})"


def _refuse_non_regular(mode: int, shown: str) -> None:
    if stat.S_ISDIR(mode):
        raise CalibError("is a directory, not a file", path=shown)
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise CalibError(f"is {kind}, not a regular file; not reading it", path=shown)


def open_local(path: str, shown: str) -> tuple[BinaryIO, int]:
    """stat, open O_NONBLOCK (a FIFO swapped in after the stat cannot block the open), fstat
    the descriptor: what we read is the regular file we checked, whatever happens to the name."""
    try:
        _refuse_non_regular(os.stat(path).st_mode, shown)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CalibError(os_reason(exc), path=shown) from None
    try:
        st = os.fstat(fd)
        _refuse_non_regular(st.st_mode, shown)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def open_lock_file(path: str, shown: str) -> int:
    """A lock file's descriptor, read-write, created when absent: never through a symlink (its
    target would be truncated and written), never a FIFO or a device (a FIFO blocks, and
    ftruncate fails on it), O_NONBLOCK so a swapped-in FIFO cannot block the open. Every problem
    is one CalibError naming the file."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise CalibError("is a symlink; a lock file is never followed (remove it)", path=shown) from None
        raise CalibError(os_reason(exc), path=shown) from None
    try:
        _refuse_non_regular(os.fstat(fd).st_mode, shown)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_fs(filesystem: Any, path: str, shown: str) -> tuple[Any, int]:
    import pyarrow.fs as pafs

    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise CalibError("file name is not valid UTF-8", path=shown) from None
    try:
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise CalibError("no such file", path=shown)
        if info.type == pafs.FileType.Directory:
            raise CalibError("is a directory, not a file", path=shown)
        if info.type != pafs.FileType.File:
            raise CalibError("is not a regular file; not reading it", path=shown)
        handle = filesystem.open_input_file(path)
        return handle, handle.size()
    except CalibError:
        raise
    except OSError as exc:
        raise CalibError(os_reason(exc) if exc.errno else f"cannot open ({first_line(exc)})", path=shown) from None
    except Exception as exc:  # noqa: BLE001 - object stores raise their own types
        raise CalibError(f"cannot open ({first_line(exc)})", path=shown) from None


MAX_JSON_BYTES = 16 << 20  # a model's config.json or an EngineArgs file: kilobytes; more is not one


def read_json_file(path: str, shown: str | None = None, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A small local JSON file (config.json, --engine-args-json), through open_local: a FIFO or a
    device is refused, never read or waited on; over max_bytes is refused before it is parsed.
    Every problem is one CalibError naming the file."""
    return read_json_bytes(path, shown, max_bytes=max_bytes)[1]


def read_json_bytes(path: str, shown: str | None = None, *, max_bytes: int = MAX_JSON_BYTES) -> tuple[bytes, Any]:
    """read_json_file's (the bytes read, the JSON they hold): one read, so a digest of the bytes
    is a digest of what was parsed."""
    shown = display_path(path) if shown is None else shown
    limit = f"{max_bytes >> 20} MiB" if max_bytes >= 1 << 20 else f"{max_bytes >> 10} KiB"
    fh, size = open_local(path, shown)
    with fh:
        if size > max_bytes:
            raise CalibError(f"is {size} bytes, over the {limit} a JSON input may have", path=shown)
        try:
            raw = fh.read(max_bytes + 1)
        except OSError as exc:
            raise CalibError(os_reason(exc), path=shown) from None
    if len(raw) > max_bytes:  # grew after the stat
        raise CalibError(f"is over the {limit} a JSON input may have", path=shown)
    try:
        return raw, json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CalibError(f"not UTF-8 text (byte {exc.start}): not a JSON file", path=shown) from None
    except ValueError as exc:
        raise CalibError(f"not JSON ({first_line(exc)})", path=shown) from None
