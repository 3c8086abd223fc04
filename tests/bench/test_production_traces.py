"""Trace-shaped arrivals (issue 38, point 4): the Azure LLM inference traces' and BurstGPT's CSV files as workloads
(samples written by hand in tests/bench/data/, in the published formats), Weibull gaps, a diurnal rate cycle, and a
trace replayed at another mean rate, through make_workload and the harness's load."""

import math
import os

import numpy as np
import pytest

from cbjax.bench.arrivals import arrival_times, at_mean_rate, diurnal_warp
from cbjax.bench.production_traces import load_azure_llm_trace, load_burstgpt, parse_azure_timestamp
from cbjax.bench.workload import make_workload

DATA = os.path.join(os.path.dirname(__file__), "data")
AZURE = os.path.join(DATA, "azure_llm_sample.csv")
AZURE_2024 = os.path.join(DATA, "azure_llm_2024_sample.csv")
BURSTGPT = os.path.join(DATA, "burstgpt_sample.csv")


def test_azure_rows_become_requests_at_the_trace_times():
    reqs = load_azure_llm_trace(AZURE, vocab_size=100)
    assert [r.prompt_len for r in reqs] == [374, 396, 879, 91, 2048, 17]
    assert [r.max_tokens for r in reqs] == [44, 109, 31, 12, 256, 3]
    # 18:15:46.6805900 is the start; 7 fractional digits are cut to 6
    assert [r.arrival_time for r in reqs] == pytest.approx([0.0, 4.314579, 4.56941, 6.31941, 14.76141, 14.81941])
    assert all(3 <= t < 100 for r in reqs for t in r.prompt_token_ids)
    assert [r.request_id for r in reqs[:2]] == ["azure-0", "azure-1"]
    assert reqs[4].length_class == "long" and reqs[0].length_class == "short"


def test_azure_2024_timestamps_carry_a_zone_and_the_two_agree_on_utc():
    reqs = load_azure_llm_trace(AZURE_2024)
    assert [r.arrival_time for r in reqs] == pytest.approx([0.0, 0.52766, 1.24007])
    assert parse_azure_timestamp("2024-05-10 00:00:00+00:00") == parse_azure_timestamp("2024-05-10 00:00:00")


def test_burstgpt_skips_failed_requests_and_filters_by_model_and_log_type():
    reqs = load_burstgpt(BURSTGPT)
    assert [(r.arrival_time, r.prompt_len, r.max_tokens) for r in reqs] == [
        (0.0, 472, 18),
        (113.0, 417, 215),
        (129.0, 1360, 185),
        (135.0, 58, 34),
        (136.5, 2000, 600),
    ]  # fmt: skip  (the row of 0 response tokens at t=45 is a failed request)
    chat = load_burstgpt(BURSTGPT, models=["ChatGPT"], log_types=["Conversation log"])
    assert [r.prompt_len for r in chat] == [472, 58] and chat[1].arrival_time == 135.0
    assert [r.prompt_len for r in load_burstgpt(BURSTGPT, num_requests=2)] == [472, 417]


