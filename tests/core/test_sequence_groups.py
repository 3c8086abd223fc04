"""Sequence groups (n > 1, best_of) in the scheduler, without a model: the prompt's pages shared by the samples
with the right reference counts, copy-on-write copying exactly the shared partly filled page, and, over random
cases (hypothesis) of every policy, both preemption modes and the prefix cache, every sample's tokens equal to its
reference with nothing leaked (tests/core/fake_runner.py reads every token back through the page tables and
refuses a write into a shared page)."""

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbjax.core import Request, SamplingParams, VirtualClock
from cbjax.core.scheduler_output import SchedulerOutput
from cbjax.core.sequence_group import make_group, sample_seed, samples_of
from tests.core.fake_runner import FakeRunner, next_token
from tests.core.scheduler_setup import FlatConfig, make_scheduler
from tests.core.test_policy_invariants import EOS, VOCAB, cases, check_step


class GroupFakeRunner(FakeRunner):
    """The fake runner, plus the copy-on-write copies (before the step, as the real runner does them), and a
    token that also depends on the request's seed, so samples of one group differ and a sample reading a
    sibling's page gets the wrong tokens."""

    def __init__(self, scheduler, vocab_size):
        super().__init__(scheduler, vocab_size)
        self.pages_copied = []

    def dispatch(self, out: SchedulerOutput):
        self.swap(out.swap_out, out.swap_in)  # the swaps first, then the copies (a copy may reuse a swapped page)
        for src, dst in out.page_copies:
            for o in range(self.G):
                self.kv[dst, o] = self.kv.get((src, o))
        self.pages_copied += out.page_copies
        handle = super().dispatch(dataclasses.replace(out, swap_out=[], swap_in=[]))
        assert out.num_steps == 1, "these cases run single steps"
        for i, seq in enumerate(out.seqs):
            if seq.samples_token:
                r = seq.request
                handle.tokens[i] = self.last_sampled[r.request_id] = (handle.tokens[i] + r.seed) % self.vocab_size
        return handle


def sample_reference(prompt, max_tokens, seed, max_model_len) -> list[int]:
    """What GroupFakeRunner makes a correct engine generate for one sample of seed `seed`."""
    ctx, out = list(prompt), []
    while True:
        t = (next_token(tuple((tok, i) for i, tok in enumerate(ctx)), VOCAB) + seed) % VOCAB
        out.append(t)
        ctx.append(t)
        if t == EOS or len(out) >= max_tokens or len(ctx) >= max_model_len:
            return out


def run_steps(s, runner, asynchronous=False, before_step=None, more=lambda: False):
    """Schedule, run and update until nothing is left (checking the invariants after each step); `before_step(i)`
    runs before step i, and `more()` says whether requests are still to come."""
    in_flight, step = None, 0
    while more() or s.has_unfinished() or in_flight:
        if before_step is not None:
            before_step(step)
        out = s.schedule()
        tokens = runner.execute(out)
        if asynchronous:
            if in_flight is not None:
                s.update(*in_flight, EOS, 0.0)
            in_flight = (out, tokens) if out.seqs else None
        else:
            s.update(out, tokens, EOS, 0.0)
        check_step(s, out)
        step += 1
        assert step < 5000, "requests did not finish"


def test_the_samples_share_the_prompt_pages_and_copy_only_the_partly_filled_one():
    # Prompt of 10 tokens in pages of 4: the fork is at 9, so pages 0-1 are full and page 2 holds position 8 only.
    s = make_scheduler(FlatConfig(page_size=4, num_pages=64, max_model_len=64), VirtualClock())
    runner = GroupFakeRunner(s, VOCAB)
    head = Request("g", list(range(1, 11)), SamplingParams(max_tokens=6), 0.0, seed=5, arrival_order=0)
    group = make_group(head, 3)
    assert [r.seed for r in group.samples] == [sample_seed(5, i) for i in range(3)] and sample_seed(5, 0) == 5
    s.add(head)
    out = s.schedule()  # the head computes the prompt up to the fork, alone
    assert [(q.request, q.num_new_tokens, q.samples_token) for q in out.seqs] == [(head, 9, False)]
    assert not group.forked and len(s.running) == 1 and s.num_free_slots() == 64 - 3
    shared = list(head.pages)
    s.update(out, runner.execute(out), EOS, 0.0)
    out = s.schedule()  # the others join it; each computes the prompt's last token into page 2: two copy it first
    assert group.forked and len(s.running) == 3
    assert len(shared) == 3 and all(r.pages[:2] == shared[:2] for r in group.samples)
    assert [(q.num_computed_tokens, q.num_new_tokens, q.samples_token) for q in out.seqs] == [(9, 1, True)] * 3
    assert len(out.page_copies) == 2 and {src for src, _ in out.page_copies} == {shared[2]}
    pages = [r.pages for r in group.samples]
    assert all(p[:2] == shared[:2] for p in pages) and len({p[2] for p in pages}) == 3
    assert [s.pool.refcount(p) for p in shared[:2]] == [3, 3] and s.pool.refcount(shared[2]) == 1
    assert s.pool.num_used == 2 + 3
    s.update(out, runner.execute(out), EOS, 0.0)
    run_steps(s, runner)
    for r in group.samples:
        assert r.output_token_ids == sample_reference(r.prompt_token_ids, 6, r.seed, 64)
    assert len({tuple(r.output_token_ids) for r in group.samples}) == 3, "the samples were meant to differ"
    assert s.pool.num_free == s.pool.num_pages and len(runner.pages_copied) == 2


