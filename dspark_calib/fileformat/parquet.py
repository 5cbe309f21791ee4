"""A Parquet file read within ``ReadLimits``: what a read will decode is known, and bounded,
before any page of it is decompressed (shared by the table and observe file readers).

Why the pages themselves are read: a few kilobytes of Parquet can decode to gigabytes.
A dictionary page holding one long string that every row points at, or a page of zeros
compressed by zstd, declares its decoded size in its own page header, and the footer's
per-chunk totals are the writer's word, which pyarrow does not hold the pages to. So
before a read, ``BoundedParquet`` walks the page headers of every column chunk it will
read, exactly as pyarrow's page reader will (from the chunk's first page until the
chunk's values are all seen), and sums what each page decompresses to plus what the
values become as arrays; over ``max_decoded_bytes`` (or ``max_pages`` pages) is refused
in one line naming the file, before pyarrow decodes anything. String columns are read
as dictionaries (``dictionary=``), so a value repeated on every row is held once.

The page headers are Thrift compact structs; ``_Thrift`` reads just enough of the
protocol to find each page's type, sizes and value count and to skip the rest.
"""

from __future__ import annotations

from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from dspark_calib.errors import CalibError, first_line
from dspark_calib.fileformat.limits import ReadLimits, check_limit

MAX_PAGE_HEADER = 64 << 10  # a page header is tens of bytes (hundreds with statistics)
PREFETCH = 4 << 20  # the chunks a read decodes, fetched in one read when they span at most this
# pyarrow lets a chunk run up to 100 bytes past its stated end (files of old parquet-mr
# writers left the dictionary page header out of the chunk's size; the writer name is the
# file's own word): pages are walked that far too.
CHUNK_PADDING = 100
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3  # page types; 1 (index) and unknown ones pyarrow skips undecoded
_PAGE_FIELD = {_DATA_PAGE: 5, _DICTIONARY_PAGE: 7, _DATA_PAGE_V2: 8}  # PageHeader field of each page's own header


class _Damaged(Exception):
    pass


# What is kept of the Thrift structs read (field id -> what to keep inside it; LEAF: the value).
LEAF = None
_PAGE_HEADER = {1: LEAF, 2: LEAF, 3: LEAF, 5: {1: LEAF}, 7: {1: LEAF}, 8: {1: LEAF}}  # type, sizes, value counts
# FileMetaData.row_groups[].columns[].meta_data: num_values, total_compressed_size, data and dictionary page offsets
_FOOTER_CHUNKS = {4: {1: {3: {5: LEAF, 7: LEAF, 9: LEAF, 11: LEAF}}}}
MAX_LIST = 1 << 16  # elements of a list kept (row groups, column chunks); skipped lists are not stored


class _Thrift:
    """A Thrift compact-protocol reader over bytes. A struct is read as {field id: value} holding
    only the fields its `keep` spec names (integers, bools, structs, lists of them); every other
    field is skipped, so what is stored is bounded by the spec, whatever the bytes hold."""

    def __init__(self, data: bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Damaged("Thrift data runs past what was read")
        self.pos += 1
        return self.data[self.pos - 1]

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.data):
            raise _Damaged("Thrift data runs past what was read")
        self.pos += n

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise _Damaged("Thrift varint over 64 bits")

    def zigzag(self) -> int:
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def struct(self, keep: dict, depth: int = 0) -> dict[int, Any]:
        if depth > 16:
            raise _Damaged("Thrift data nested too deeply")
        out: dict[int, Any] = {}
        last = 0
        while True:
            b = self.byte()
            kind = b & 0x0F
            if kind == 0:  # STOP
                return out
            last = last + (b >> 4) if b >> 4 else self.zigzag()
            if last in keep:
                out[last] = self.value(kind, depth, keep[last])
            else:
                self.value(kind, depth, {})

    def value(self, kind: int, depth: int, keep: dict | None, in_list: bool = False) -> Any:
        if kind in (1, 2):  # bool: in the field header, or one byte in a list
            return self.byte() == 1 if in_list else kind == 1
        if kind == 3:
            return self.byte()
        if kind in (4, 5, 6):  # i16, i32, i64
            return self.zigzag()
        if kind == 7:  # double
            return self.skip(8)
        if kind == 8:  # binary
            return self.skip(self.varint())
        if kind in (9, 10):  # list, set
            b = self.byte()
            n = self.varint() if b >> 4 == 15 else b >> 4
            if keep and n > MAX_LIST:
                raise _Damaged(f"a Thrift list of {n} elements")
            if keep:
                return [self.value(b & 0x0F, depth + 1, keep, True) for _ in range(n)]
            for _ in range(n):  # every element takes a byte or more: a skipped list is bounded by the data
                self.value(b & 0x0F, depth + 1, {}, True)
            return None
        if kind == 11:  # map
            n = self.varint()
            types = self.byte() if n else 0
            for _ in range(n):
                self.value(types >> 4, depth + 1, {}, True)
                self.value(types & 0x0F, depth + 1, {}, True)
            return None
        if kind == 12:
            return self.struct(keep or {}, depth + 1)
        raise _Damaged(f"unknown Thrift type {kind}")


