"""Regenerate the docs' tables from their data files, or check that none differs from what its data file gives.

  python -m experiments.doc_tables             # rewrite every generated table in README.md and docs/*.md in place
  python -m experiments.doc_tables --check     # change nothing; exit 1 listing each table that differs
  python -m experiments.doc_tables docs/benchmarks.md   # only these files

A generated table is a block of a Markdown file between two marker lines:

  <!-- table: VIEW docs/data/FILE.json {"param": "value", ...} -->
  ... (generated: never edit by hand)
  <!-- /table -->

VIEW names a function of experiments/doc_views.py (VIEWS), the path is the data file (cbjax/bench/doc_data.py: it
records the command, commit, CPU, date and every run), relative to the repository root, and the optional JSON
object on the same line holds the view's parameters. What lies between the markers is the view's Markdown, a
blank line, and one line naming the data file, command, commit, CPU and date. docs/archive/ is a record of past
sittings and is not regenerated. tests/test_doc_tables.py runs the check.

Every other table in these files holds no measured figure (routes, options, file lists) and says so with the line
`<!-- text table -->` directly above it; `--check` also lists a table that is neither generated nor so marked, so
a figure typed by hand cannot slip in.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys

from cbjax.bench.doc_data import provenance_line, read_doc_data
from experiments.doc_views import VIEWS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPEN = re.compile(r"^<!-- table: (?P<view>\S+) (?P<data>\S+)(?: (?P<params>\{.*\}))? -->$")
OPEN_PREFIX = "<!-- table:"
CLOSE = "<!-- /table -->"
TEXT_TABLE = "<!-- text table -->"  # the line above a table that holds no measured figure


class MarkerError(ValueError):
    """A malformed, unclosed or stray marker; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class Block:
    """One generated block: `line` is the opening marker's line (1-based); `start`:`end` the body's lines
    (0-based, `end` being the closing marker's)."""

    path: str
    line: int
    view: str
    data: str
    params: dict
    start: int
    end: int
    body: str

    def name(self) -> str:
        return f"{self.path}:{self.line}: table `{self.view}` of {self.data}"


def find_blocks(text: str, path: str = "<text>") -> list[Block]:
    """The generated blocks of a Markdown text, in order; markers inside fenced code are examples and skipped.
    MarkerError on an opening marker that does not parse, one inside another block, one never closed, or a closing
    marker without an opening one."""
    lines = text.split("\n")
    blocks, open_at, m, fenced = [], None, None, False
    for i, line in enumerate(lines):
        stripped = line.strip()
        if open_at is None and stripped.startswith(("```", "~~~")):
            fenced = not fenced  # a marker shown in a code block (how to write one) is an example, not a block
        if fenced:
            continue
        if stripped.startswith(OPEN_PREFIX):
            if open_at is not None:
                raise MarkerError(f"{path}:{i + 1}: a table marker inside the block opened at line {open_at + 1}")
            m = OPEN.match(stripped)
            if m is None:
                raise MarkerError(f"{path}:{i + 1}: a table marker is `<!-- table: VIEW DATA_FILE {{params}} -->`")
            open_at = i
        elif stripped == CLOSE:
            if open_at is None:
                raise MarkerError(f"{path}:{i + 1}: `{CLOSE}` without an opening table marker")
            try:
                params = json.loads(m["params"]) if m["params"] else {}
            except json.JSONDecodeError as e:
                raise MarkerError(f"{path}:{open_at + 1}: the view's parameters are not JSON: {e}") from None
            if not isinstance(params, dict):
                raise MarkerError(f"{path}:{open_at + 1}: the view's parameters must be a JSON object")
            body = "\n".join(lines[open_at + 1 : i])
            blocks.append(Block(path, open_at + 1, m["view"], m["data"], params, open_at + 1, i, body))
            open_at = None
    if open_at is not None:
        raise MarkerError(f"{path}:{open_at + 1}: table marker never closed by `{CLOSE}`")
    return blocks


