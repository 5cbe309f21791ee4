"""The bounds every read of an untrusted file stays within, and the footer JSON parsed under them.

Tables and observe files come from shared storage: a file of kilobytes must not cost
gigabytes. Each bound is checked against what the file says of itself (footer sizes,
page headers, element counts) before the matching allocation, and a refusal is one
line naming the file and the limit. Standard library only: the serve-time metadata
checks use it before pyarrow is imported.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from dspark_calib.errors import CalibError, first_line


# Engine sizes a file may state. Arrays are sized by them (a dense cost table has an entry per
# token of a step), so a forged 2^31 is refused, never allocated. Far above any engine: vLLM's
# default step is 8192 tokens, and the longest model contexts are around 10M tokens.
MAX_STEP_TOKENS = 1 << 21  # max_num_batched_tokens, CUDA-graph sizes, a step's tokens
MAX_NUM_SEQS = 1 << 16  # max_num_seqs, a step's requests (vLLM's default: 256 to 1024)
MAX_CONTEXT_LEN = 1 << 24  # max_model_len, profiled and observed contexts


@dataclass(frozen=True)
class ReadLimits:
    """Upper bounds checked before the matching allocation; each refusal is one line.

    max_decoded_bytes bounds one read's decoded size: every page the read decompresses (as
    its header declares it) plus the arrays it becomes, summed before any page is decoded
    (parquet.BoundedParquet). max_pages bounds the page headers walked to count it."""

    max_file_bytes: int
    max_metadata_bytes: int  # the parquet footer (schema, key-value metadata, row-group index)
    max_rows: int
    max_row_groups: int
    max_curve_points: int  # tables: all curves of all context lengths together
    max_decoded_bytes: int = 64 << 20
    max_pages: int = 4096
    max_json_elements: int = 100_000  # values, keys and containers of the footer JSON
    max_json_depth: int = 32  # nesting of the footer JSON


def check_limit(what: str, value: int, limit: int, name: str, path: str) -> None:
    if value > limit:
        raise CalibError(f"{what} {value} exceeds the read limit {name}={limit}", path=path)


_BRACKETS = re.compile(rb"[\[\]{}]")


def load_json(raw: bytes, path: str, limits: ReadLimits, what: str = "metadata") -> Any:
    """Footer JSON, parsed only when its element count and nesting are within the limits.

    Counted on the bytes, before parsing: every value but the first follows a comma, and
    every container opens with a bracket, so commas + brackets bound what json builds (a
    comma or bracket inside a string only makes the count larger). 240,000 ``{}`` in a
    1 MB footer would otherwise parse into ~30 MB of dicts, per file listed."""
    elements = raw.count(b",") + raw.count(b"{") + raw.count(b"[") + 1
    check_limit(f"{what} JSON elements", elements, limits.max_json_elements, "max_json_elements", path)
    depth = deepest = 0
    for m in _BRACKETS.finditer(raw):  # at most max_json_elements brackets
        depth += 1 if m.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    check_limit(f"{what} JSON nesting depth", deepest, limits.max_json_depth, "max_json_depth", path)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CalibError(f"malformed {what} JSON ({first_line(exc)[:80]})", path=path) from None
