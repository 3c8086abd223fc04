"""experiments/draft_bound_report.py: the standard model fitted to a draft-model run recovers what made the runs."""

import pytest

from cbjax.sim.speculative_speedup import expected_tokens
from experiments import draft_bound_report


def synthetic(alpha=0.6, c=0.4, o=1.5, target_ms=0.8, default_ms=0.7, rounds=3) -> dict:
    """Runs whose figures follow the model exactly: a verifying step costs target_ms (1 + k c + o) and yields
    E(alpha, k) tokens."""
    runs = []
    for rnd in range(1, rounds + 1):
        runs.append(dict(method="off", k=0, round=rnd, output_throughput=1000 / default_ms))
        runs.append(dict(method="off_1step", k=0, round=rnd, output_throughput=1000 / target_ms))
        runs.append(dict(method="draft_alone", k=0, round=rnd, output_throughput=1000 / (c * target_ms)))
        for k in (1, 2, 3, 4):
            verify = target_ms * (1 + k * c + o)
            tokens = expected_tokens(alpha, k)
            runs.append(dict(method=f"draft_k{k}", k=k, round=rnd, verify_step_ms=verify, verify_host_ms=0.3,
                             tokens_per_verify_step=tokens, output_throughput=1000 * tokens / verify))  # fmt: skip
    shapes = {"vocab_size": 4096, "hidden_size": 192, "num_layers": 4, "num_heads": 6, "num_kv_heads": 2,
              "intermediate_size": 512, "head_dim": 32, "dtype": "bfloat16", "kv_dtype": "bfloat16"}  # fmt: skip
    return dict(runs=runs, settings=dict(context=150, step_overhead_ms=1.0),
                shapes={n: shapes for n in ("tinypy", "tinypy-draft", "llama-7b", "draft-1.1b")})  # fmt: skip


def test_the_fit_recovers_alpha_c_and_o():
    f = draft_bound_report.fit(synthetic())
    assert f["alpha"] == pytest.approx(0.6, abs=1e-6)
    assert f["c"] == pytest.approx(0.4) and f["o"] == pytest.approx(1.5)
    assert f["c_standalone"] == pytest.approx(0.4)
    for row in f["rows"]:  # the model explains runs made by the model
        assert row["predicted"] == pytest.approx(row["measured"])
        assert row["fitted_cost"] == pytest.approx(row["cost"])


def test_tables_render():
    data = synthetic()
    assert "| 4 | 0.60 |" in draft_bound_report.fit_table(data)
    table = draft_bound_report.roofline_table(data)
    assert table.count("\n") == 2 + 2 * 2 * 2 - 1  # header, rule, 2 pairs x 2 accelerators x 2 overheads
    assert "| h200 |" in table and "| tpu-v5e |" in table
