"""The calibration sweep's coverage (cbjax/sim_calibration.py): its decode groups put DECODE_STEPS decode-only steps
of exactly N sequences, for every N of DECODE_SIZES up to the slot count and every prompt length of
DECODE_CONTEXTS, on an engine with no queue and free room. The sweep is scheduled on the simulator (the real
scheduler, a fixed step time), which schedules exactly as the real engine does."""

from collections import Counter

import numpy as np
import pytest

from cbjax import LLMEngine
from cbjax.bench.online import run_online
from cbjax.bench.requests import WorkloadRequest
from cbjax.core.clock import VirtualClock
from cbjax.model.config import get_model_config
from cbjax.sim import FixedCost
from cbjax.sim.auto_profile import CALIBRATION_NUM_PAGES
from cbjax.sim_calibration import DECODE_CONTEXTS, DECODE_SIZES, DECODE_STEPS, sweep_workloads

SHAPE = dict(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=1024)  # the zoo's, the study's


def decode_steps(runs) -> Counter:
    """(sequences, the step's mean context // 64) -> decode-only steps with nothing waiting, over `runs`."""
    out = Counter()
    for wl in runs:
        engine = LLMEngine("test-tiny", runner="sim", cost_model=FixedCost(1e-3), clock=VirtualClock(),
                           num_pages=CALIBRATION_NUM_PAGES, **SHAPE)  # fmt: skip
        for s in run_online(engine, wl).steps:
            n = s.num_scheduled_seqs
            if n and s.num_scheduled_tokens == n and s.num_waiting == 0:
                out[n] += 1
    return out


@pytest.fixture(scope="module")
def sweep():
    vocab = get_model_config("test-tiny").vocab_size
    budget, kv_tokens = SHAPE["max_num_batched_tokens"], CALIBRATION_NUM_PAGES * 16
    return sweep_workloads(vocab, SHAPE["max_num_seqs"], SHAPE["max_model_len"], seed=1234, scale=0.1,
                           token_budget=budget, kv_tokens=kv_tokens)  # fmt: skip


def test_every_decode_batch_size_is_measured_at_every_context_with_free_room(sweep):
    """Every size at short and middle contexts; at the longest, the sizes whose group fits the pool at once
    (at least 1-16 sequences)."""
    all_sizes = sorted({*(n for n in DECODE_SIZES if n < 32), 32})
    for ctx in DECODE_CONTEXTS:
        runs = [g for g in sweep["decode"] if len(g[0].prompt_token_ids) == ctx]
        sizes = sorted(len(g) for g in runs)
        assert sizes == (all_sizes if ctx <= 128 else [n for n in all_sizes if n <= sizes[-1]]), ctx
        assert sizes[-1] >= 16, ctx
        steps = decode_steps(runs)
        for n in sizes:
            # Each group: DECODE_STEPS steps of all its n sequences (and more of fewer while the prompts fill).
            assert steps[n] >= DECODE_STEPS, (ctx, n, steps[n])


def test_the_old_sweep_all_groups_at_once_saw_mid_size_decode_steps_only_in_the_drain():
    """The decode sweep before 2026-12-04: groups of 1, 2, 4, 8, 16 and 32 sequences at 16, 128 and 512 tokens,
    48 tokens each, all in one run (32 at a time, the rest queued). Decode steps of 5-16 sequences came only from
    the drain, a step or two each, far below the coverage the test above asks for."""
    rng = np.random.default_rng(1234)
    vocab = get_model_config("test-tiny").vocab_size
    old = [WorkloadRequest(f"d{n}-{ctx}-{i}", 0.0, tuple(int(x) for x in rng.integers(3, vocab, ctx)), 48)
           for n in (1, 2, 4, 8, 16, 32) for ctx in (16, 128, 512) for i in range(n)]  # fmt: skip
    steps = decode_steps([old])
    assert all(steps[n] < DECODE_STEPS / 4 for n in range(5, 17)), steps
