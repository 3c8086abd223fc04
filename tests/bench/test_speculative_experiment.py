"""experiments/speculative.py's data file (--doc_data): one raw record per (batch, method, repeat), paired by repeat,
which the docs' `medians` view turns into docs/speculative.md's table. No engine runs here."""

import json

from cbjax.bench.doc_data import read_doc_data, write_doc_data
from experiments import speculative as spec
from experiments.doc_views import VIEWS


def fake_run(tok_s: float, outputs, acceptance: float = float("nan")) -> dict:
    return dict(
        output_tok_s=tok_s,
        itl_ms_p50=1.0,
        itl_ms_mean=1.1,
        tpot_ms_p50=2.0,
        ttft_ms_p50=5.0,
        acceptance_rate=acceptance,
        mean_acceptance_length=2.5,
        acceptance_by_position=[0.8, 0.6],
        drafts_per_step=1.2,
        num_steps=40,
        plain_step_ms=2.0,
        verify_step_ms=3.0,
        outputs=outputs,
        load_average_before=1.0,
        load_average_after=1.5,
    )


def test_doc_runs_keep_every_repeat_raw_with_summarize_names_and_same_outputs():
    runs = {
        ("off", 1): [fake_run(100.0, [[1, 2]]), fake_run(200.0, [[1, 2]])],
        ("ngram", 1): [fake_run(150.0, [[1, 2]], 0.7), fake_run(260.0, [[1, 3]], 0.7)],
    }
    recs = spec.doc_runs(runs, [1], ["off", "ngram"])
    assert [(r["method"], r["repeat"]) for r in recs] == [("off", 1), ("ngram", 1), ("off", 2), ("ngram", 2)]
    assert [r["output_throughput"] for r in recs] == [100.0, 150.0, 200.0, 260.0]
    assert [r["same_outputs"] for r in recs] == [True, True, True, False]
    assert recs[1]["spec_acceptance_rate"] == 0.7 and recs[1]["spec_acceptance_by_position"] == [0.8, 0.6]
    assert all("outputs" not in r and "output_tok_s" not in r for r in recs)
    assert recs[0]["load_average_before"] == 1.0


def test_the_medians_view_pairs_each_method_with_off_of_the_same_repeat(tmp_path, monkeypatch):
    monkeypatch.setattr("cbjax.bench.doc_data.git_commit", lambda: ("abc1234", False))
    runs = {("off", 4): [], ("ngram", 4): []}
    for tok_s in (100.0, 200.0, 300.0):  # the machine's speed drifts between repeats; the ratio stays 1.5
        runs["off", 4].append(fake_run(tok_s, [[7]]))
        runs["ngram", 4].append(fake_run(1.5 * tok_s, [[7]], 0.7))
    path = tmp_path / "spec.json"
    write_doc_data(
        str(path), command="python -m experiments.speculative", runs=spec.doc_runs(runs, [4], list(("off", "ngram")))
    )
    data = read_doc_data(str(path))
    assert json.loads(path.read_text())["runs"][0]["batch"] == 4
    table = VIEWS["medians"](
        data,
        by=["batch", "method"],
        columns=["output_throughput"],
        baseline={"method": "off"},
        ratios=["output_throughput"],
        pair="repeat",
    )
    ngram_row = next(line for line in table.splitlines() if "| ngram |" in line)
    assert "1.50x [1.50, 1.50] *" in ngram_row
    assert ngram_row.rstrip().endswith("| 3 |")
