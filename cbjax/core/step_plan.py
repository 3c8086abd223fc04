"""The scheduler's working records of one step: how a request would get its pages (`Placement`), and what a
`Scheduler.schedule()` call has built up so far while it walks the ranking (`StepPlan`)."""

import dataclasses

from cbjax.core.scheduler_output import SchedulerOutput


@dataclasses.dataclass(slots=True)
class Placement:
    """How a request would get its pages this step: prefix-cache hits, pages swapped back in, fresh pages."""

    num_computed_tokens: int  # tokens in the cache once hits / swapped pages are in place
    num_new_tokens: int
    hits: list[int]
    num_new_pages: int
    num_revived: int  # hit pages that are evictable now: taking them uses up free pages too
    num_swapped_in: int  # device pages for the KV coming back from host
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)  # speculation: drafts after the decode

    @property
    def pages_needed(self) -> int:
        return self.num_new_pages + self.num_revived + self.num_swapped_in


@dataclasses.dataclass(slots=True)
class StepPlan:
    """What one schedule() call builds up while it walks the ranking."""

    out: SchedulerOutput
    budget: int  # tokens left in the step
    may_admit: bool  # waiting requests may still join this step
    preempted: set[int] = dataclasses.field(default_factory=set)  # id() of requests preempted this step
    host_frees: list[int] = dataclasses.field(default_factory=list)  # host pages read by swap-ins: free after
