"""experiments/throughput.py --stream (LLMEngine.step() streaming every token, the deltas checked) and
experiments/host_time.py (its variants in rounds, merged into one data file the medians view reads)."""

import json

import pytest

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.bench.doc_data import read_doc_data
from cbjax.model import get_model_config, init_model
from experiments import host_time, throughput
from experiments.doc_views import VIEWS
from tests.helpers import SMALL_ENGINE

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    model = init_model(get_model_config("test-tiny"), seed=0)
    return LLMEngine(model, **SMALL_ENGINE)


def test_stream_run_gives_the_outputs_of_generate_in_prompt_order(engine):
    prompts = [[3 + i] * (2 + 4 * i) for i in range(5)]
    params = [SamplingParams(max_tokens=3 + i, **GREEDY) for i in range(5)]
    engine.stream_outputs = False  # stream_run turns streaming on for its run, and puts the setting back
    try:
        outs = throughput.stream_run(engine, prompts, params, "t")
        assert engine.stream_outputs is False
    finally:
        engine.stream_outputs = True
    assert [o.request_id for o in outs] == [f"t-{i}" for i in range(5)]
    want = LLM.from_engine(engine).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


def test_stream_run_refuses_deltas_that_do_not_add_up(engine, monkeypatch):
    step = engine.step_deltas  # (stream_run reads steps in bulk)

    def losing_step():  # a consumer that would lose a token: every bulk token dropped, every output's delta emptied
        bulk = step()
        bulk.request_ids, bulk.token_ids = [], []
        for o in bulk.outputs:
            o.outputs[0].new_token_ids = []
        return bulk

    monkeypatch.setattr(engine, "step_deltas", losing_step)
    with pytest.raises(RuntimeError, match="streamed deltas differ"):
        throughput.stream_run(engine, [[5, 6]], [SamplingParams(max_tokens=3, **GREEDY)], "lost")


def test_rounds_of_variants_merge_into_one_data_file(tmp_path, monkeypatch):
    def fake_variant(name, extra, before, path):
        """A throughput process's data file: 2 repeats; streaming one step is slower than blocks."""
        busy = {"stream, 1 step": 0.08, "finished only, 1 step": 0.07, "blocks (LLM)": 0.03}.get(name, 0.04)
        runs = [{"repeat": k, "output_throughput": 4000.0 / (1 + busy), "host_busy_share": busy} for k in (1, 2)]
        return {"result": {"flags": extra}, "commit": "c0ffee", "dirty": True, "runs": runs}

    monkeypatch.setattr(host_time, "run_variant", fake_variant)
    wl = tmp_path / "decode64.json"
    wl.write_text(json.dumps([{"prompt_token_ids": [1], "max_new_tokens": 2}]))
    out = tmp_path / "host.json"
    host_time.FLAGS(["host_time", "--workload", str(wl), "--rounds", "2", "--repeats", "2", "--doc_data", str(out)])
    try:
        host_time.main([])
    finally:
        host_time.FLAGS.unparse_flags()
    data = read_doc_data(str(out))
    assert [(r["dispatch"], r["round"], r["pair"]) for r in data["runs"][:3]] == [
        ("stream, 1 step", 1, 11),
        ("stream, 1 step", 1, 12),
        ("finished only, 1 step", 1, 11),
    ]
    assert (
        len(data["runs"]) == 2 * 2 * sum(not before for _, before in host_time.VARIANTS.values())
        and "--rounds 2 --repeats 2" in data["command"]
    )
    assert data["results"]["stream, 1 step #2"]["flags"] == ["--stream", "--num_scheduler_steps", "1"]
    table = VIEWS["medians"](
        data,
        by=["dispatch"],
        columns=[{"key": "host_busy_share", "header": "host busy", "format": "{:.1%}"}],
        baseline={"dispatch": "stream, 1 step"},
        ratios=["output_throughput"],
        pair="pair",
    )
    assert "| blocks (LLM) | 3.0% " in table and "| stream, 1 step | 8.0% " in table
