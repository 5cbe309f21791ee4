"""Listing and bounded reading of the table files a load decision may consider.

Tables come from shared directories and buckets that other people can write to
(issue 12), so everything here is bounded and nothing trusts a name or a byte:

* only regular files are opened: stat before opening, open with O_NONBLOCK and
  fstat the handle (a FIFO or device named x.parquet is refused, never waited on);
* at most `max_candidates` files per directory (newest modification first), the
  rest skipped with a count; at most `max_scan` directory entries looked at;
* each file is read once, into memory, up to `max_file_bytes`; its metadata and
  its curves both come from those bytes, so what is checked is what is loaded;
* footer limits (metadata bytes, rows, row groups) are checked before the rows
  are decoded, so a small file cannot decompress into gigabytes;
* object stores get connect/request timeouts and no retries; the caller also
  bounds the whole decision with a deadline (loader.decide_within).
"""

from __future__ import annotations

import os
import stat
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from dspark_calib.errors import CalibError, first_line


@dataclass(frozen=True)
class Limits:
    """Serve-time bounds. TODO(integrator): fold into C1's ReadLimits / SERVE_LIMITS."""

    max_candidates: int = 64  # files read per directory
    max_scan: int = 100_000  # directory entries looked at
    max_file_bytes: int = 8 << 20  # a real table with its samples is ~25 KiB per context
    max_metadata_bytes: int = 1 << 20
    max_rows: int = 200_000
    max_row_groups: int = 64
    io_timeout_s: float = 5.0  # object stores: connect and per-request


SERVE_LIMITS = Limits()


def escape(text: Any, limit: int = 80) -> str:
    """A string from a file name or a table, made safe for one log line.

    Control characters, newlines, ANSI escapes, bidi overrides and undecodable
    bytes become visible escapes; the result is truncated to `limit` characters.
    """
    text = str(text)
    out, n = [], 0
    for ch in text:
        piece = ch if ch.isprintable() else ch.encode("unicode_escape", "backslashreplace").decode("ascii")
        out.append(piece)
        n += len(piece)
        if n > limit:
            break
    shown = "".join(out)
    return shown[:limit] + "..." if len(shown) > limit else shown


@dataclass(frozen=True)
class Listing:
    paths: tuple[str, ...]  # to read, newest modification first
    refused: tuple[tuple[str, str], ...] = ()  # (path, why) not opened at all
    skipped: int = 0  # beyond max_candidates / max_scan


# -- filesystems ------------------------------------------------------------------------
def filesystem_for(source: str, limits: Limits = SERVE_LIMITS) -> tuple[Any, str]:
    """(pyarrow filesystem or None for local, path inside it), with bounded network waits."""
    if "://" not in source:
        return None, source
    parts = urllib.parse.urlsplit(source)
    scheme = parts.scheme.lower()
    if scheme == "file":
        return None, urllib.parse.unquote(parts.path)
    query = dict(urllib.parse.parse_qsl(parts.query))
    path = (parts.netloc + parts.path).rstrip("/")
    import pyarrow.fs as pafs

    t = float(limits.io_timeout_s)
    if scheme == "s3":
        known = {k: query.pop(k) for k in ("region", "scheme", "endpoint_override") if k in query}
        if query:
            raise CalibError(f"unsupported S3 URI option(s) {escape(sorted(query))}")
        return pafs.S3FileSystem(**known, connect_timeout=t, request_timeout=t,
                                 retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1)), path
    if scheme in ("gs", "gcs"):
        import datetime

        known = {k: query.pop(k) for k in ("scheme", "endpoint_override") if k in query}
        if query:
            raise CalibError(f"unsupported GCS URI option(s) {escape(sorted(query))}")
        return pafs.GcsFileSystem(**known, retry_time_limit=datetime.timedelta(seconds=t)), path
    fs, inner = pafs.FileSystem.from_uri(source)  # hdfs etc.: bounded by the decision deadline only
    return fs, inner


# -- listing ----------------------------------------------------------------------------
def _is_table_name(name: str) -> bool:
    return name.endswith(".parquet") and not name.startswith(".")


def list_candidates(source: str, limits: Limits = SERVE_LIMITS) -> tuple[Any, Listing]:
    """The table files at `source` (a file, or the *.parquet files of a directory)."""
    fs, path = filesystem_for(source, limits)
    if fs is None:
        return None, _list_local(path, limits)
    import pyarrow.fs as pafs

    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return fs, Listing((path,))
    if info.type != pafs.FileType.Directory:
        raise CalibError("no such file or directory", path=escape(source))
    found, refused, seen = [], [], 0
    for i in fs.get_file_info(pafs.FileSelector(path)):
        seen += 1
        if seen > limits.max_scan:
            break
        if not _is_table_name(i.base_name):
            continue
        if i.type != pafs.FileType.File:
            refused.append((i.path, "not a regular file"))
        else:
            found.append((i.mtime_ns or 0, i.path))
    return fs, _cap(found, refused, limits, max(0, seen - limits.max_scan))


