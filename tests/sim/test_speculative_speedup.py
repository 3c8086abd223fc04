"""The standard speculative-decoding model and its roofline prediction (cbjax/sim/speculative_speedup.py)."""

import pytest

from cbjax.model.config import ModelConfig, get_model_config
from cbjax.sim.speculative_speedup import SpeculationRoofline, alpha_for_tokens, expected_tokens, speedup

DRAFT_1B = ModelConfig(vocab_size=32000, hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4,
                       intermediate_size=5632, dtype="bfloat16")  # fmt: skip


def test_expected_tokens_at_the_ends_and_between():
    assert expected_tokens(0.0, 4) == 1.0  # every draft rejected: the target's own token only
    assert expected_tokens(1.0, 4) == 5.0  # every draft accepted, plus the bonus token
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert speedup(0.5, 2, 1.75) == pytest.approx(1.0)


def test_alpha_for_tokens_inverts_expected_tokens():
    for alpha in (0.1, 0.47, 0.8, 0.99):
        for k in (1, 3, 4):
            assert alpha_for_tokens(expected_tokens(alpha, k), k) == pytest.approx(alpha, abs=1e-9)


@pytest.mark.parametrize(
    "call",
    [
        lambda: expected_tokens(1.2, 3),
        lambda: expected_tokens(0.5, -1),
        lambda: alpha_for_tokens(5.5, 4),
        lambda: speedup(0.5, 2, 0.0),
        lambda: SpeculationRoofline({}, {}, "h200", block_steps=0),
    ],
)
def test_bad_input_is_a_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_a_bandwidth_bound_target_verifies_k_tokens_for_about_one():
    """7B on an H200 at batch 1: reading the weights dominates, so 5 tokens cost within 1% of 1."""
    r = SpeculationRoofline.for_models(get_model_config("llama-7b"), DRAFT_1B, "h200", block_steps=1)
    one, five = r.plain_token_s(256), r.verify_step_s(4, 256) - 5 * r.draft_iteration_s(256)
    assert five == pytest.approx(one, rel=0.01)
    # the draft's iteration costs about its bytes over the target's (1.1B / 6.7B parameters)
    assert 0.1 < r.cost_ratio(256) < 0.25


def test_overheads_and_blocks_move_the_prediction_the_right_way():
    target = get_model_config("llama-7b")
    pure = SpeculationRoofline.for_models(target, DRAFT_1B, "h200")
    loaded = SpeculationRoofline.for_models(target, DRAFT_1B, "h200", step_overhead_s=1e-3)
    assert 1.0 < loaded.speedup(0.8, 3, 256) < pure.speedup(0.8, 3, 256)
    # a free draft with every draft accepted gains k + 1 on a pure roofline (verifying 4 tokens costs about 1)
    free = SpeculationRoofline(pure.target_shape, {**pure.draft_shape, "num_layers": 0, "vocab_size": 0}, "h200")
    assert free.speedup(1.0, 3, 256) == pytest.approx(4.0, rel=0.02)
