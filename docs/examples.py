"""Run the command examples of README.md and docs/**/*.md; check their output, or rewrite it.

    python docs/examples.py            # check: exit 1 and a diff for each example that differs
    python docs/examples.py --write    # rewrite each example with what its commands print now
    python docs/examples.py docs/commands.md   # only these files

An example is a ``` block whose first line starts with `$ dspark-calib`. Each `$ ` line
(with the lines a trailing backslash continues) is a command; the block is the transcript:
every command as written, then what it printed, stdout and stderr together. Commands run in
one bash per block, so `$ echo $?` shows the previous command's exit status, with
`dspark-calib` meaning this checkout (`python -m dspark_calib`, the interpreter running this
script), COLUMNS=100 and NO_COLOR=1, in a scratch directory that links every top-level entry
of the repository: paths read as from the repository root, and files an example writes
(`echo junk > junk.parquet`, `--out out/`) land in the scratch directory, never in the
checkout.

An HTML comment on the line before a block says what in it is not plain output:

    <!-- example: skip REASON -->       not run (it needs a GPU, ...); REASON is printed
    <!-- example: needs vllm -->        run only where vllm imports, else skipped (light install)
    <!-- example: light install -->     run only where vllm does not import (it shows what the
                                        light install prints), else skipped
    <!-- example: lines 1-12, 40- -->   only these lines of the transcript (and every command
                                        line) are shown; each run of left-out lines is one `...`
    <!-- example: new hash -->          the hash of a table the example writes differs on every
                                        run (created_at is hashed): compared as <hash>

Directives combine with `;` (`<!-- example: needs vllm; lines 1-3 -->`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```[\w-]*$")
# What importing vLLM on a machine without a GPU prints to stderr (torch's deprecation and CUDA
# lines, vLLM's missing kernels): timestamped or machine-dependent, never dspark-calib's output.
TORCH_NOISE = re.compile(r"^([WIE]\d{4} \d\d:\d\d:\d\d\.\d+ |Failed to import from vllm\._C)")
MARKER = re.compile(r"^<!--\s*example:\s*(.*?)\s*-->$")
PROMPT = "$ dspark-calib"
ELIDED = "..."
# A table written by an example: its file name and summary line carry the hash.
NEW_HASH = (re.compile(r"(?<=__)[0-9a-f]{12}(?=\.parquet)"), re.compile(r"(?<=^table )[0-9a-f]{12}(?=:)", re.M))
TIMEOUT_S = 120


@dataclass
class Example:
    path: Path
    start: int  # index of the block's first line (after the fence) in the file's lines
    end: int  # index of the closing fence
    lines: list[str]
    skip: str = ""
    needs_vllm: bool = False
    light_only: bool = False
    keep: list[tuple[int, int | None]] = field(default_factory=list)  # 1-based, inclusive; None: to the end
    new_hash: bool = False

    @property
    def where(self) -> str:
        shown = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{shown}:{self.start + 1}"


def parse_marker(text: str, ex: Example) -> None:
    for directive in (d.strip() for d in text.split(";")):
        if directive.startswith("skip"):
            ex.skip = directive[4:].strip() or "marked skip"
        elif directive == "needs vllm":
            ex.needs_vllm = True
        elif directive == "light install":
            ex.light_only = True
        elif directive == "new hash":
            ex.new_hash = True
        elif directive.startswith("lines "):
            for part in directive[6:].split(","):
                lo, _, hi = part.strip().partition("-")
                ex.keep.append((int(lo), int(hi) if hi else None) if _ else (int(lo), int(lo)))
        else:
            raise SystemExit(f"{ex.where}: unknown example directive {directive!r}")


def find_examples(path: Path) -> list[Example]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]) and i + 1 < len(lines) and lines[i + 1].startswith(PROMPT):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            ex = Example(path, i + 1, end, lines[i + 1:end])
            marker = MARKER.match(lines[i - 1]) if i else None
            if marker:
                parse_marker(marker.group(1), ex)
            out.append(ex)
            i = end
        i += 1
    return out


def commands(lines: list[str]) -> list[list[str]]:
    """Each command's lines as written: a `$ ` line and the lines its trailing backslashes continue."""
    out: list[list[str]] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("$ "):
            cmd = [lines[i]]
            while cmd[-1].endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd.append(lines[i])
            out.append(cmd)
        i += 1
    return out


