"""Cost models: least squares recovers known coefficients; profiles round-trip through JSON; the roofline follows
its own formula's limits (bandwidth-bound decode, compute-bound prefill) from first principles."""

import numpy as np
import pytest

from cbjax.model.config import get_model_config
from cbjax.sim import (
    ACCELERATORS,
    CalibratedCost,
    FixedCost,
    ReplayCost,
    RooflineCost,
    ScaledCost,
    StepFeatures,
    calibrated,
    load_profile,
    save_profile,
)
from cbjax.sim.calibrated import SHARED_FEATURES


def synthetic_steps(rng, n: int):
    buckets = [16, 32, 64, 128]
    feats = []
    for _ in range(n):
        b = int(rng.choice(buckets))
        seqs = int(rng.integers(1, 17))
        tokens = int(rng.integers(seqs, b + 1))
        ctx = int(rng.integers(tokens, 4000))
        feats.append(
            StepFeatures(
                padded_tokens=b,
                num_tokens=tokens,
                num_seqs=seqs,
                sum_context=ctx,
                attention_pairs=float(rng.uniform(ctx, 40 * ctx)),
                swap_bytes=int(rng.choice([0, 0, 0, rng.integers(1, 10) * 65536])),
            )
        )
    return feats


def test_fitting_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    intercepts = {16: 2e-3, 32: 3e-3, 64: 5.5e-3, 128: 10e-3}
    coef = dict(num_tokens=2e-5, num_seqs=1e-4, sum_context=3e-7, attention_pairs=5e-9, swap_bytes=1e-9)
    truth = CalibratedCost(intercepts, coef)
    feats = synthetic_steps(rng, 600)
    times = [truth.step_time(f) * (1 + 0.01 * rng.standard_normal()) for f in feats]  # 1% noise
    fitted = CalibratedCost.fit(feats, times)
    for b, v in intercepts.items():
        assert fitted.intercepts[b] == pytest.approx(v, rel=0.05)
    for k in SHARED_FEATURES:
        assert fitted.coefficients[k] == pytest.approx(coef[k], rel=0.1), k
    assert fitted.fit_stats["num_steps"] == 600
    assert fitted.fit_stats["mean_abs_rel_error"] < 0.02


def test_the_machines_hiccups_do_not_move_the_fit(monkeypatch):
    """3% of the steps took 3-6x their time (another job on the machine): the second fit leaves them out and
    recovers the coefficients; the first fit alone is pulled far off (checked with trimming switched off)."""
    rng = np.random.default_rng(2)
    intercepts = {16: 2e-3, 32: 3e-3, 64: 5.5e-3, 128: 10e-3}
    coef = dict(num_tokens=2e-5, num_seqs=1e-4, sum_context=3e-7, attention_pairs=5e-9, swap_bytes=1e-9)
    truth = CalibratedCost(intercepts, coef)
    feats = synthetic_steps(rng, 1000)
    times = [truth.step_time(f) * (1 + 0.03 * rng.standard_normal()) for f in feats]
    for i in rng.choice(len(times), 30, replace=False):
        times[i] *= rng.uniform(3, 6)

    def worst_error(m):
        errs = [m.intercepts[b] / v - 1 for b, v in intercepts.items()]
        return max(abs(e) for e in errs + [m.coefficients[k] / coef[k] - 1 for k in SHARED_FEATURES])

    fitted = CalibratedCost.fit(feats, times)
    assert fitted.fit_stats["trimmed_steps"] >= 30
    assert worst_error(fitted) < 0.15
    monkeypatch.setattr(calibrated, "TRIM_SIGMAS", float("inf"))
    assert worst_error(CalibratedCost.fit(feats, times)) > 0.3


def test_a_bucket_seen_in_a_few_steps_stays_near_the_line_and_a_well_seen_one_keeps_its_own():
    """Partial pooling of the intercepts (SHRINK_STEPS): one noisy step in bucket 96 does not set its intercept,
    while bucket 64, seen 500 times 40% above the line, keeps its own. (Intercepts only: no shared feature varies.)"""
    rng = np.random.default_rng(1)
    line = lambda b: 1e-3 + 5e-5 * b
    truth = {16: line(16), 32: line(32), 64: 1.4 * line(64), 256: line(256)}
    feats, times = [], []
    for b, v in truth.items():
        for _ in range(500):
            feats.append(StepFeatures(padded_tokens=b, num_tokens=0, num_seqs=0, sum_context=0))
            times.append(v * (1 + 0.01 * rng.standard_normal()))
    feats.append(StepFeatures(padded_tokens=96, num_tokens=0, num_seqs=0, sum_context=0))
    times.append(3 * line(96))  # one step, 3x the line (a hiccup of the machine)
    fitted = CalibratedCost.fit(feats, times)
    assert fitted.intercepts[64] == pytest.approx(truth[64], rel=0.05)
    assert fitted.intercepts[96] < 1.25 * line(96), "one step set its bucket's intercept"
    for b in (16, 32, 256):
        assert fitted.intercepts[b] == pytest.approx(truth[b], rel=0.05)


