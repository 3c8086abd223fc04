"""experiments/spec_vs_defaults.py: what a run's step records are summed into (no engine, no timing)."""

import pytest

from experiments.spec_vs_defaults import step_stats, sum_lists


def record(tokens, seqs, device_s, host_s, decode_steps=1, drafts=0, accepted=0, verified=0, by_pos=None):
    r = dict(num_scheduled_tokens=tokens, num_scheduled_seqs=seqs, device_s=device_s, host_s=host_s,
             decode_steps=decode_steps)  # fmt: skip
    if drafts:
        r.update(spec_draft_tokens=drafts, spec_accepted_tokens=accepted, spec_verified_seqs=verified,
                 spec_drafted_by_position=[1] * drafts, spec_accepted_by_position=by_pos)  # fmt: skip
    return r


def test_step_stats_splits_plain_and_verifying_steps():
    records = [
        record(64, 1, 0.004, 0.001),  # a prompt: neither a plain decode step nor a verifying one
        record(1, 1, 0.004, 0.004, decode_steps=8),  # a block of 8 plain decode steps: 1 ms per step
        record(4, 1, 0.002, 0.001, drafts=3, accepted=2, verified=1, by_pos=[1, 1, 0]),
        record(4, 1, 0.002, 0.003, drafts=3, accepted=3, verified=1, by_pos=[1, 1, 1]),
        record(1, 1, 0.0005, 0.0005),  # a lone plain step
    ]
    s = step_stats(records)
    assert s["num_steps"] == 5 and s["num_verify_steps"] == 2
    assert s["spec_acceptance_rate"] == pytest.approx(5 / 6)
    assert s["tokens_per_verify_step"] == pytest.approx(1 + 5 / 2)
    assert s["verify_step_ms"] == pytest.approx(4.0) and s["verify_host_ms"] == pytest.approx(2.0)
    assert s["plain_dispatch_ms"] == pytest.approx(4.5)  # median of 8 ms and 1 ms
    assert s["plain_step_ms"] == pytest.approx(1.0)  # 8 ms / 8 steps and 1 ms / 1 step
    assert s["decode_steps"] == 1 + 8 + 1 + 1 + 1
    assert s["spec_accepted_by_position"] == [2, 2, 1]


def test_without_speculation_the_spec_figures_are_none():
    s = step_stats([record(1, 1, 0.001, 0.0)])
    assert s["spec_acceptance_rate"] is None and s["tokens_per_verify_step"] is None and s["verify_step_ms"] is None


def test_sum_lists_pads_the_shorter():
    assert sum_lists([[1, 2], None, [3], [0, 0, 5]]) == [4, 2, 5]
