"""experiments/sim_event_skipping.py counts the steps event skipping could take; these hand-made step records say
which ones count."""

from types import SimpleNamespace

from experiments.sim_event_skipping import skippable_steps


def _step(seqs, tokens, running, waiting):
    return SimpleNamespace(
        num_scheduled_seqs=seqs, num_scheduled_tokens=tokens, num_running=running, num_waiting=waiting
    )


def test_counts_decode_only_steps_with_an_empty_queue_and_those_repeating_the_step_before():
    steps = [
        _step(4, 40, 4, 0),  # a prefill chunk in it: neither
        _step(4, 4, 4, 0),  # decode-only, nothing waiting; its shape repeats the step before (4, 4, 0)
        _step(4, 4, 4, 2),  # decode-only but two wait; shape changed
        _step(4, 4, 4, 2),  # decode-only, repeats the step before
        _step(0, 0, 0, 0),  # nothing scheduled: not a decode step
    ]
    counts = skippable_steps(steps)
    assert counts["steps"] == 5
    assert counts["decode_nothing_waiting"] == 1 and counts["decode_nothing_waiting_share"] == 0.2
    assert counts["decode_repeating"] == 2 and counts["decode_repeating_share"] == 0.4


def test_no_steps_count_nothing():
    assert skippable_steps([])["decode_repeating_share"] == 0.0