def _list_local(path: str, limits: Limits) -> Listing:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CalibError(_os_reason(exc), path=escape(path)) from None
    if stat.S_ISREG(st.st_mode):
        return Listing((path,))
    if not stat.S_ISDIR(st.st_mode):
        raise CalibError("not a regular file or directory (refused without opening)", path=escape(path))
    found, refused, seen, inodes = [], [], 0, set()
    with os.scandir(path) as it:
        for entry in it:
            seen += 1
            if seen > limits.max_scan:
                break
            if not _is_table_name(entry.name):
                continue
            try:
                est = entry.stat()  # follows a symlink (a link to a table is fine); never opens
            except OSError as exc:
                refused.append((entry.path, _os_reason(exc)))
                continue
            if not stat.S_ISREG(est.st_mode):
                refused.append((entry.path, "not a regular file (refused without opening)"))
            elif (est.st_dev, est.st_ino) in inodes:  # hard links / symlinks to one file: read it once
                refused.append((entry.path, "another name of a file already listed"))
            else:
                inodes.add((est.st_dev, est.st_ino))
                found.append((est.st_mtime_ns, entry.path))
    return _cap(found, refused, limits, max(0, seen - limits.max_scan))


def _cap(found: list[tuple[int, str]], refused: list, limits: Limits, unscanned: int) -> Listing:
    found.sort(key=lambda item: (-item[0], item[1]))
    keep = found[: limits.max_candidates]
    return Listing(tuple(p for _, p in keep), tuple(refused), len(found) - len(keep) + unscanned)


def _os_reason(exc: OSError) -> str:
    return {2: "no such file or directory", 13: "permission denied", 40: "symlink loop"}.get(
        exc.errno or 0, first_line(exc, 120))


# -- one bounded read -------------------------------------------------------------------
def read_bytes(path: str, fs: Any, limits: Limits = SERVE_LIMITS) -> bytes:
    """The whole file, read once, refusing anything that is not a regular file of bounded size."""
    if fs is not None:
        with fs.open_input_file(path) as fh:
            size = fh.size()
            if size > limits.max_file_bytes:
                raise CalibError(f"{size} bytes, over the {limits.max_file_bytes}-byte limit")
            return fh.read(size)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CalibError("not a regular file (refused without opening)")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise CalibError(_os_reason(exc)) from None
    try:
        st = os.fstat(fd)  # what was opened, not what the name pointed at a moment ago
        if not stat.S_ISREG(st.st_mode):
            raise CalibError("not a regular file (swapped after listing; refused)")
        if st.st_size > limits.max_file_bytes:
            raise CalibError(f"{st.st_size} bytes, over the {limits.max_file_bytes}-byte limit")
        chunks, left = [], limits.max_file_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limits.max_file_bytes:
            raise CalibError(f"grew past the {limits.max_file_bytes}-byte limit while read")
        return data
    finally:
        os.close(fd)


class _OneBuffer:
    """A pyarrow-filesystem look-alike serving one in-memory file, so today's
    read_metadata / read_table parse the bytes already read instead of reopening
    the path. TODO(integrator): replace with C1's TableFile.open(...).meta / .read(samples=False)."""

    def __init__(self, data: bytes):
        self._data = data

    def open_input_file(self, path: str) -> Any:
        import pyarrow as pa

        return pa.BufferReader(self._data)


def check_footer(data: bytes, limits: Limits = SERVE_LIMITS) -> None:
    """Footer-level bounds, before any row is decoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        md = pq.ParquetFile(pa.BufferReader(data)).metadata
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for bad files
        raise CalibError(f"not a readable parquet file ({escape(first_line(exc), 120)})") from None
    kv = md.metadata or {}
    meta_bytes = sum(len(k) + len(v) for k, v in kv.items())
    if meta_bytes > limits.max_metadata_bytes:
        raise CalibError(f"{meta_bytes} bytes of metadata, over the {limits.max_metadata_bytes}-byte limit")
    if md.num_rows > limits.max_rows:
        raise CalibError(f"{md.num_rows} rows, over the {limits.max_rows}-row limit")
    if md.num_row_groups > limits.max_row_groups:
        raise CalibError(f"{md.num_row_groups} row groups, over the {limits.max_row_groups} limit")


def read_meta(data: bytes) -> dict[str, Any]:
    """The table's metadata dict, from the bytes already read (today's read_metadata)."""
    from dspark_calib.table import read_metadata

    return read_metadata("<read>", filesystem=_OneBuffer(data))


def read_costs(data: bytes) -> Any:
    """The CostTable from the same bytes (today's read_table: verifies the content hash)."""
    from dspark_calib.table import read_table

    return read_table("<read>", filesystem=_OneBuffer(data))


def created_at_key(text: str, now: float | None = None) -> float:
    """created_at as a sortable UTC timestamp; unparseable or in the future sorts oldest, so a
    forged "9999-..." cannot win the newest-table choice (compared as text, it did)."""
    import datetime as dt

    try:
        when = dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
        if when.tzinfo is None:
            return 0.0
        ts = when.timestamp()
    except (ValueError, OverflowError, OSError):
        return 0.0
    return ts if ts <= (time.time() if now is None else now) + 86400 else 0.0
