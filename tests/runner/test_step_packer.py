"""StepPacker (cbjax/runner/step_packer.py): every step it packs equals pack_step's packing of the same step, array
for array, whether it advanced the previous step's arrays or packed from scratch; and it never changes an array
it handed out before (the previous step may still be reading it)."""

import copy

import numpy as np
from hypothesis import HealthCheck, given, settings

from cbjax.core import Request, SamplingParams, SchedulerConfig, VirtualClock
from cbjax.runner.step_input import BucketTable, StepInput, pack_step
from cbjax.runner.step_packer import StepPacker
from tests.core.scheduler_setup import FlatConfig, make_scheduler
from tests.core.test_policy_invariants import Case, cases, run_case


def assert_same_input(got: StepInput, want: StepInput) -> None:
    for name, a, b in zip(StepInput._fields, got, want, strict=True):
        if a is None or b is None:
            assert a is None and b is None, name
        elif name == "verify":
            assert_same_input_rows(a, b)
        else:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b, err_msg=name)


def assert_same_input_rows(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


class CheckedPacker:
    """Packs every step with a StepPacker and checks it against pack_step, and that earlier inputs are intact."""

    def __init__(self, cfg: SchedulerConfig):
        self.buckets = BucketTable.build(
            cfg.max_num_batched_tokens, cfg.max_model_len, cfg.page_size, cfg.max_num_seqs, min_tokens=4
        )
        self.pad_page = cfg.num_pages
        self.packer = StepPacker(self.buckets, self.pad_page)
        self.handed_out: list = []  # (FlatStepInput, a deep copy made when it was packed)

    def __call__(self, _scheduler, out) -> None:
        if not out.seqs:
            return
        slots = dict(self.packer.prev_slot_of)
        got, order = self.packer.pack(out)
        want, want_order = pack_step(out, self.buckets, self.pad_page, slots)
        assert order == want_order
        assert_same_input(got.unflatten(), want)
        for flat, snapshot in self.handed_out[-3:]:
            np.testing.assert_array_equal(flat.ints, snapshot.ints)
            np.testing.assert_array_equal(flat.floats, snapshot.floats)
        self.handed_out.append((got, copy.deepcopy(got)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_the_packer_equals_pack_step_on_every_policy_and_mode(case):
    # Every policy, both preemption modes, prefix caching, aborts, blocks of decode steps, async and sync.
    run_case(case, CheckedPacker(case.config))


def test_steady_decodes_are_advanced_across_page_boundaries_async_and_sync():
    for asynchronous in (False, True):
        cfg = FlatConfig(max_num_seqs=4, max_num_batched_tokens=16, page_size=2, num_pages=64, max_model_len=40)
        reqs = [(0, list(range(1 + i, 6 + 2 * i)), 20 + i, 0, "a", None, None) for i in range(4)]
        check = CheckedPacker(cfg)
        run_case(Case(cfg, {}, reqs, asynchronous=asynchronous), check)
        # Four decodes for ~20 steps, then one finishes at a time: most steps are advanced.
        assert check.packer.num_advanced >= 15, check.packer.num_advanced


def test_a_sliding_window_drops_pages_and_the_rows_follow():
    cfg = FlatConfig(
        max_num_seqs=3, max_num_batched_tokens=16, page_size=2, num_pages=64, max_model_len=48, sliding_window=5
    )
    s = make_scheduler(cfg, VirtualClock())
    for i in range(3):
        s.add(Request(f"r{i}", list(range(1, 8 + i)), SamplingParams(max_tokens=30, ignore_eos=True), 0.0, 0, i))
    check = CheckedPacker(cfg)
    dropped = 0
    while s.has_unfinished():
        out = s.schedule()
        check(s, out)
        dropped = max([dropped] + [q.request.num_dropped_pages for q in out.seqs])
        s.update(out, [7] * len(out.seqs), None, 0.0)
    assert check.packer.num_advanced >= 20
    assert dropped >= 10  # pages left the front of the rows while the batch was advanced


def test_a_changed_batch_is_packed_from_scratch():
    cfg = FlatConfig(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=64, max_model_len=40)
    reqs = [(step, [1, 2, 3], 6, 0, "a", None, None) for step in (0, 3, 6)]  # a new request every few steps
    check = CheckedPacker(cfg)
    run_case(Case(cfg, {}, reqs), check)
    steps = len(check.handed_out)
    assert 0 < check.packer.num_advanced < steps


def test_blocks_of_decode_steps_are_packed_like_pack_step():
    cfg = FlatConfig(
        max_num_seqs=2, max_num_batched_tokens=16, page_size=4, num_pages=64, max_model_len=40, num_scheduler_steps=4
    )
    for asynchronous in (False, True):
        check = CheckedPacker(cfg)
        run_case(Case(cfg, {}, [(0, [1, 2, 3], 30, 0, "a", None, None)] * 2, asynchronous=asynchronous), check)
        blocks = sum(flat.layout.blocks for flat, _ in check.handed_out)
        # Every block after the first of a run of blocks is advanced from the one before, page boundaries included
        # (4 tokens a page, blocks of 4 steps: each block opens a page somewhere inside it or at its start).
        assert blocks >= 6 and check.packer.num_advanced >= blocks - 2, (blocks, check.packer.num_advanced)
