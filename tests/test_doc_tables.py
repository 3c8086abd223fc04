"""The docs' generated tables (experiments/doc_tables.py, experiments/doc_views.py, cbjax/bench/doc_data.py): every
table between markers in README.md and docs/*.md equals what its data file gives, and the machinery that says so
parses markers, renders views and notices a hand-edited table."""

import datetime
import json
import pathlib
import re

import pytest

from cbjax.bench.doc_data import read_doc_data, write_doc_data
from cbjax.bench.results import cpu_model
from experiments import doc_tables as dt
from experiments.doc_views import VIEWS


def test_every_table_in_the_docs_equals_what_its_data_file_gives():
    root = pathlib.Path(dt.ROOT)
    blocks = [b for rel in dt.doc_files() for b in dt.find_blocks((root / rel).read_text(), rel)]
    assert blocks, "no generated table in the docs: the check below would check nothing"
    problems = dt.check()
    assert not problems, "\n".join(problems) + "\nregenerate them: python -m experiments.doc_tables"


MARKED = """# Title
text
<!-- table: rows docs/data/a.json {"columns": ["x"]} -->
| x |
|---|
<!-- /table -->
between
<!-- table: fidelity_study docs/data/b.json -->
<!-- /table -->
"""


def test_markers_are_found_with_their_view_data_file_parameters_and_body():
    a, b = dt.find_blocks(MARKED, "m.md")
    assert (a.view, a.data, a.params, a.line, a.body) == (
        "rows",
        "docs/data/a.json",
        {"columns": ["x"]},
        3,
        "| x |\n|---|",
    )
    assert (b.view, b.data, b.params, b.line, b.body) == ("fidelity_study", "docs/data/b.json", {}, 8, "")
    lines = MARKED.split("\n")
    assert lines[a.end] == lines[b.end] == dt.CLOSE and lines[a.start - 1].startswith(dt.OPEN_PREFIX)


def test_a_marker_in_fenced_code_is_an_example_not_a_block():
    text = "```\n<!-- table: rows docs/data/a.json -->\n```\n" + MARKED
    assert [b.line for b in dt.find_blocks(text)] == [6, 11]
    assert dt.find_blocks("~~~md\n<!-- /table -->\n~~~\n") == []


@pytest.mark.parametrize(
    "text, where",
    [
        ("<!-- table: rows docs/data/a.json -->\n| x |\n", "m.md:1: table marker never closed"),
        ("text\n<!-- /table -->\n", "m.md:2: `<!-- /table -->` without"),
        (
            "<!-- table: rows a.json -->\n<!-- table: rows b.json -->\n<!-- /table -->\n",
            "m.md:2: a table marker inside",
        ),
        ("<!-- table: rows -->\n<!-- /table -->\n", "m.md:1: a table marker is"),
        (
            '<!-- table: rows a.json {"columns": [x]} -->\n<!-- /table -->\n',
            "m.md:1: the view's parameters are not JSON",
        ),
        ('<!-- table: rows a.json ["x"] -->\n<!-- /table -->\n', "m.md:1: a table marker is"),
    ],
)
def test_a_malformed_marker_is_an_error_naming_its_line(text, where):
    with pytest.raises(dt.MarkerError, match=re.escape(where)):
        dt.find_blocks(text, "m.md")


RUNS = [
    {"round": 1, "policy": "a", "tok_s": 10.0, "ttft": 5.0},
    {"round": 1, "policy": "b", "tok_s": 20.0, "ttft": 1.0},
    {"round": 2, "policy": "a", "tok_s": 30.0, "ttft": 5.0},
    {"round": 2, "policy": "b", "tok_s": 60.0, "ttft": None},
    {"round": 3, "policy": "a", "tok_s": 20.0, "ttft": 5.0},
    {"round": 3, "policy": "b", "tok_s": 40.0, "ttft": 1.0},
]


