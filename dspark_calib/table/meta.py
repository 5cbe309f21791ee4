"""What a table file says about itself, checked before any column is read: the metadata
(TableMeta), and the limits a table read stays within at serve time and in the CLI
(fileformat.limits.ReadLimits). No pyarrow here: the serve-time listing (sources.py) bounds
its reads with these before pyarrow is imported.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from dataclasses import dataclass
from typing import Any

from dspark_calib.errors import CalibError
from dspark_calib.fileformat.limits import ReadLimits, check_limit, load_json
from dspark_calib.fileformat.version import Migrations, parse_version
from dspark_calib.fingerprint import Fingerprint

METADATA_KEY = b"dspark_calib"
EARLIEST = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


# -- limits -----------------------------------------------------------------------------
# Serving reads curves only: a real table's are a few thousand points and a footer of kilobytes.
SERVE_LIMITS = ReadLimits(max_file_bytes=256 << 20, max_metadata_bytes=1 << 20, max_rows=4_000_000,
                          max_row_groups=256, max_curve_points=1 << 18, max_decoded_bytes=64 << 20, max_pages=4096)
# The CLI reads what a user points it at, raw samples too: the largest real table is a few
# thousand rows; 128 MiB decoded is about a million (docs/shared-storage.md: the bounds).
CLI_LIMITS = ReadLimits(max_file_bytes=4 << 30, max_metadata_bytes=64 << 20, max_rows=20_000_000,
                        max_row_groups=1 << 16, max_curve_points=1 << 22, max_decoded_bytes=128 << 20,
                        max_pages=1 << 16)


# -- metadata ---------------------------------------------------------------------------
def parse_created_at(text: Any, path: str | None = None, *, now: dt.datetime | None = None) -> dt.datetime:
    """ISO 8601 with a UTC offset ("Z" or +00:00), not before 2025 nor more than a day ahead:
    the load decision picks the newest table by it, so "9999-..." must not win."""
    if not isinstance(text, str) or not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?(Z|[+-]\d\d:\d\d)", text):
        raise CalibError(f"created_at {str(text)[:40]!r} is not an ISO 8601 UTC timestamp", path=path)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise CalibError(f"created_at {text!r} is not a valid date", path=path) from None
    if when.utcoffset() != dt.timedelta(0):
        raise CalibError(f"created_at {text!r} is not in UTC", path=path)
    now = now or dt.datetime.now(dt.timezone.utc)
    if not EARLIEST <= when <= now + dt.timedelta(days=1):
        raise CalibError(f"created_at {text!r} is implausible (before {EARLIEST:%Y-%m-%d} or in the future)", path=path)
    return when


@dataclass(frozen=True)
class TableMeta:
    """A table's metadata as the file stores it, validated (what read_metadata returns)."""

    schema_version: str
    tool_version: str
    created_at: dt.datetime
    content_hash: str
    fingerprint: Fingerprint
    samples_digest: str | None  # None: a 1.0 file
    curve_rows: int | None  # None: a 1.0 file (curves and samples share one row group)
    raw: dict[str, Any] = dataclasses.field(repr=False, compare=False)


def parse_meta(raw: dict | None, path: str, limits: ReadLimits, migrations: Migrations) -> TableMeta:
    """The metadata checked, its fingerprint read as `migrations` (the table format's, in
    file.py) bring it to the current schema; ``raw`` keeps the metadata as stored (the hash's)."""
    if not raw or METADATA_KEY not in raw:
        raise CalibError("parquet file without dspark-calib metadata (not a cost table)", path=path)
    meta = load_json(raw[METADATA_KEY], path, limits)
    if not isinstance(meta, dict):
        raise CalibError("malformed metadata: not a JSON object", path=path)
    for key in ("schema_version", "fingerprint", "content_hash", "created_at"):
        if key not in meta:
            raise CalibError(f"metadata lacks {key}", path=path)
    version = parse_version(meta["schema_version"], path)
    if not isinstance(meta["content_hash"], str) or not re.fullmatch(r"[0-9a-f]{64}", meta["content_hash"]):
        raise CalibError("metadata content_hash is not a sha256 hex digest", path=path)
    created = parse_created_at(meta["created_at"], path)
    digest = curve_rows = None
    if version >= (1, 1):
        digest, curve_rows = meta.get("samples_digest"), meta.get("curve_rows")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise CalibError("metadata samples_digest is missing or not a sha256 hex digest", path=path)
        if type(curve_rows) is not int or curve_rows < 0:
            raise CalibError(f"metadata curve_rows {str(curve_rows)[:20]} is not a row count", path=path)
        check_limit("curve points", curve_rows, limits.max_curve_points, "max_curve_points", path)
    try:
        fingerprint = Fingerprint.from_dict(migrations.apply(None, dict(meta), path)[1]["fingerprint"])
    except CalibError as exc:
        raise CalibError(str(exc), path=path) from None
    return TableMeta(schema_version=str(meta["schema_version"]), tool_version=str(meta.get("tool_version", "")),
                     created_at=created, content_hash=meta["content_hash"], fingerprint=fingerprint,
                     samples_digest=digest, curve_rows=curve_rows, raw=meta)
