"""Listing and bounded reading of the table files a load decision may consider.

Tables come from shared directories and buckets that other people can write to
so everything here is bounded and nothing trusts a name or a byte:

* only regular files are opened: stat before opening, open with O_NONBLOCK and
  fstat the handle (a FIFO or device named x.parquet is refused, never waited on);
* the metadata (footer, bounded by the footer limits) of at most `max_tables`
  table files is checked, the newest by modification time (a fixed count, so every
  host examines the same files); at most `max_candidates` curve reads per decision
  (the best candidates by their checked metadata first), the rest counted in the
  line; at most `max_scan` directory entries looked at;
* each file is opened once (file.TableFile): its metadata and its curves come from
  that one handle and the curve read verifies the content hash the checked metadata
  states, so what is checked is what is loaded; raw samples are never read;
* footer limits (metadata bytes, rows, row groups, curve points) are checked before
  the rows are decoded, so a small file cannot decompress into gigabytes;
* object stores get connect/request timeouts and no retries; the caller also
  bounds the whole decision with a deadline (selection.decide_within).
"""

from __future__ import annotations

import os
import stat
import urllib.parse
from dataclasses import dataclass
from typing import Any

from dspark_calib.errors import CalibError, escape
from dspark_calib.safe_open import os_reason  # standard library only
from dspark_calib.table.meta import SERVE_LIMITS as _READ  # the reader's limits (meta.py imports no pyarrow)
from dspark_calib.table.meta import ReadLimits


@dataclass(frozen=True)
class Limits:
    """Serve-time bounds: the listing's own, plus the reader's ReadLimits (defaults: meta.SERVE_LIMITS)."""

    max_candidates: int = 64  # curve reads per decision
    max_tables: int = 1000  # table files whose metadata a decision checks (newest modification first)
    max_scan: int = 100_000  # directory entries looked at
    io_timeout_s: float = 5.0  # object stores: connect and per-request
    max_file_bytes: int = _READ.max_file_bytes  # only the footer and curve rows are read, never the samples
    max_metadata_bytes: int = _READ.max_metadata_bytes
    max_rows: int = _READ.max_rows
    max_row_groups: int = _READ.max_row_groups
    max_curve_points: int = _READ.max_curve_points

    @property
    def read_limits(self) -> ReadLimits:
        return ReadLimits(self.max_file_bytes, self.max_metadata_bytes, self.max_rows, self.max_row_groups,
                          self.max_curve_points)


SERVE_LIMITS = Limits()




@dataclass(frozen=True)
class Listing:
    paths: tuple[str, ...]  # to check, newest modification first (at most max_tables)
    refused: tuple[tuple[str, str], ...] = ()  # (path, why) not opened at all
    skipped: int = 0  # directory entries beyond max_scan, not looked at
    over: int = 0  # table files beyond max_tables (the oldest by modification), not examined


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
        raise CalibError(os_reason(exc), path=escape(path)) from None
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
                refused.append((entry.path, os_reason(exc)))
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
    # A fixed count, not the deadline, bounds the metadata reads: the same files are examined on
    # every host, so `check` says what the engine does (1000 footers read well within the
    # default deadline). The newest by modification time are kept; the line counts the rest.
    found.sort(key=lambda item: (-item[0], item[1]))
    kept = found[: limits.max_tables]
    return Listing(tuple(p for _, p in kept), tuple(refused), unscanned, len(found) - len(kept))


# -- one bounded read -------------------------------------------------------------------
def open_table(path: str, fs: Any, limits: Limits = SERVE_LIMITS) -> Any:
    """The TableFile over ONE handle: its .meta (checked by the load decision) and its
    .read(samples=False) (the curves loaded) come from that handle, and the read verifies the
    content hash the metadata states, so what is checked is what is loaded. Local files are
    stat'ed, opened O_NONBLOCK and fstat'ed (a FIFO is refused, never waited on); the footer
    limits are checked before any row is decoded. The caller closes it (a context manager)."""
    from dspark_calib.table.file import TableFile

    return TableFile.open(path, filesystem=fs, limits=limits.read_limits)