def test_unseen_buckets_are_interpolated_in_the_bucket_size():
    m = CalibratedCost({16: 1.0, 32: 2.0, 64: 3.0}, {})
    assert m.intercept(48) == pytest.approx(2.5)
    assert m.intercept(128) == pytest.approx(5.0)  # the last segment's slope, extended
    assert m.intercept(8) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "model",
    [
        FixedCost(0.01),
        ReplayCost([0.1, 0.2]),
        CalibratedCost({16: 1e-3, 0: 2e-4}, {"num_seqs": 1e-5}, {"num_steps": 3}),
        RooflineCost.for_model(get_model_config("llama-7b"), "tpu-v5e", num_chips=4, overhead_s=2e-3),
        ScaledCost(CalibratedCost({16: 1e-3, 0: 2e-4}, {"num_seqs": 1e-5}), 1.5),
    ],
)
def test_profiles_round_trip_through_json(tmp_path, model):
    path = str(tmp_path / "profile.json")
    save_profile(model, path, meta={"model": "x"})
    back = load_profile(path)
    assert type(back) is type(model)
    f = StepFeatures(padded_tokens=16, num_tokens=10, num_seqs=3, sum_context=500, attention_pairs=900.0)
    assert back.step_time(f) == model.step_time(f)


def test_a_scaled_cost_multiplies_every_step_and_keeps_the_accelerators_memory():
    base = RooflineCost.for_model(get_model_config("llama-7b"), "h200")
    scaled = ScaledCost(base, 1.25)
    for f in (
        StepFeatures(padded_tokens=16, num_tokens=3, num_seqs=3, sum_context=900, attention_pairs=900.0),
        StepFeatures(padded_tokens=256, num_tokens=256, num_seqs=1, sum_context=256, attention_pairs=3e4),
    ):
        assert scaled.step_time(f) == pytest.approx(1.25 * base.step_time(f))
    assert scaled.kv_pages(16) == base.kv_pages(16)
    assert not hasattr(ScaledCost(FixedCost(0.1), 2.0), "kv_pages")  # only where the base model has a memory
    with pytest.raises(ValueError, match="factor > 0"):
        ScaledCost(base, 0.0)


def test_a_bad_profile_is_a_value_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"kind": "nonsense"}')
    with pytest.raises(ValueError, match="kind"):
        load_profile(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        load_profile(str(tmp_path / "missing.json"))


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound():
    mcfg = get_model_config("llama-7b")
    h200 = ACCELERATORS["h200"]
    m = RooflineCost.for_model(mcfg, "h200", overhead_s=0.0)
    # Decode of one sequence: the weights (~6.6e9 matmul parameters in bf16) cross HBM once.
    params = mcfg.num_params() - mcfg.vocab_size * mcfg.hidden_size  # all but the embedding table
    decode = StepFeatures(padded_tokens=16, num_tokens=1, decode_tokens=1, num_seqs=1, num_sampling_seqs=1)
    assert m.step_time(decode) == pytest.approx(2 * params / h200.hbm_bandwidth, rel=0.02)
    # A 4096-token prefill: about 2 FLOPs per parameter per token at peak.
    pre = StepFeatures(
        padded_tokens=4096, num_tokens=4096, num_seqs=1, num_sampling_seqs=1, attention_pairs=4096**2 / 2
    )
    assert m.step_time(pre) >= 2 * params * 4096 / h200.peak_flops
    assert m.step_time(pre) == pytest.approx(2 * params * 4096 / h200.peak_flops, rel=0.15)
    # Four chips: a quarter of the time; a 7B model in bf16 leaves v5e's 16 GB little room for KV.
    assert RooflineCost.for_model(mcfg, "h200", num_chips=4, overhead_s=0.0).step_time(pre) == pytest.approx(
        m.step_time(pre) / 4
    )
    assert RooflineCost.for_model(mcfg, "tpu-v5e").kv_pages(16) < 200


def test_replay_cost_refuses_to_run_past_its_recording():
    m = ReplayCost([0.5])
    assert m.step_time(StepFeatures()) == 0.5
    with pytest.raises(RuntimeError, match="only 1 recorded"):
        m.step_time(StepFeatures())


def test_roofline_int8_kv_holds_about_twice_the_bfloat16_pages_and_reads_half_the_bytes():
    mcfg = get_model_config("llama-7b").replace(dtype="bfloat16")
    bf16 = RooflineCost.for_model(mcfg, "h200")
    int8 = RooflineCost.for_model(mcfg, "h200", kv_cache_dtype="int8")
    H = mcfg.dim_per_head
    assert int8.kv_bytes_per_token / bf16.kv_bytes_per_token == pytest.approx((H + 4) / (2 * H))  # + the scales
    assert int8.kv_pages(16) / bf16.kv_pages(16) == pytest.approx(2 * H / (H + 4), rel=0.01)
    long_decode = StepFeatures(
        padded_tokens=64, num_tokens=64, decode_tokens=64, num_seqs=64, num_sampling_seqs=64, sum_context=64 * 4000
    )
    assert int8.step_time(long_decode) < bf16.step_time(long_decode)
