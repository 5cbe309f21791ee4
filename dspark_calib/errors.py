"""One exception type for every user-facing failure.

The CLI turns it into one line on stderr and exit code 2; nothing else
in the package prints for errors, so library callers keep control.
"""


class CalibError(Exception):
    """A problem the user can fix: bad file, bad option, missing dependency."""

    def __init__(self, message: str, *, path: object = None):
        self.path = None if path is None else str(path)
        super().__init__(f"{self.path}: {message}" if self.path else message)


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's text (or its type name): pyarrow and vLLM errors
    can span many lines, and every message we pass on must stay one line."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]