def _scratch() -> Path:
    """A directory that reads as the repository root and takes what examples write."""
    d = Path(tempfile.mkdtemp(prefix="dspark-calib-examples-"))
    for entry in REPO.iterdir():
        if entry.name != ".git":
            (d / entry.name).symlink_to(entry)
    shim = d / ".bin"
    shim.mkdir()
    (shim / "dspark-calib").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m dspark_calib \"$@\"\n")
    (shim / "dspark-calib").chmod(0o755)
    return d


def run(ex: Example) -> str:
    """The transcript the block's commands print now."""
    script = ["exec 2>&1", "__rc=0"]
    for cmd in commands(ex.lines):
        script.append("printf '%s\\n' " + " ".join(shlex.quote(line) for line in cmd))
        script.append("(exit $__rc); " + "\n".join(cmd)[2:])
        script.append("__rc=$?")
    cwd = _scratch()
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb", "PYTHONPATH": str(REPO),
           "PATH": f"{cwd / '.bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("FORCE_COLOR", None)
    try:
        done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    finally:
        shutil.rmtree(cwd, ignore_errors=True)
    return "\n".join(line.rstrip() for line in done.stdout.splitlines() if not TORCH_NOISE.match(line))


def shown(ex: Example, transcript: str) -> list[str]:
    """The transcript as the block shows it: only the kept lines, `...` for each gap."""
    lines = transcript.splitlines()
    if not ex.keep:
        return lines
    keep = [False] * len(lines)
    at = 0
    for cmd in commands(ex.lines):  # every command stays: a left-out one would not run next time
        at = next((i for i in range(at, len(lines)) if lines[i:i + len(cmd)] == cmd), len(lines))
        keep[at:at + len(cmd)] = [True] * len(cmd)
    for lo, hi in ex.keep:
        for n in range(lo, (hi or len(lines)) + 1):
            if 1 <= n <= len(lines):
                keep[n - 1] = True
    out: list[str] = []
    for line, k in zip(lines, keep):
        if k:
            out.append(line)
        elif not out or out[-1] != ELIDED:
            out.append(ELIDED)
    return out


def normalized(ex: Example, lines: list[str]) -> list[str]:
    """What is compared: trailing spaces (rich pads wrapped lines) and new hashes left out."""
    text = "\n".join(line.rstrip() for line in lines)
    if ex.new_hash:
        for pattern in NEW_HASH:
            text = pattern.sub("<hash>", text)
    return text.splitlines()


def skip_reason(ex: Example) -> str:
    if ex.skip:
        return ex.skip
    if ex.needs_vllm and importlib.util.find_spec("vllm") is None:
        return "needs vllm (not installed here)"
    if ex.light_only and importlib.util.find_spec("vllm") is not None:
        return "shows the light install (vllm is installed here)"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README.md and docs/**/*.md).")
    ap.add_argument("--write", action="store_true", help="Rewrite each example with its real output.")
    args = ap.parse_args(argv)
    files = [p.resolve() for p in args.files] or [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    failed = ran = 0
    for path in files:
        examples = find_examples(path)
        text = path.read_text().splitlines()
        for ex in reversed(examples):  # from the end: rewriting keeps earlier line numbers valid
            reason = skip_reason(ex)
            if reason:
                print(f"skip {ex.where}: {reason}")
                continue
            ran += 1
            got = shown(ex, run(ex))
            if args.write:
                text[ex.start:ex.end] = got
            elif normalized(ex, got) != normalized(ex, ex.lines):
                failed += 1
                print(f"DIFFERS {ex.where}:")
                sys.stdout.writelines(difflib.unified_diff([line + "\n" for line in ex.lines],
                                                           [line + "\n" for line in got], "docs", "now"))
        if args.write:
            path.write_text("\n".join(text) + "\n")
    print(f"{ran} examples run, {failed} differ" + (" (rewritten)" if args.write else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