def test_a_fork_at_a_page_boundary_copies_nothing_and_a_one_token_prompt_shares_nothing():
    for prompt_len in (9, 1):
        s = make_scheduler(FlatConfig(page_size=4, num_pages=64, max_model_len=64), VirtualClock())
        runner = GroupFakeRunner(s, VOCAB)
        head = Request("g", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=5), 0.0, seed=1, arrival_order=0)
        group = make_group(head, 4)
        s.add(head)
        run_steps(s, runner)
        assert runner.pages_copied == []
        for r in group.samples:
            assert r.output_token_ids == sample_reference(r.prompt_token_ids, 5, r.seed, 64)
        assert s.pool.num_free == s.pool.num_pages


def test_a_group_waits_for_a_slot_per_sample():
    # 3 slots: a running request leaves 2, too few for a group of 3, which waits until it finishes.
    s = make_scheduler(FlatConfig(max_num_seqs=3, page_size=4, max_model_len=64), VirtualClock())
    runner = GroupFakeRunner(s, VOCAB)
    lone = Request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), 0.0, seed=0, arrival_order=0)
    head = Request("g", [4, 5, 6, 7, 8], SamplingParams(max_tokens=3), 0.0, seed=2, arrival_order=1)
    make_group(head, 3)
    s.add(lone)
    s.add(head)
    out = s.schedule()
    assert [q.request for q in out.seqs] == [lone] and s.num_free_slots() == 2
    s.update(out, runner.execute(out), EOS, 0.0)
    run_steps(s, runner)
    assert all(r.is_finished for r in (lone, *head.group.samples))


def _preempt_a_forked_group(mode: str):
    """A group of 3 (a 10-token prompt in pages of 4: pages 0-1 shared, page 2 copied on write) decodes 3 tokens;
    then an urgent request whose prompt needs more pages than are free arrives: the priority policy preempts the
    group. Returns (scheduler, runner, group, urgent, the preempting step's output)."""
    s = make_scheduler(
        FlatConfig(
            policy="priority", page_size=4, num_pages=13, max_model_len=40, preemption_mode=mode, num_host_pages=32
        ),
        VirtualClock(),
    )
    runner = GroupFakeRunner(s, VOCAB)
    head = Request("g", list(range(1, 11)), SamplingParams(max_tokens=8), 0.0, seed=3, arrival_order=0, priority=1)
    group = make_group(head, 3)
    s.add(head)
    for _ in range(5):  # the prompt to the fork, the prompt's last token, then 3 decodes
        out = s.schedule()
        s.update(out, runner.execute(out), EOS, 0.0)
    assert group.forked and all(len(r.output_token_ids) == 4 for r in group.samples)
    urgent = Request("u", list(range(1, 30)), SamplingParams(max_tokens=2), 0.0, seed=9, arrival_order=1, priority=0)
    s.add(urgent)
    out = s.schedule()
    return s, runner, group, urgent, out


