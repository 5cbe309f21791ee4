"""The CLI's paths: outputs (--plot, --out) checked before any work, never onto an input;
inputs given twice refused.

Every rule here runs before a table is read or a curve is fitted, so a bad path costs
nothing and names the path the user typed (never a temp file). A path that resolves to
an input (same file after realpath, or os.path.samefile through hard links) is refused:
`inspect T --plot T` or `merge A B --out A` would otherwise replace the input. Any
other existing file is replaced only with --force, or by a table of the same content hash
(nothing is lost then). Parent directories are never created, and a new --out directory
is one only when its name ends with '/': a typo must not grow a tree from /, nor turn
`ab.parqet` into a directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from dspark_calib.errors import CalibError, display_path
from dspark_calib.render.plots import FORMATS, plot_format

TABLE_SUFFIX = ".parquet"


def same_file(a: str, b: str) -> bool:
    """a and b name one file: equal after realpath, or the same inode (hard link, bind mount)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist (yet): realpath already said all there is
        return False


def refuse_inputs(path: str, inputs: Sequence[str], option: str) -> None:
    for source in inputs:
        if same_file(path, source):
            raise CalibError(f"{option} would overwrite the input {display_path(source)}; choose another path",
                             path=path)


def _check_parent(path: str, option: str) -> None:
    parent = os.path.dirname(os.path.abspath(path.rstrip("/" + os.sep) or path))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist (not created: make it first)"
        raise CalibError(f"{option}: directory {display_path(parent)} {what}", path=path)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CalibError(f"{option}: directory {display_path(parent)} is not writable", path=path)


def _not_empty(path: str, option: str) -> None:
    if not path.strip():
        raise CalibError(f"{option}: empty path")


def plot_path(path: str | None, inputs: Sequence[str], option: str = "--plot", *, force: bool = False) -> str | None:
    """The plot file to write (None: no plot). Its suffix names the format; an existing file is
    replaced only with --force."""
    if path is None:
        return None
    _not_empty(path, option)
    refuse_inputs(path, inputs, option)  # first: the worst mistake gets the clearest message
    if not plot_format(path):
        suffix = os.path.splitext(path)[1] or "no suffix"
        raise CalibError(f"{option}: unknown plot format ({suffix}); use {', '.join('.' + f for f in FORMATS)}",
                         path=path)
    return _new_file(path, option, force)


SEED_SUFFIX = ".json"


def seed_out(path: str, inputs: Sequence[str], option: str = "--out", *, force: bool = False) -> str:
    """The estimator seed file to write: a new .json file (an existing one only with --force),
    never an input."""
    _not_empty(path, option)
    refuse_inputs(path, inputs, option)
    if not path.endswith(SEED_SUFFIX):
        raise CalibError(f"{option}: a seed is a {SEED_SUFFIX} file; end the name with {SEED_SUFFIX}", path=path)
    return _new_file(path, option, force)


def _new_file(path: str, option: str, force: bool) -> str:
    """A file path a command may write: not a directory or a special file, an existing file only
    with force, its parent an existing writable directory."""
    if os.path.isdir(path):
        raise CalibError(f"{option}: is a directory; give a file name", path=path)
    if os.path.exists(path) and not os.path.isfile(path):
        raise CalibError(f"{option}: exists and is not a regular file", path=path)
    if os.path.lexists(path) and not force:
        raise CalibError(f"{option}: exists; pass --force to replace it", path=path)
    _check_parent(path, option)
    return path


