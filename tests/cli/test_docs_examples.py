"""Every `$ dspark-calib` example in README.md and docs/ is what this checkout prints
(docs/examples.py runs them; the ones it cannot run here say why)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.helpers import REPO

TOOL = REPO / "docs" / "examples.py"


def _tool():
    spec = importlib.util.spec_from_file_location("docs_examples", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_every_docs_example_is_real_output():
    r = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " 0 differ" in r.stdout.splitlines()[-1]


def test_examples_are_found_and_every_skip_says_why():
    tool = _tool()
    found = [ex for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))] for ex in tool.find_examples(p)]
    assert len(found) >= 12 and all(ex.lines[0].startswith("$ dspark-calib") for ex in found)
    skipped = [ex for ex in found if ex.skip]
    assert [ex.lines[0].split()[2] for ex in skipped] == ["profile"]  # only the run that needs a GPU
    assert all(len(ex.skip) > 20 for ex in skipped)


def test_the_tool_checks_the_shown_lines_and_new_hashes_only(tmp_path):
    """A block whose kept lines differ is reported; `...` stands for left-out lines, never a command;
    a new table's hash is compared as <hash>; --write puts the real output back."""
    tool = _tool()
    doc = tmp_path / "x.md"
    doc.write_text("<!-- example: lines 1-2 -->\n```\n$ dspark-calib --version\n$ echo a; echo b\nwrong\n```\n")
    assert tool.main([str(doc)]) == 1
    assert tool.main([str(doc), "--write"]) == 0
    version = subprocess.run([sys.executable, "-m", "dspark_calib", "--version"], capture_output=True, text=True,
                             cwd=REPO).stdout.strip()
    assert doc.read_text().splitlines()[2:7] == ["$ dspark-calib --version", version, "$ echo a; echo b", "...", "```"]
    assert tool.main([str(doc)]) == 0
    ex = tool.Example(doc, 0, 0, [], new_hash=True)
    assert tool.normalized(ex, ["table 0123456789ab: x", "out/t__0123456789ab.parquet", "in 0123456789ab"]) == \
        ["table <hash>: x", "out/t__<hash>.parquet", "in 0123456789ab"]
