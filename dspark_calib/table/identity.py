"""A table's content hash, under the rule of its own schema version.

``table`` below is a CostTable (model.py), read by its attributes only: model.py asks
this module for its own hash, so this module does not import it back.

Apart from the file module because the table itself asks for its hash
(``CostTable.content_hash``) and the file format checks it on every read; the format
history that defines each rule is in file.py's docstring.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from dspark_calib.fileformat.version import parse_version
from dspark_calib.fingerprint import KEYS
from dspark_calib.fit import CURVE_COLUMNS, CURVE_KINDS, CurvePair

_OPTIONAL_KEYS = frozenset(k.name for k in KEYS if k.optional)


def hash_1_0(fingerprint: dict[str, Any], curves: dict[int, CurvePair]) -> str:
    """1.0 hashed the fingerprint keys its file holds. Keys added since (``Key.optional``) are
    absent from a 1.0 file and None once read, so an unrecorded (None) optional key is left
    out: a 1.0 table hashes the same before and after migration, whatever keys came later.
    A recorded value (one set on a read 1.0 table) is hashed, so it cannot slip by."""
    fp = {k: v for k, v in fingerprint.items()
          if k != "extra" and not (v is None and k in _OPTIONAL_KEYS)}  # 1.0: notes were outside the hash
    body = {"fingerprint": fp, "curves": {str(ctx): {kind: pair.curve(kind).as_vllm() for kind in CURVE_KINDS}
                                          for ctx, pair in sorted(curves.items())}}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def hash_1_1(meta: dict[str, Any], curves: dict[int, CurvePair]) -> str:
    """sha256 of the canonical JSON of every metadata key but content_hash, then every curve
    column's little-endian bytes (NaN spreads included, as one canonical NaN)."""
    body = {k: v for k, v in meta.items() if k != "content_hash"}
    h = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    for ctx, pair in sorted(curves.items()):
        for kind in CURVE_KINDS:
            curve = pair.curve(kind)
            for c in CURVE_COLUMNS:
                arr = getattr(curve, c)
                h.update(f"/{ctx}/{kind}/{c}/{len(arr)}/".encode())
                if arr.dtype.kind == "f":
                    arr = np.where(np.isnan(arr), np.nan, arr)
                h.update(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())
    return h.hexdigest()


def meta_1_1(table: Any, version: str) -> dict[str, Any]:
    """The metadata as `version` writes it (1.1: no telemetry key, 1.2: no calibration key, so a read older table keeps its hash)."""
    curve_rows = sum(len(p.draft) + len(p.verify) for p in table.curves.values())
    meta = {"schema_version": version, "tool_version": table.tool_version, "created_at": table.created_at,
            "fingerprint": table.fingerprint.to_dict(), "curve_rows": curve_rows, "samples_digest": table.samples_digest}
    if parse_version(version) >= (1, 2):
        meta["telemetry"] = table.telemetry.to_json() if table.telemetry is not None else None
    if parse_version(version) >= (1, 3):
        meta["calibration"] = table.calibration.to_json() if table.calibration is not None else None
    return meta


def content_hash(table: Any) -> str:
    """The hash under the rule of the table's own schema version (a read 1.0 table keeps its 1.0 hash)."""
    if parse_version(table.schema_version) < (1, 1):
        return hash_1_0(table.fingerprint.to_dict(), table.curves)
    return hash_1_1(meta_1_1(table, table.schema_version), table.curves)
