"""Schema versions ("major.minor"), the append-only migration lists of both file formats, and
the creation time every file of the project records beside its version.

A reader accepts every minor of its major: an older minor is brought up to date by
its format's ``Migrations`` (llm's ``migrations.py`` style: ``@migrations.add(from,
to)`` on a function, applied in order); a newer or older major is refused naming
both versions. Standard library only: the serve-time metadata checks use it before
pyarrow is imported.
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass
from typing import Any, Callable

from dspark_calib.errors import CalibError


def utc_now() -> str:
    """Now in UTC to the second, as a file's ``created_at`` records it (2026-12-03T09:26:15Z)."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def parse_version(text: Any, path: str | None = None, what: str = "schema_version") -> tuple[int, int]:
    m = re.fullmatch(r"(\d{1,4})\.(\d{1,4})", str(text))
    if not m:
        raise CalibError(f"bad {what} {str(text)[:40]!r}", path=path)
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class Migration:
    from_version: str
    to_version: str
    apply: Callable[..., tuple[Any, dict]]


class Migrations(list):
    """One format's migrations (a list of Migration, in version order); ``add`` registers one
    (a decorator)."""

    def __init__(self, current: str):
        super().__init__()
        self.current = current

    def add(self, from_version: str, to_version: str) -> Callable:
        def register(fn: Callable[..., tuple[Any, dict]]) -> Callable:
            self.append(Migration(from_version, to_version, fn))
            return fn
        return register

    def apply(self, data: Any, meta: dict, path: str | None = None) -> tuple[Any, dict, tuple[int, int]]:
        """(data, meta) migrated from meta's schema_version up to ``current``, and the version reached."""
        version, current = parse_version(meta["schema_version"], path), parse_version(self.current)
        for m in self:
            if version < current and parse_version(m.from_version) == version:
                data, meta = m.apply(data, meta)
                version = parse_version(m.to_version)
        return data, meta, version