def test_scale_shrinks_both_lengths_and_keeps_the_class_of_the_trace():
    reqs = load_azure_llm_trace(AZURE, scale=0.1)
    assert [(r.prompt_len, r.max_tokens) for r in reqs] == [(37, 4), (40, 11), (88, 3), (9, 1), (205, 26), (2, 1)]
    assert reqs[4].length_class == "long"  # judged on the production lengths, before scaling


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,3\n", "header lacks"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n", "line 2: TIMESTAMP"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,0\n", "GeneratedTokens must be a whole"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,2.5,4\n", "ContextTokens must be a whole"),
    ],
)
def test_a_malformed_azure_file_names_the_file_and_line(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        load_azure_llm_trace(path)
    assert "bad.csv" in str(e.value)


def test_a_malformed_burstgpt_time_is_an_error(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\nnan,ChatGPT,4,5,9,API log\n")
    with pytest.raises(ValueError, match="line 2: Timestamp"):
        load_burstgpt(path)


def test_make_workload_replays_a_production_trace_by_default_and_at_another_rate():
    base = dict(kind="burstgpt", path=BURSTGPT, vocab_size=1000)
    own = make_workload(base)
    assert [r.arrival_time for r in own] == [0.0, 113.0, 129.0, 135.0, 136.5]
    fast = make_workload({**base, "trace_rate": 2.0})  # 4 gaps over 136.5 s -> 4 gaps over 2 s
    assert [r.arrival_time for r in fast] == pytest.approx([t * 2.0 / 136.5 for t in (0, 113, 129, 135, 136.5)])
    assert [r.prompt_token_ids for r in fast] == [r.prompt_token_ids for r in own]  # only the clock moved
    poisson = make_workload({**base, "arrival": "poisson", "request_rate": 5.0, "trace_models": "GPT-4"})
    assert [r.prompt_len for r in poisson] == [417, 2000] and poisson[1].arrival_time > 0
    azure = make_workload(dict(kind="azure_llm", path=AZURE, num_requests=3, scale=0.5))
    assert [r.prompt_len for r in azure] == [187, 198, 440]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (dict(trace_rate=3.0, arrival="offline"), "trace_rate rescales a replayed trace"),
        (dict(trace_models="ChatGPT", kind="azure_llm", path=AZURE), "BurstGPT rows only"),
        (dict(trace_models=" , "), "trace_models is empty"),
        (dict(diurnal_period_s=60.0), "needs arrival in"),
        (dict(arrival="poisson", request_rate=2.0, diurnal_period_s=60.0, diurnal_amplitude=1.0), r"\[0, 1\)"),
        (dict(arrival="poisson", request_rate=2.0, diurnal_amplitude=0.5), "needs diurnal_period_s"),
        (dict(kind="peers_json", path=os.path.join(DATA, "peers.json"), scale=0.5), "scale applies"),
    ],
)
def test_bad_trace_options_name_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        make_workload({"kind": "burstgpt", "path": BURSTGPT, **override})


@pytest.mark.parametrize("shape", [0.5, 1.0, 2.0])
def test_weibull_gaps_keep_the_mean_rate_and_their_shape(shape):
    t = arrival_times(40001, "weibull", rng=np.random.default_rng(4), request_rate=2.0, burstiness=shape)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert np.mean(gaps) == pytest.approx(0.5, rel=0.05)
    # the coefficient of variation of a Weibull of shape k: sqrt(G(1 + 2/k) / G(1 + 1/k)^2 - 1)
    want = math.sqrt(math.gamma(1 + 2 / shape) / math.gamma(1 + 1 / shape) ** 2 - 1)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(want, rel=0.08)


def test_a_diurnal_cycle_moves_arrivals_to_the_busy_half_and_keeps_the_mean_rate():
    period, rate, a = 100.0, 5.0, 0.8
    t = arrival_times(20001, "poisson", rng=np.random.default_rng(5), request_rate=rate, diurnal_period_s=period,
                      diurnal_amplitude=a)  # fmt: skip
    assert np.all(np.diff(t) >= 0)
    whole = t[t < period * math.floor(t.max() / period)]
    assert len(whole) / (period * math.floor(t.max() / period)) == pytest.approx(rate, rel=0.05)
    busy = np.mean((whole % period) < period / 2)  # sin > 0 in the first half of each period
    # the expected share: (1/2 + a / pi) / 1 of the arrivals fall in the first half
    assert busy == pytest.approx(0.5 + a / math.pi, abs=0.02)


def test_the_diurnal_warp_inverts_the_cumulative_rate():
    s = np.linspace(0.0, 500.0, 1001)
    t = diurnal_warp(s, 37.0, 0.6)
    k = 0.6 * 37.0 / (2 * math.pi)
    assert np.allclose(t + k * (1 - np.cos(2 * math.pi * t / 37.0)), s, atol=1e-9)
    assert np.array_equal(diurnal_warp(s, 37.0, 0.0), s)


def test_at_mean_rate_scales_the_clock_only():
    t = np.array([3.0, 4.0, 10.0, 11.0])
    assert at_mean_rate(t, 1.5).tolist() == pytest.approx([0.0, 0.25, 1.75, 2.0])  # 3 gaps in 2 s
    assert at_mean_rate(np.array([2.0, 2.0]), 4.0).tolist() == [2.0, 2.0]  # no span to scale