def test_a_forked_group_is_swapped_out_and_back_as_a_whole_sharing_its_host_pages():
    s, runner, group, urgent, out = _preempt_a_forked_group("swap")
    samples = group.samples
    assert set(out.preempted) == set(samples), "the group goes as a whole"
    # Each sample computed 13 tokens: pages 0-1 shared, pages 2-3 its own: 2 + 3 * 2 device pages, each swapped once.
    assert len(out.swap_out) == 2 + 3 * 2 == len({d for d, _ in out.swap_out})
    shared_host = samples[0].host_pages[:2]
    assert all(r.host_pages[:2] == shared_host for r in samples)
    assert [s.host_pool.refcount(h) for h in shared_host] == [3, 3]
    assert [r for r in s.waiting if r.group is group] == [group.leader] and group.followers == samples[1:]
    s.update(out, runner.execute(out), EOS, 0.0)
    while True:  # the urgent request runs; then the group comes back in one step, its shared pages shared again
        out = s.schedule()
        if out.swap_in:
            break
        s.update(out, runner.execute(out), EOS, 0.0)
    assert all(r in s.running for r in samples) and len(out.swap_in) == 8
    assert [s.pool.refcount(p) for p in samples[0].pages[:2]] == [3, 3]
    assert all(r.pages[:2] == samples[0].pages[:2] for r in samples)
    s.update(out, runner.execute(out), EOS, 0.0)
    run_steps(s, runner)
    for r in (*samples, urgent):
        assert r.output_token_ids == sample_reference(r.prompt_token_ids, r.params.max_tokens, r.seed, 40)
    assert s.pool.num_free == s.pool.num_pages and s.host_pool.num_free == s.host_pool.num_pages
    assert s.num_preemptions == 3 and s.num_recomputed_tokens == 0


def test_a_group_preempted_by_recompute_forks_again_from_one_prompt():
    s, runner, group, urgent, out = _preempt_a_forked_group("recompute")
    samples = group.samples
    assert set(out.preempted) == set(samples) and not group.forked
    assert s.num_recomputed_tokens == 3 * 13
    assert [r for r in s.waiting if r.group is group] == [group.leader]
    s.update(out, runner.execute(out), EOS, 0.0)
    computed_alone = []
    while not group.forked:
        out = s.schedule()
        computed_alone += [q.num_new_tokens for q in out.seqs if q.request.group is group]
        s.update(out, runner.execute(out), EOS, 0.0)
    # The leader recomputes the prompt to the fork once, for the group; after the fork (at the start of the last
    # step) each sample recomputes its own context from there: the prompt's last token and its 4 outputs.
    assert computed_alone == [9, 5, 5, 5]
    run_steps(s, runner)
    for r in (*samples, urgent):
        assert r.output_token_ids == sample_reference(r.prompt_token_ids, r.params.max_tokens, r.seed, 40)
    assert s.pool.num_free == s.pool.num_pages


@st.composite
def group_cases(draw):
    """tests/core/test_policy_invariants.py's cases, single steps (the fake runner's seeded tokens are per step),
    each request with 1 to 3 samples (at most the slots)."""
    case = draw(cases())
    config = dataclasses.replace(case.config, num_scheduler_steps=1)
    samples = [draw(st.integers(1, min(3, config.max_num_seqs))) for _ in case.requests]
    return dataclasses.replace(case, config=config), samples


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group_cases())
def test_every_policy_runs_groups_with_reference_tokens_and_no_leak(case_and_samples):
    case, samples = case_and_samples
    cfg = dataclasses.replace(case.config, policy_options=case.policy_options)
    clock = VirtualClock()
    s = make_scheduler(cfg, clock)
    runner = GroupFakeRunner(s, VOCAB)
    pending = sorted(enumerate(case.requests), key=lambda x: x[1][0])
    heads = {}

    def before_step(step):
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_tokens, prio, tenant, slack, abort_at) = pending.pop(0)
            deadline = None if slack is None else clock.now() + slack
            r = Request(
                f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), clock.now(), 7 * i, i, prio, tenant, deadline
            )
            if samples[i] > 1:
                make_group(r, samples[i])
            s.add(r)
            heads[r.request_id] = (r, abort_at)
        for r, abort_at in heads.values():
            if abort_at == step:
                for sample in samples_of(r):
                    if not sample.is_finished:
                        s.abort(sample)
        clock.advance(0.001)

    run_steps(s, runner, asynchronous=case.asynchronous, before_step=before_step, more=lambda: bool(pending))
    for head, abort_at in heads.values():
        for r in samples_of(head):
            assert r.is_finished
            want = sample_reference(r.prompt_token_ids, r.params.max_tokens, r.seed, cfg.max_model_len)
            if r.finish_reason.value == "abort":
                assert abort_at is not None and r.output_token_ids == want[: len(r.output_token_ids)]
            else:
                assert r.output_token_ids == want, r.request_id
    assert s.pool.num_free == cfg.num_pages
    if s.host_pool is not None:
        assert s.host_pool.num_free == s.host_pool.num_pages
    assert not s.forking