@dataclass(frozen=True)
class TableOut:
    """A checked --out: a file, or a directory the table's default file name goes into."""

    given: str
    is_dir: bool
    inputs: tuple[str, ...]
    option: str = "--out"
    force: bool = False

    @property
    def directory(self) -> str:
        return self.given if self.is_dir else os.path.dirname(os.path.abspath(self.given))

    def make_directory(self) -> bool:
        """Creates the --out directory itself (never its parents) if it is new; True when it did."""
        if not self.is_dir or os.path.isdir(self.given):
            return False
        try:
            os.mkdir(self.given)
        except OSError as exc:
            raise CalibError(f"{self.option}: cannot make the directory ({exc.strerror})", path=self.given) from None
        return True

    def destination(self, default_name: str, content_hash: str) -> tuple[str, str | None]:
        """(the file to write, a line to print when it replaces a table of the same content hash),
        once the table is known; still before anything is written. Creates the --out directory
        itself (never its parents)."""
        path = os.path.join(self.given, default_name) if self.is_dir else self.given
        if self.is_dir:
            refuse_inputs(path, self.inputs, self.option)
            if os.path.exists(path) and not os.path.isfile(path):
                raise CalibError(f"{self.option}: exists and is not a regular file", path=path)
        note = self._replacing(path, content_hash)
        self.make_directory()
        return path, note

    def _replacing(self, path: str, content_hash: str) -> str | None:
        if not os.path.lexists(path) or self.force:
            return None
        from dspark_calib.table.file import read_metadata

        try:
            found = read_metadata(path).content_hash
        except CalibError:
            found = None
        if found == content_hash:
            return f"replaced {display_path(path)}: it held a table of the same content hash ({content_hash[:12]})"
        what = f"a table of other content (hash {found[:12]})" if found else "a file that is no readable table"
        raise CalibError(f"{self.option}: exists and holds {what}; pass --force to replace it", path=path)


def table_out(out: str, inputs: Sequence[str], option: str = "--out", *, force: bool = False,
              fresh: bool = False) -> TableOut:
    """--out FILE|DIR, the one rule of every command that writes a table: an existing
    directory or a path ending in '/' is a directory (the table's default file name goes
    inside; a new one is made, its parent must exist); a name ending in .parquet is the file;
    any other name is refused (a typo must not become a directory, a table must not land in a
    file of another kind). An existing table file is replaced only with `force`, or by a table
    of the same content hash (known once the table is: TableOut.destination). `fresh`: the
    table comes from a run that stamps its own time after this check (profile), so no existing
    file can hold it and one is refused now, before the run."""
    _not_empty(out, option)
    if os.path.lexists(out) and not os.path.isdir(out):
        refuse_inputs(out, inputs, option)  # first: the worst mistake gets the clearest message
    if os.path.lexists(out) and not os.path.isdir(out) and not out.endswith(TABLE_SUFFIX):
        raise CalibError(f"{option}: must be a directory or a {TABLE_SUFFIX} file", path=out)
    inputs = tuple(inputs)
    is_dir = out.endswith(("/", os.sep)) or os.path.isdir(out)
    if not is_dir and not out.endswith(TABLE_SUFFIX):
        raise CalibError(f"{option}: no such directory; end the name with '/' for a new directory, or with "
                         f"'{TABLE_SUFFIX}' for a table file", path=out)
    if is_dir:
        if os.path.isdir(out):
            if not os.access(out, os.W_OK | os.X_OK):
                raise CalibError(f"{option}: directory is not writable", path=out)
        elif os.path.exists(out):
            raise CalibError(f"{option}: is not a directory", path=out)
        else:
            _check_parent(out, option)
        return TableOut(out, True, inputs, option, force)
    if os.path.exists(out) and not os.path.isfile(out):
        raise CalibError(f"{option}: exists and is not a regular file", path=out)
    if fresh and not force and os.path.lexists(out):
        raise CalibError(f"{option}: exists; pass --force to replace it", path=out)
    _check_parent(out, option)
    refuse_inputs(out, inputs, option)
    return TableOut(out, False, inputs, option, force)


def write_error(exc: OSError, path: str, option: str) -> CalibError:
    """An OSError while writing, said about the user's path (the temp file is ours, not theirs)."""
    return CalibError(f"{option}: cannot write ({exc.strerror or type(exc).__name__})", path=path)


def refuse_duplicate_inputs(paths: Sequence[str], what: str = "input") -> None:
    """The same file twice (by name, link or inode) would double its samples: faked precision."""
    for i, path in enumerate(paths):
        for earlier in paths[:i]:
            if same_file(path, earlier):
                raise CalibError(f"is the same file as {display_path(earlier)}; give each {what} once", path=path)


def refuse_same_tables(paths: Sequence[str], hashes: Sequence[str]) -> None:
    """Two copies of one table (same content hash: same fingerprint and curves) are one run."""
    seen: dict[str, str] = {}
    for path, digest in zip(paths, hashes):
        if digest in seen:
            raise CalibError(f"has the same content as {display_path(seen[digest])} (hash {digest[:12]}); "
                             "merging a run with itself doubles its samples", path=path)
        seen[digest] = path
