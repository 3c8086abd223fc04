"""The scheduler's inline decode planning (cbjax/core/decode_walk.py) decides exactly what the general path
(`_extend`, `_scheduled`) decides for the same visits, and walks the ranking in sorted_ranking.visits' order.

Each case runs twice in lockstep on the same request stream: as the scheduler is, and as a twin whose walk is
sorted_ranking.visits with nothing planned inline (every visit the walk does not skip goes down the general path,
as before the inline planning existed). Every step's batch, every token and every request's timestamps and policy
state must be equal (hypothesis, over every policy, recompute and swap, prefix caching, blocks of decode steps,
aborts).
"""

import dataclasses

from hypothesis import HealthCheck, given, settings

from cbjax.core import Request, VirtualClock
from cbjax.core import scheduler as scheduler_module
from cbjax.core.decode_walk import general_visits
from cbjax.core.policy_zoo import make_policy
from cbjax.core.scheduler import Scheduler
from tests.core.scheduler_setup import make_scheduler
from tests.core.test_fast_ranking import run_lockstep
from tests.core.test_policy_invariants import cases


def _every_visit(sched, ranking, step, drafting):
    # As with drafts: sorted_ranking.visits (the reference walk), nothing planned inline, only the skips.
    return general_visits(sched, ranking, step, True)


class GeneralPathScheduler(Scheduler):
    """A Scheduler whose walk hands every visit to the general path."""

    def schedule(self):
        planned_inline = scheduler_module.general_visits
        scheduler_module.general_visits = _every_visit
        try:
            return super().schedule()
        finally:
            scheduler_module.general_visits = planned_inline


def _state(r: Request) -> tuple:
    m = r.metrics
    return (
        r.request_id, r.status, r.finish_reason, list(r.output_token_ids), r.num_computed_tokens, list(r.pages),
        r.num_preemptions, m.first_scheduled_time, r.last_scheduled_time, m.first_token_time, list(m.token_times),
        m.finished_time, repr(r.policy_state),
    )  # fmt: skip


def run_twins(case) -> int:
    config = dataclasses.replace(case.config, policy_options=case.policy_options)
    clock = VirtualClock()
    opts = dict(batch_timeout_s=config.static_batch_timeout_s)
    scheds = [make_scheduler(config, clock, make_policy(config.policy, config.policy_options, **opts)) for _ in "ab"]
    scheds[1].__class__ = GeneralPathScheduler

    def same_state(step, outs, reqs):
        assert outs[0].num_steps == outs[1].num_steps and outs[0].page_copies == outs[1].page_copies
        a, b = ([_state(r) for r, _ in reqs[k].values()] for k in (0, 1))
        assert a == b, f"step {step}"

    return run_lockstep(case, clock, scheds, after_step=same_state)[0]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_inline_decodes_schedule_exactly_as_the_general_path(case):
    run_twins(case)