def _project(tmp_path, marker: str) -> str:
    """A tiny project: docs/data/t.json (written by write_doc_data) and docs/x.md holding `marker`'s block."""
    write_doc_data(str(tmp_path / "docs/data/t.json"), command="python -m bench --x", runs=RUNS, what="a test")
    (tmp_path / "docs/x.md").write_text(f"# x\n\n{marker}\n<!-- /table -->\n\nafter\n")
    return str(tmp_path)


def test_write_doc_data_records_command_commit_cpu_date_and_every_run(tmp_path):
    path = str(tmp_path / "d/t.json")
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    data = write_doc_data(path, command="python -m bench", runs=RUNS, settings={"n": 3})
    assert read_doc_data(path) == data
    assert data["command"] == "python -m bench" and data["runs"] == RUNS and data["settings"] == {"n": 3}
    assert re.fullmatch(r"[0-9a-f]{40}", data["commit"]) and isinstance(data["dirty"], bool)
    assert data["cpu"] == cpu_model() and data["cpu_count"] >= 1
    assert datetime.datetime.fromisoformat(data["date"]) >= before
    for bad in (
        {"command": "", "runs": RUNS},
        {"command": "c", "runs": []},
        {"command": "c", "runs": RUNS, "cpu": "x"},
    ):
        with pytest.raises(ValueError):
            write_doc_data(path, **bad)
    (tmp_path / "old.json").write_text(json.dumps({"command": "c", "cpu": "x", "date": "2026", "runs": []}))
    with pytest.raises(ValueError, match="missing or empty: commit"):
        read_doc_data(str(tmp_path / "old.json"))


def test_the_rows_view_renders_each_record_and_the_provenance_line(tmp_path):
    marker = '<!-- table: rows docs/data/t.json {"where": {"policy": "b"}, "columns": ["round", "tok_s", ' + (
        '{"key": "ttft", "header": "TTFT ms", "format": "{:.1f}"}]} -->'
    )
    root = _project(tmp_path, marker)
    assert dt.write(root, ["docs/x.md"]) == ["docs/x.md:3: table `rows` of docs/data/t.json"]
    text = (tmp_path / "docs/x.md").read_text()
    body = dt.find_blocks(text)[0].body.split("\n")
    assert body[:5] == ["| round | tok_s | TTFT ms |", "|---|---|---|", "| 1 | 20.0 | 1.0 |", "| 2 | 60.0 | - |",
                        "| 3 | 40.0 | 1.0 |"]  # fmt: skip
    assert body[5] == "" and body[6].startswith("_Data: `docs/data/t.json` · `python -m bench --x` · commit ")
    assert cpu_model() in body[6]
    assert text.endswith("<!-- /table -->\n\nafter\n")
    assert dt.check(root, ["docs/x.md"]) == [] and dt.write(root, ["docs/x.md"]) == []  # regenerating is idempotent


def _table_lines(tmp_path, marker: str) -> list[str]:
    """The lines of the table that `marker`'s block renders into (in a project of its own, see _project)."""
    dt.write(_project(tmp_path, marker), ["docs/x.md"])
    body = dt.find_blocks((tmp_path / "docs/x.md").read_text())[0].body
    return [line for line in body.split("\n") if "|" in line]


def test_the_medians_view_takes_medians_and_paired_ratios_to_the_baseline(tmp_path):
    marker = (
        '<!-- table: medians docs/data/t.json {"by": ["policy"], "columns": ["tok_s"], "baseline": {"policy": "a"}, '
        '"ratios": ["tok_s", "ttft"], "pair": "round"} -->'
    )
    rows = _table_lines(tmp_path, marker)
    assert rows[0] == "| policy | tok_s | tok_s vs a | ttft vs a | runs |"
    a, b = (r.split(" | ") for r in rows[2:])
    assert a[1] == "20.0 [10.0, 30.0]" and a[2:] == ["-", "-", "3 |"]  # the median of 10, 30, 20; no ratio to itself
    assert b[1] == "40.0 [20.0, 60.0]"
    assert b[2] == "2.00x [2.00, 2.00] *"  # every round's b is twice its a: significant
    assert b[3] == "0.20x [0.20, 0.20] *"  # round 2's missing TTFT leaves rounds 1 and 3


