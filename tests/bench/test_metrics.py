"""Tests for cbjax.bench.metrics, on small cases whose expected numbers are worked out by hand in the comments."""

import dataclasses
import json
import math

import pytest

from cbjax.bench.metrics import RequestRecord, StepRecord, percentiles, request_latencies, step_summary, summarize


def records():
    """Five requests (times in seconds, chosen to be exact in binary):

    r0  short, arrival 0.0,  scheduled 0.5,  tokens 1.0 1.5 2.5,            finished 2.5, stop
        TTFT 1.0, E2E 2.5, TPOT (2.5 - 1.0) / 2 = 0.75, ITL 0.5 1.0, queue 0.5
    r1  short, arrival 1.0,  scheduled 1.25, tokens 2.0 (one token),        finished 2.0, length
        TTFT 1.0, E2E 1.0, no TPOT, no ITL, queue 0.25
    r2  long,  arrival 0.5,  scheduled 1.0,  tokens 2.0 2.25 2.5 3.0 4.0,   finished 4.0, stop
        TTFT 1.5, E2E 3.5, TPOT (3.5 - 1.5) / 4 = 0.5, ITL 0.25 0.25 0.5 1.0, queue 0.5
    r3  long,  arrival 0.25, scheduled 0.5,  tokens 1.0 3.0,                finished 5.0, abort  (no latencies)
    r4  short, arrival 2.0,  never scheduled, still waiting                                      (no latencies)
    """
    return [
        RequestRecord("r0", 10, 3, 0.0, 0.5, 1.0, [1.0, 1.5, 2.5], 2.5, "stop", "short"),
        RequestRecord("r1", 20, 1, 1.0, 1.25, None, [2.0], 2.0, "length", "short", num_preemptions=1),
        RequestRecord("r2", 100, 5, 0.5, 1.0, 2.0, [2.0, 2.25, 2.5, 3.0, 4.0], 4.0, "stop", "long", tenant="b"),
        RequestRecord("r3", 50, 2, 0.25, 0.5, 1.0, [1.0, 3.0], 5.0, "abort", "long", num_preemptions=2),
        RequestRecord("r4", 7, 0, 2.0),
    ]


def test_percentiles_by_hand():
    # [1, 2, 3, 4]: mean 2.5; linear percentile at rank q/100 * 3: p50 2.5, p90 3.7, p99 3.97; std sqrt(1.25)
    p = percentiles([4, 1, 3, 2])
    assert p == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97, "std": math.sqrt(1.25)})
    assert percentiles([7.0]) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0, "std": 0.0}
    assert all(math.isnan(v) for v in percentiles([]).values())
    assert list(percentiles([1, 2], ps=(25, 75))) == ["mean", "p25", "p75", "std"]


def test_request_latencies_by_hand():
    lat = request_latencies(records())
    assert lat["ttft"] == [1.0, 1.0, 1.5]  # the one-token r1 is in TTFT (from token_times[0])
    assert lat["tpot"] == [0.75, 0.5]  # ... and out of TPOT
    assert lat["itl"] == [0.5, 1.0, 0.25, 0.25, 0.5, 1.0]
    assert lat["e2e"] == [2.5, 1.0, 3.5]
    assert lat["queue"] == [0.5, 0.25, 0.5]


def test_summary_counts_and_throughput():
    s = summarize(records())
    assert (s["num_requests"], s["num_completed"], s["num_aborted"], s["num_unfinished"]) == (5, 3, 1, 1)
    # duration = last finish (r3's abort at 5.0) - first arrival (0.0)
    assert s["duration_s"] == 5.0
    assert s["total_input_tokens"] == 130 and s["total_output_tokens"] == 9  # r0 + r1 + r2 only
    assert s["request_throughput"] == pytest.approx(3 / 5)
    assert s["output_throughput"] == pytest.approx(9 / 5)
    assert s["total_token_throughput"] == pytest.approx(139 / 5)
    assert (s["num_preempted_requests"], s["request_preemptions"]) == (2, 3)
    assert s["goodput"] == pytest.approx(3 / 5) and s["num_good"] == 3  # no SLO: every completed request is good
    assert s["slo_attainment"] == pytest.approx(3 / 5)


