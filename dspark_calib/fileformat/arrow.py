"""Arrow columns to numpy, straight from their buffers (shared by the table and observe file readers).

Not ChunkedArray.to_numpy(): even a zero-copy conversion imports pandas, which
would triple `inspect`'s start-up; and a Python string per row for the `record`
column would cost more than the rest of a load. Types are checked by the caller
(table.file.COLUMNS, observe.step.COLUMNS) before anything here runs.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

_NUMPY_TYPES = {pa.int64(): np.int64, pa.float64(): np.float64, pa.bool_(): np.bool_}


def _bits(buf: pa.Buffer, off: int, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")[off:off + n].view(bool)


def column(arrow: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, valid) of one fixed-width column. Values where valid is False are meaningless."""
    col = arrow.column(name)
    typ = col.type
    dtype = _NUMPY_TYPES[typ]
    values, valid = [], []
    for chunk in col.chunks:
        n, off = len(chunk), chunk.offset
        if n == 0:
            continue
        bufs = chunk.buffers()
        valid.append(np.ones(n, dtype=bool) if bufs[0] is None or chunk.null_count == 0 else _bits(bufs[0], off, n))
        if bufs[1] is None:  # an all-null column (added by a migration, or all rows of another record kind)
            values.append(np.zeros(n, dtype=dtype))
        elif typ == pa.bool_():
            values.append(_bits(bufs[1], off, n))
        else:
            values.append(np.frombuffer(bufs[1], dtype=dtype)[off:off + n])
    if not values:
        return np.zeros(0, dtype=dtype), np.zeros(0, dtype=bool)
    return np.concatenate(values), np.concatenate(valid)


_INDEX_TYPES = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64}


def _plain_codes(chunk: pa.Array, words: Sequence[str]) -> np.ndarray:
    n, off = len(chunk), chunk.offset
    bufs = chunk.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32)[off:off + n + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    code = np.full(n, -1, dtype=np.int8)
    for i, word in enumerate(words):
        raw = np.frombuffer(word.encode(), dtype=np.uint8)
        rows = np.flatnonzero(lengths == len(raw))
        if len(rows):
            same = (data[starts[rows, None] + np.arange(len(raw))] == raw).all(axis=1)
            code[rows[same]] = i
    if bufs[0] is not None and chunk.null_count:
        code[~_bits(bufs[0], off, n)] = -1
    return code


def _dictionary_codes(chunk: pa.DictionaryArray, words: Sequence[str]) -> np.ndarray:
    """A dictionary chunk (how the readers read string columns): its few dictionary values are
    compared, then looked up by index."""
    known = np.append(_plain_codes(chunk.dictionary, words), np.int8(-1))  # the last: nulls, bad indices
    indices = chunk.indices
    n, off = len(indices), indices.offset
    bufs = indices.buffers()
    idx = np.frombuffer(bufs[1], dtype=_INDEX_TYPES[indices.type])[off:off + n].astype(np.int64)
    bad = (idx < 0) | (idx >= len(known) - 1)
    if bufs[0] is not None and indices.null_count:
        bad |= ~_bits(bufs[0], off, n)
    idx[bad] = len(known) - 1
    return known[idx]


def list_column(arrow: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, valid) of a list<int64> or list<float64> column: values (rows, widest list), shorter
    lists padded with 0 (int64) or NaN (float64); values of invalid (null) rows are meaningless."""
    dtype = _NUMPY_TYPES[arrow.column(name).type.value_type]
    fill = np.nan if dtype is np.float64 else 0
    rows, valid = [], []
    for chunk in arrow.column(name).chunks:
        n, off = len(chunk), chunk.offset
        if n == 0:
            continue
        bufs = chunk.buffers()  # validity, int32 offsets, child validity, child values
        valid.append(np.ones(n, dtype=bool) if bufs[0] is None or chunk.null_count == 0 else _bits(bufs[0], off, n))
        offsets = np.frombuffer(bufs[1], dtype=np.int32)[off:off + n + 1].astype(np.int64)
        child = chunk.values  # the whole child array: offsets index it directly
        data = (np.frombuffer(bufs[3], dtype=dtype)[child.offset:child.offset + len(child)] if bufs[3] is not None
                else np.zeros(len(child), dtype=dtype))
        lengths = np.diff(offsets)
        out = np.full((n, int(lengths.max(initial=0))), fill, dtype=dtype)
        for j in range(out.shape[1]):  # a position at a time: temporaries of one row each, not (rows, width)
            has = np.flatnonzero(lengths > j)
            out[has, j] = data[offsets[has] + j]
        rows.append(out)
    if not rows:
        return np.full((0, 1), fill, dtype=dtype), np.zeros(0, dtype=bool)
    width = max(1, max(r.shape[1] for r in rows))
    if len(rows) == 1 and rows[0].shape[1] == width:  # one chunk (a row group): no copy
        return rows[0], valid[0]
    return (np.concatenate([np.pad(r, ((0, 0), (0, width - r.shape[1])), constant_values=fill) for r in rows]),
            np.concatenate(valid))


def list_lengths(arrow: pa.Table, name: str) -> np.ndarray:
    """Each row's list length in a list column, from its offsets alone (before list_column sizes
    an array by the longest; pyarrow.compute would import pandas)."""
    out = []
    for chunk in arrow.column(name).chunks:
        n, off = len(chunk), chunk.offset
        if n:
            out.append(np.diff(np.frombuffer(chunk.buffers()[1], dtype=np.int32)[off:off + n + 1]))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)


def string_codes(arrow: pa.Table, name: str, words: Sequence[str]) -> np.ndarray:
    """A string column (plain or dictionary) as indices into `words` (-1: null or any other string),
    by byte comparison."""
    codes = [(_dictionary_codes(chunk, words) if pa.types.is_dictionary(chunk.type) else _plain_codes(chunk, words))
             for chunk in arrow.column(name).chunks if len(chunk)]
    return np.concatenate(codes) if codes else np.zeros(0, dtype=np.int8)
