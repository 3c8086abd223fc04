"""The read-only view of a Scheduler that its policy gets (the SchedulerView of cbjax.core.policy)."""

from cbjax.core.request import Request


class ReadOnlyScheduler:
    """The SchedulerView a policy gets (cbjax.core.policy): the queues and the prefix cache, read-only."""

    __slots__ = ("_scheduler",)

    def __init__(self, scheduler):  # a cbjax.core.scheduler.Scheduler (not imported: it imports this)
        self._scheduler = scheduler

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._scheduler.running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._scheduler.waiting)

    @property
    def prefix_caching(self) -> bool:
        return self._scheduler.pool.enable_caching

    @property
    def max_num_seqs(self) -> int:
        return self._scheduler.config.max_num_seqs

    def cached_prefix_tokens(self, req: Request) -> int:
        return self._scheduler.cached_prefix_tokens(req)