def test_summary_latency_stats_in_ms():
    s = summarize(records())
    # TTFT [1000, 1000, 1500]: mean 3500/3; p90 at rank 1.8 -> 1000 + 0.8 * 500;
    # std sqrt(((-500/3)^2 * 2 + (1000/3)^2) / 3)
    assert s["ttft_ms_mean"] == pytest.approx(3500 / 3)
    assert s["ttft_ms_p50"] == pytest.approx(1000)
    assert s["ttft_ms_p90"] == pytest.approx(1400)
    assert s["ttft_ms_p99"] == pytest.approx(1490)
    assert s["ttft_ms_std"] == pytest.approx(math.sqrt((2 * (500 / 3) ** 2 + (1000 / 3) ** 2) / 3))
    # TPOT [750, 500]
    assert (s["tpot_ms_mean"], s["tpot_ms_p50"], s["tpot_ms_p90"], s["tpot_ms_std"]) == pytest.approx(
        (625, 625, 725, 125)
    )
    # ITL sorted [250, 250, 500, 500, 1000, 1000]: p50 at rank 2.5 -> 500, p90 at rank 4.5 -> 1000
    assert (s["itl_ms_mean"], s["itl_ms_p50"], s["itl_ms_p90"]) == pytest.approx((3500 / 6, 500, 1000))
    # E2E [2500, 1000, 3500]; queue [500, 250, 500]
    assert (s["e2e_ms_mean"], s["e2e_ms_p50"]) == pytest.approx((7000 / 3, 2500))
    assert (s["queue_ms_mean"], s["queue_ms_p50"]) == pytest.approx((1250 / 3, 500))


def test_summary_by_length_class():
    s = summarize(records())
    assert (s["short_num_requests"], s["long_num_requests"]) == (3, 2)
    assert s["short_completion_rate"] == pytest.approx(2 / 3)  # r4 never finished
    assert s["long_completion_rate"] == pytest.approx(1 / 2)  # r3 aborted
    assert (s["short_ttft_ms_mean"], s["short_e2e_ms_mean"], s["short_tpot_ms_mean"]) == pytest.approx(
        (1000, 1750, 750)
    )
    assert (s["long_ttft_ms_mean"], s["long_e2e_ms_mean"], s["long_tpot_ms_mean"]) == pytest.approx((1500, 3500, 500))
    assert s["long_itl_ms_p50"] == pytest.approx(375)  # [250, 250, 500, 1000]


@pytest.mark.parametrize(
    "slo, good",
    [
        # r0: TTFT 1000 ok, TPOT 750 > 600; r1: TTFT 1000 ok, one token passes TPOT; r2: TTFT 1500 > 1200
        ({"ttft_ms": 1200, "tpot_ms": 600}, 1),
        # r0 2500 <= 2500 (the bound is inclusive), r1 1000, r2 3500 > 2500
        ({"e2e_ms": 2500}, 2),
        # the aborted r3 (TTFT 750) would meet this, but is not completed
        ({"ttft_ms": 1200}, 2),
        ({"ttft_ms": None, "tpot_ms": None}, 3),
        ({"ttft_ms": 999}, 0),
        # TPOT r0 750, r2 500: both bounds inclusive
        ({"tpot_ms": 750}, 3),
        ({"tpot_ms": 749}, 2),
    ],
)
def test_goodput(slo, good):
    s = summarize(records(), slo=slo)
    assert s["num_good"] == good
    assert s["goodput"] == pytest.approx(good / 5.0)
    assert s["slo_attainment"] == pytest.approx(good / 5)


def test_explicit_duration_and_bad_arguments():
    s = summarize(records(), duration=10.0)
    assert s["duration_s"] == 10.0 and s["request_throughput"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="duration"):
        summarize(records(), duration=0)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['ttft'\]"):
        summarize(records(), slo={"ttft": 100})
    with pytest.raises(ValueError, match="slo\\['e2e_ms'\\] must be a positive number"):
        summarize(records(), slo={"e2e_ms": -5})