def _leaves(typ: pa.DataType) -> int:
    """How many Parquet leaf columns (column chunks) an Arrow type is stored as."""
    return sum(_leaves(typ.field(i).type) for i in range(typ.num_fields)) if typ.num_fields else 1


def _leaf_starts(schema: pa.Schema) -> dict[str, int]:
    """Each top-level column's first leaf column: a row group's chunks are per leaf, so a column
    after a struct (several leaves) is not at its own position in the schema."""
    starts, at = {}, 0
    for f in schema:
        starts.setdefault(f.name, at)
        at += _leaves(f.type)
    return starts


def _read_at(handle: Any, offset: int, n: int) -> bytes:
    if hasattr(handle, "read_at"):  # a pyarrow file (object stores)
        return handle.read_at(n, offset).to_pybytes()
    handle.seek(offset)
    return handle.read(n)


class BoundedParquet:
    """One Parquet file over one open handle, its footer checked against ``limits`` at open
    and every read's decoded size checked before the read (see the module docstring).
    ``dictionary``: the string columns, read as dictionaries.

    pyarrow's reader calls back into the Python handle (taking the GIL) from C++, so it is
    closed before the handle is, on every path (``close``, or the ``with`` block): a reader
    left to a refusal's traceback would be destroyed only while the interpreter shuts down,
    where taking the GIL can end the process."""

    file: Any = None

    def __enter__(self) -> "BoundedParquet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close pyarrow's reader (not the handle: the caller's)."""
        reader, self.file = self.file, None
        if reader is not None:
            reader.close()

    def __init__(self, handle: Any, size: int, path: str, limits: ReadLimits, *, dictionary: Sequence[str] = ()):
        try:
            self._open(handle, size, path, limits, dictionary)
        except BaseException:
            self.close()
            raise

    def _open(self, handle: Any, size: int, path: str, limits: ReadLimits, dictionary: Sequence[str]) -> None:
        self.handle, self.path, self.limits = handle, path, limits
        check_limit("file size", size, limits.max_file_bytes, "max_file_bytes", path)
        if size < 12:
            raise CalibError("not a readable parquet file (too short)", path=path)
        handle.seek(size - 8)
        tail = handle.read(8)
        if tail[4:] != b"PAR1":
            raise CalibError("not a readable parquet file (no PAR1 footer)", path=path)
        footer = int.from_bytes(tail[:4], "little")
        check_limit("parquet footer bytes", footer, limits.max_metadata_bytes, "max_metadata_bytes", path)
        if footer + 12 > size:
            raise CalibError("not a readable parquet file (footer longer than the file)", path=path)
        self.data_end, self.footer_bytes = size - 8 - footer, footer  # pages lie before the footer
        handle.seek(0)
        self.file = pq.ParquetFile(handle, page_checksum_verification=True)
        self.schema = self.file.schema_arrow  # the types as stored (read: string columns as dictionaries)
        seen: set[str] = set()
        for name in self.schema.names:  # a column is read by its name: two of one name read as neither
            if name in seen:
                raise CalibError(f"column {name[:40]!r} appears more than once (damaged file)", path=path)
            seen.add(name)
        strings = [n for n in dictionary if n in self.schema.names]
        if strings:  # pyarrow refuses a dictionary column the file lacks; the footer is parsed once
            first = self.file
            self.file = pq.ParquetFile(handle, page_checksum_verification=True, metadata=first.metadata,
                                       read_dictionary=strings)
            first.close()
        md = self.file.metadata
        check_limit("row groups", md.num_row_groups, limits.max_row_groups, "max_row_groups", path)
        check_limit("rows", md.num_rows, limits.max_rows, "max_rows", path)
        self.group_rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        if md.num_rows != sum(self.group_rows):
            raise CalibError("row counts in the parquet footer disagree (damaged file)", path=path)
        self.strings = frozenset(strings)
        self._span: tuple[int, Any] = (0, b"")

    def read(self, groups: Sequence[int], columns: Sequence[str]) -> pa.Table:
        """Row groups `groups`, columns `columns`: their decoded size checked first, their row
        counts after (page checksums do not cover the footer: a damaged count there makes
        pyarrow read fewer rows without complaint)."""
        path = self.path
        try:
            chunks = self._chunks(groups, columns)
            decoded = self._decoded_bytes(chunks)
        except _Damaged as exc:
            raise CalibError(f"not a readable parquet file ({exc})", path=path) from None
        check_limit("bytes decoded", decoded, self.limits.max_decoded_bytes, "max_decoded_bytes", path)
        # one thread: a read is small (the budget above), so a pool buys nothing here
        arrow = self.file.read_row_groups(list(groups), columns=list(columns), use_threads=False)
        if arrow.num_rows != sum(self.group_rows[g] for g in groups):
            raise CalibError("row counts in the parquet footer disagree (damaged file)", path=path)
        return arrow

    def _chunks(self, groups: Sequence[int], columns: Sequence[str]) -> list[tuple[int, str, dict]]:
        """(row group, column, ColumnMetaData fields) of each chunk to read, parsed from the footer's bytes
        here: pyarrow's own accessor (RowGroupMetaData.column) aborts the process on some
        damaged chunk metadata that its reader refuses with an exception."""
        md = self.file.metadata
        if md.num_row_groups * md.num_columns > MAX_LIST:
            raise CalibError(f"{md.num_row_groups} row groups of {md.num_columns} columns are over the {MAX_LIST} "
                             "column chunks a file may have", path=self.path)
        footer = _read_at(self.handle, self.data_end, self.footer_bytes)
        row_groups = _Thrift(footer).struct(_FOOTER_CHUNKS).get(4)
        if not isinstance(row_groups, list) or len(row_groups) != len(self.group_rows):
            raise _Damaged("the footer's row groups disagree")
        index = _leaf_starts(self.schema)
        paths = self.file.schema  # the Parquet leaf columns, in chunk order
        out = []
        for g in groups:
            chunks = row_groups[g].get(1) if isinstance(row_groups[g], dict) else None
            if not isinstance(chunks, list) or len(chunks) != md.num_columns:
                raise _Damaged(f"the footer's row group {g} lacks its column chunks")
            for name in columns:
                path = paths.column(index[name]).path
                if path != name and not path.startswith(name + "."):  # never another column's chunk
                    raise _Damaged(f"column {name[:40]} is not the file's leaf column {index[name]} ({path[:40]})")
                meta = chunks[index[name]].get(3) if isinstance(chunks[index[name]], dict) else None
                if not isinstance(meta, dict) or not all(isinstance(meta.get(k), int) for k in (5, 7, 9)):
                    raise _Damaged(f"column {name[:40]} of row group {g} lacks its metadata")
                # a flat column holds one value per row; a list column (one leaf) at least one a row
                # (an empty or null list still counts one), each counted in the decode budget below
                nested = pa.types.is_list(self.schema.field(name).type)
                rows = self.group_rows[g]
                if (meta[5] < rows) if nested else (meta[5] != rows):
                    raise CalibError("row counts in the parquet footer disagree (damaged file)", path=self.path)
                out.append((g, name, meta))
        return out

    def _decoded_bytes(self, chunks: list[tuple[int, str, dict]]) -> int:
        """What reading these chunks allocates at most: each page as its header says it
        decompresses, 8 bytes a value, and a string column's pages once more (its dictionary)."""
        spans = []
        for g, name, meta in chunks:
            values, stored, data_at, dict_at = meta[5], meta[7], meta[9], meta.get(11)
            if values == 0:  # pyarrow reads no page of an empty chunk
                continue
            # where pyarrow starts the chunk (ComputeColumnChunkRange)
            start = dict_at if isinstance(dict_at, int) and 0 < dict_at < data_at else data_at
            if start < 4 or stored < 0 or start + stored > self.data_end:
                raise _Damaged(f"column {name[:40]} of row group {g} lies outside the file's pages")
            spans.append((name, values, start, min(start + stored + CHUNK_PADDING, self.data_end), data_at))
        if spans:  # small chunks (curves): their bytes in one read, not one per page (object stores)
            lo, hi = min(s[2] for s in spans), max(s[3] for s in spans)
            self._span = (lo, memoryview(_read_at(self.handle, lo, hi - lo))) if hi - lo <= PREFETCH else (0, b"")
        total = pages = 0
        try:
            for name, values, start, end, data_at in spans:
                size, n = self._pages(start, end, values, self.limits.max_pages - pages, data_at)
                pages += n
                total += size * (2 if name in self.strings else 1) + 8 * values
        finally:
            self._span = (0, b"")
        return total

    def _bytes(self, pos: int, n: int) -> Any:
        at, data = self._span
        if at <= pos and pos + n <= at + len(data):
            return data[pos - at:pos + n - at]
        return _read_at(self.handle, pos, n)

    def _pages(self, pos: int, end: int, values: int, pages_left: int, data_at: int) -> tuple[int, int]:
        """(bytes the pages decompress to, pages) from pos until `values` values are seen, as
        pyarrow's page reader walks them (index and unknown pages are skipped undecoded). A page
        must start at data_at, the first data page's offset, so the walk is pyarrow's from there
        whichever of the two offsets it starts at."""
        seen = size = pages = 0
        buf, buf_at, pages_at_data = b"", pos, pos == data_at
        while seen < values:
            if pos >= end:
                raise _Damaged(f"a column chunk ends after {seen} of its {values} values")
            if pos > data_at and not pages_at_data:
                raise _Damaged("no page starts at the column chunk's first data page offset")
            pages_at_data = pages_at_data or pos == data_at
            if pages >= pages_left:
                raise CalibError(f"pages to read exceed the read limit max_pages={self.limits.max_pages}",
                                 path=self.path)
            if not buf_at <= pos < buf_at + len(buf) - 256:  # a header's worth of bytes from pos on
                buf, buf_at = self._bytes(pos, min(MAX_PAGE_HEADER, end - pos)), pos
            reader = _Thrift(buf, pos - buf_at)
            try:
                header = reader.struct(_PAGE_HEADER)
            except _Damaged:
                if len(buf) - (pos - buf_at) >= MAX_PAGE_HEADER or buf_at + len(buf) >= end:
                    raise
                buf, buf_at = b"", pos  # the header runs on past this window: read from pos
                continue
            kind, decoded, stored = header.get(1), header.get(2), header.get(3)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (kind, decoded, stored)) \
                    or decoded < 0 or stored < 0:
                raise _Damaged("a page header lacks its type or sizes")
            pages += 1
            if kind in _PAGE_FIELD:
                size += decoded
                own = header.get(_PAGE_FIELD[kind])
                count = own.get(1) if isinstance(own, dict) else None
                if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                    raise _Damaged("a page header lacks its value count")
                if kind != _DICTIONARY_PAGE:
                    seen += count
            pos += (reader.pos - (pos - buf_at)) + stored
        return size, pages


def open_bounded(handle: Any, size: int, path: str, limits: ReadLimits, *, dictionary: Sequence[str] = ()) -> BoundedParquet:
    """BoundedParquet, every failure one CalibError naming the file (the handle is the caller's)."""
    try:
        return BoundedParquet(handle, size, path, limits, dictionary=dictionary)
    except CalibError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for bad files
        raise CalibError(f"not a readable parquet file ({first_line(exc)})", path=path) from None