def loose_tables(text: str, path: str = "<text>") -> list[str]:
    """'path:line: `first row`' for each Markdown table outside the generated blocks and fenced code whose line
    above is not TEXT_TABLE: a table typed by hand, which a figure may not be."""
    inside = {i for b in find_blocks(text, path) for i in range(b.start - 1, b.end + 1)}
    lines, loose, fenced = text.split("\n"), [], False
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fenced = not fenced
        starts = stripped.startswith("|") and (i == 0 or not lines[i - 1].strip().startswith("|"))
        if starts and not fenced and i not in inside and (i == 0 or lines[i - 1].strip() != TEXT_TABLE):
            loose.append(f"{path}:{i + 1}: `{stripped[:70]}`")
    return loose


def render(block: Block, root: str = ROOT) -> str:
    """What belongs between the block's markers: the view of its data file, a blank line and the provenance line.
    ValueError (naming the block) when the view, the data file or the parameters are wrong."""
    if block.view not in VIEWS:
        raise ValueError(f"{block.name()}: no view `{block.view}` (views: {', '.join(sorted(VIEWS))})")
    try:
        data = read_doc_data(os.path.join(root, block.data))
    except (OSError, ValueError) as e:
        raise ValueError(f"{block.name()}: {e}") from None
    try:
        table = VIEWS[block.view](data, **block.params)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{block.name()}: the view failed: {e}") from None
    return f"{table.rstrip()}\n\n{provenance_line(block.data, data)}"


def regenerate(text: str, path: str = "<text>", root: str = ROOT) -> tuple[str, list[Block]]:
    """The text with every block's body replaced by its rendering, and the blocks whose body differed."""
    lines = text.split("\n")
    changed = []
    for block in reversed(find_blocks(text, path)):  # from the end, so earlier blocks' line numbers hold
        new = render(block, root)
        if new != block.body:
            changed.append(block)
            lines[block.start : block.end] = new.split("\n")
    return "\n".join(lines), changed[::-1]


def doc_files(root: str = ROOT) -> list[str]:
    """README.md and docs/*.md (not docs/archive/), relative to `root`."""
    docs = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "*.md")))
    return ["README.md", *docs] if os.path.exists(os.path.join(root, "README.md")) else docs


def _first_difference(old: str, new: str) -> str:
    a, b = old.split("\n"), new.split("\n")
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"body line {i + 1}: has `{x[:80]}`, the data gives `{y[:80]}`"
    return f"the body has {len(a)} lines, the data gives {len(b)}"


def check(root: str = ROOT, files: list[str] | None = None) -> list[str]:
    """One line per problem: a table that differs from its data file, one that cannot be rendered, or one neither
    generated nor marked as text (`loose_tables`)."""
    problems = []
    for rel in files or doc_files(root):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            text = f.read()
        try:
            for block in find_blocks(text, rel):
                try:
                    new = render(block, root)
                except ValueError as e:
                    problems.append(str(e))
                    continue
                if new != block.body:
                    problems.append(f"{block.name()} differs from its data file ({_first_difference(block.body, new)})")
            problems += [
                f"{t}: a table neither generated from data nor marked `{TEXT_TABLE}`" for t in loose_tables(text, rel)
            ]
        except MarkerError as e:
            problems.append(str(e))
    return problems


def write(root: str = ROOT, files: list[str] | None = None) -> list[str]:
    """Regenerate every block in place; the names of the blocks that changed."""
    changed = []
    for rel in files or doc_files(root):
        full = os.path.join(root, rel)
        with open(full, encoding="utf-8") as f:
            text = f.read()
        new, blocks = regenerate(text, rel, root)
        if blocks:
            with open(full, "w", encoding="utf-8") as f:
                f.write(new)
            changed += [b.name() for b in blocks]
    return changed


def main(argv: list[str]) -> None:
    from absl import flags

    files = argv[1:] or None
    try:
        if flags.FLAGS.check:
            problems = check(ROOT, files)
            for p in problems:
                print(p)
            if problems:
                print(
                    f"{len(problems)} problem(s): regenerate with `python -m experiments.doc_tables`; a table typed "
                    f"by hand is made from a data file, or marked `{TEXT_TABLE}` if it holds no figure"
                )
                sys.exit(1)
            return
        for name in write(ROOT, files):
            print(f"regenerated {name}")
    except (MarkerError, ValueError) as e:
        sys.exit(str(e))


if __name__ == "__main__":
    from absl import app, flags

    # Defined only when run as the program, so that importing this module (the test does) defines no flag.
    flags.DEFINE_bool("check", False, "change nothing; exit 1 listing each table that differs from its data file")
    app.run(main)