def steps():
    # occupancy 2/8, 4/8, 3/8 -> mean 0.375; KV 0.1, 0.3, 0.2; tokens 100+4+3 = 107 of 128+16+16 = 160 padded
    return [
        StepRecord(0.0, 2, 3, 2, 8, 100, 128, 10, 100, 0, 0.25, 0.75, 2),
        StepRecord(0.5, 4, 1, 4, 8, 4, 16, 30, 100, 1, 0.25, 0.25, 3),
        StepRecord(1.0, 3, 0, 3, 8, 3, 16, 20, 100, 2, 0.5, 0.0, 3),
    ]


def test_step_metrics_by_hand():
    s = step_summary(steps())
    assert s["num_steps"] == 3
    assert (s["running_mean"], s["waiting_mean"]) == pytest.approx((3.0, 4 / 3))
    assert s["slot_occupancy_mean"] == pytest.approx(0.375)
    assert (s["kv_util_mean"], s["kv_util_max"]) == pytest.approx((0.2, 0.3))
    assert s["padding_waste"] == pytest.approx(1 - 107 / 160)
    assert s["scheduled_tokens_mean"] == pytest.approx(107 / 3)
    assert s["step_preemptions"] == 3
    assert (s["host_s"], s["device_s"], s["host_fraction"], s["device_fraction"]) == pytest.approx((1.0, 1.0, 0.5, 0.5))
    assert (s["compiles"], s["compiles_after_first_step"]) == (3, 1)
    assert summarize(records(), steps())["padding_waste"] == s["padding_waste"]


def test_a_block_of_decode_steps_counts_as_that_many_steps():
    """The third step as a block of 4 (num_scheduler_steps): weights 1, 1, 4 over 6 steps in 3 dispatches."""
    block = [*steps()[:2], dataclasses.replace(steps()[2], decode_steps=4)]
    s = step_summary(block)
    assert (s["num_steps"], s["num_dispatches"]) == (6, 3)
    assert s["slot_occupancy_mean"] == pytest.approx((2 + 4 + 4 * 3) / 8 / 6)
    assert s["running_mean"] == pytest.approx((2 + 4 + 4 * 3) / 6)
    assert s["padding_waste"] == pytest.approx(1 - (100 + 4 + 4 * 3) / (128 + 16 + 4 * 16))


def test_empty_inputs_do_not_crash_and_serialise():
    s = summarize([], [])
    assert (s["num_requests"], s["num_completed"], s["request_throughput"], s["goodput"]) == (0, 0, 0.0, 0.0)
    assert math.isnan(s["duration_s"]) and math.isnan(s["ttft_ms_mean"]) and math.isnan(s["long_completion_rate"])
    assert math.isnan(s["padding_waste"]) and math.isnan(s["host_fraction"]) and s["compiles"] == 0
    back = json.loads(json.dumps(s))
    assert set(back) == set(summarize(records(), steps()))  # same keys whatever the input
    assert all(type(v) in (int, float) for v in s.values())


def test_all_aborted():
    rs = [RequestRecord(f"r{i}", 8, 2, 0.0, 0.1, 0.2, [0.2, 0.3], 1.0, "abort") for i in range(3)]
    s = summarize(rs, slo={"ttft_ms": 1e6})
    assert (s["num_aborted"], s["num_completed"], s["num_good"]) == (3, 0, 0)
    assert (s["request_throughput"], s["output_throughput"], s["goodput"]) == (0.0, 0.0, 0.0)
    assert math.isnan(s["ttft_ms_p50"]) and math.isnan(s["itl_ms_mean"])
    assert s["short_completion_rate"] == 0.0
    json.dumps(s)


def test_record_validation():
    with pytest.raises(ValueError, match="2 token_times for output_len=3"):
        RequestRecord("x", 1, 3, 0.0, token_times=[0.1, 0.2])
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        RequestRecord("x", 1, 0, 0.0, finish_reason="eos")
    with pytest.raises(ValueError, match="needs a finished_time"):
        RequestRecord("x", 1, 1, 0.0, finish_reason="stop")
    with pytest.raises(ValueError, match="length_class"):
        RequestRecord("x", 1, 0, 0.0, length_class="medium")
    # per-token times are optional: TPOT still comes from E2E and TTFT, ITL has no samples
    r = RequestRecord("x", 1, 3, 0.0, 0.0, 0.5, [], 1.5, "stop")
    lat = request_latencies([r])
    assert lat["tpot"] == [0.5] and lat["itl"] == []