def test_a_ratio_is_headed_as_its_column_less_the_unit_where_its_key_has_no_label(tmp_path):
    marker = (
        '<!-- table: medians docs/data/t.json {"by": ["policy"], "columns": [{"key": "ttft", "header": "TTFT ms"}], '
        '"baseline": {"policy": "a"}, "ratios": ["ttft"], "pair": "round"} -->'
    )
    assert _table_lines(tmp_path, marker)[0] == "| policy | TTFT ms | TTFT vs a | runs |"


def test_the_ab_view_puts_two_sides_side_by_side_with_the_ratio_per_round(tmp_path):
    marker = (
        '<!-- table: ab docs/data/t.json {"by": [], "side": "policy", "a": "b", "b": "a", "value": "tok_s", '
        '"labels": {"a": "old", "b": "new"}} -->'
    )
    row = _table_lines(tmp_path, marker)[-1]
    assert (
        row.startswith("| 40.0 [20.0, 60.0] (20.0, 60.0, 40.0) | 20.0 [10.0, 30.0] (10.0, 30.0, 20.0) |")
        and "(20.0, 60.0, 40.0)" in row
        and "(10.0, 30.0, 20.0)" in row
    )
    assert row.endswith("| 2.00x [2.00, 2.00] * | 2.00, 2.00, 2.00 |")


def test_a_hand_edited_table_is_reported_and_regenerating_restores_it(tmp_path):
    root = _project(tmp_path, '<!-- table: rows docs/data/t.json {"columns": ["policy", "tok_s"]} -->')
    dt.write(root, ["docs/x.md"])
    generated = (tmp_path / "docs/x.md").read_text()
    (tmp_path / "docs/x.md").write_text(generated.replace("| b | 60.0 |", "| b | 66.0 |"))
    problems = dt.check(root, ["docs/x.md"])
    assert len(problems) == 1 and problems[0].startswith("docs/x.md:3: table `rows` of docs/data/t.json differs")
    assert "| b | 66.0 |" in problems[0] and "| b | 60.0 |" in problems[0]
    dt.write(root, ["docs/x.md"])
    assert (tmp_path / "docs/x.md").read_text() == generated and dt.check(root, ["docs/x.md"]) == []


@pytest.mark.parametrize(
    "marker, message",
    [
        ('<!-- table: nope docs/data/t.json {"columns": ["x"]} -->', "no view `nope`"),
        ('<!-- table: rows docs/data/missing.json {"columns": ["x"]} -->', "No such file"),
        ('<!-- table: rows docs/data/t.json {"colums": ["x"]} -->', "the view failed"),
        ('<!-- table: rows docs/data/t.json {"columns": ["x"], "rows": "policy"} -->', "`policy` is not a list"),
    ],
)
def test_a_table_that_cannot_be_rendered_is_a_problem_naming_it(tmp_path, marker, message):
    root = _project(tmp_path, marker)
    (problem,) = dt.check(root, ["docs/x.md"])
    assert problem.startswith("docs/x.md:3: table ") and message in problem
    with pytest.raises(ValueError, match=re.escape(message)):
        dt.write(root, ["docs/x.md"])


def test_every_view_is_documented():
    assert {"rows", "medians", "ab", "fidelity_study"} <= set(VIEWS)
    assert all(fn.__doc__ for fn in VIEWS.values())


def test_a_table_typed_by_hand_is_found_unless_marked_as_text():
    text = "\n".join([
        "| a | b |", "|---|---|", "| 1 | 2 |", "",  # typed by hand: found
        dt.TEXT_TABLE, "| route | what |", "|---|---|", "",  # marked as holding no figure: fine
        '<!-- table: rows docs/data/a.json {"columns": ["x"]} -->', "| x |", "|---|", dt.CLOSE,  # generated: fine
        "```", "| in | code |", "```",  # an example in fenced code: fine
        "text", "| ms | 3.1 |",  # another one, after prose: found
    ])  # fmt: skip
    assert dt.loose_tables(text, "t.md") == ["t.md:1: `| a | b |`", "t.md:17: `| ms | 3.1 |`"]
