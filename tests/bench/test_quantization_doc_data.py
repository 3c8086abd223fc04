"""experiments/quantization.py's and kv_quantization.py's data files for the docs: the interleaved throughput rounds
and the records docs/memory.md's tables are generated from. No model is built here (the scripts' full runs take
minutes): fake engines stand in for LLM.generate."""

import types

from cbjax.bench.doc_data import read_doc_data
from experiments import kv_quantization, quantization  # noqa: F401 (it imports: no flags defined at import)
from experiments.doc_views import VIEWS


class FakeLLM:
    def __init__(self, name, calls, tokens=4):
        self.name, self.calls, self.tokens = name, calls, tokens

    def generate(self, prompts, sp):
        self.calls.append(self.name)
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[0] * self.tokens)]) for _ in prompts]


def test_rounds_alternate_which_side_runs_first():
    calls = []
    llms = {"float32": FakeLLM("float32", calls), "int8": FakeLLM("int8", calls)}
    runs = quantization.interleaved_rates(llms, [[1, 2]] * 3, None, repeats=3)
    assert calls == ["float32", "int8", "int8", "float32", "float32", "int8"]
    assert [(r["variant"], r["round"]) for r in runs] == [
        ("float32", 1), ("int8", 1), ("int8", 2), ("float32", 2), ("float32", 3), ("int8", 3),
    ]  # fmt: skip
    assert all(r["kind"] == "throughput" and r["output_tok_per_s"] > 0 for r in runs)


def test_the_data_file_gives_the_docs_tables(tmp_path):
    calls = []
    llms = {"float32": FakeLLM("float32", calls), "int8": FakeLLM("int8", calls, tokens=3)}
    runs = [
        dict(kind="quality", variant="float32", loss=3.05, agreement=1.0, identical=3, weight_bytes=400),
        dict(kind="quality", variant="int8", loss=3.06, agreement=0.9, identical=2, weight_bytes=100),
        *quantization.interleaved_rates(llms, [[1]] * 3, None, repeats=2),
    ]
    path = str(tmp_path / "q.json")
    quantization.write_data(path, "quantization", "a test", runs, 1.0, dict(repeats=2, continuations=3))
    data = read_doc_data(path)
    assert data["command"].startswith("python -m experiments.quantization")
    assert data["settings"]["repeats"] == 2 and data["load_average_before"] == 1.0
    assert "load_average_after" in data and len(data["runs"]) == 6
    # the views docs/memory.md's markers name: the bytes ratio pairs the two one-shot records by their kind
    quality = VIEWS["medians"](
        data, where={"kind": "quality"}, by=["variant"], columns=["loss"], baseline={"variant": "float32"},
        ratios=[{"key": "weight_bytes", "header": "weight bytes"}], pair="kind",
    )  # fmt: skip
    assert "| int8 | 3.06 | 0.25x | 1 |" in quality
    speed = VIEWS["ab"](
        data, where={"kind": "throughput"}, by=[], side="variant", a="int8", b="float32",
        value="output_tok_per_s", pair="round",
    )  # fmt: skip
    assert "| int8 / float32 | per round |" in speed and speed.count("\n") == 4  # caption, blank, header, rule, row
