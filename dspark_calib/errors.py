"""One exception type for every user-facing failure.

The CLI turns it into one line on stderr and exit code 2; nothing else
in the package prints for errors, so library callers keep control.
"""

import os

# Every line this package writes to a log or to stderr starts so: operators grep for it.
PREFIX = "dspark-calib: "


def display_path(path: object) -> str:
    """A file name fit for one line: undecodable bytes and control characters escaped (idempotent:
    a name shown once is shown the same again)."""
    text = os.fsencode(str(path)).decode("utf-8", "backslashreplace")
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


class CalibError(Exception):
    """A problem the user can fix: bad file, bad option, missing dependency."""

    def __init__(self, message: str, *, path: object = None):
        # every path shown the same way, inputs and outputs alike (a \xff byte, not a surrogate)
        self.path = None if path is None else display_path(path)
        if self.path == "":  # an empty argument (`inspect ""`): still say which input failed
            self.path = "''"
        super().__init__(f"{self.path}: {message}" if self.path else message)


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's text (or its type name): pyarrow and vLLM errors
    can span many lines, and every message we pass on must stay one line."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


def escape(text: object, limit: int = 80) -> str:
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


def exception_line(exc: BaseException, limit: int = 200) -> str:
    """'Type: first line' of an exception: what a log line says of a failure it survived."""
    return f"{type(exc).__name__}: {first_line(exc, limit) if str(exc).strip() else ''}"


def unprefixed(text: str) -> str:
    """A line another part of dspark-calib made, without its PREFIX (to be said again in a new line)."""
    return text.removeprefix(PREFIX)
