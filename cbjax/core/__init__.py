"""Host-side core of cbjax: requests, pages and the scheduler. Pure Python + numpy; never imports jax."""

from cbjax.core.clock import Clock, RealClock, VirtualClock
from cbjax.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cbjax.core.page_pool import PagePool
from cbjax.core.policy import Policy, SchedulerView
from cbjax.core.policy_zoo import POLICIES, make_policy
from cbjax.core.request import FinishReason, Request, RequestStatus
from cbjax.core.sampling_params import SamplingParams
from cbjax.core.scheduler import Scheduler, SchedulerConfig
from cbjax.core.scheduler_output import ScheduledSeq, SchedulerOutput

__all__ = [
    "POLICIES",
    "Clock",
    "CompletionOutput",
    "FinishReason",
    "PagePool",
    "Policy",
    "RealClock",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerView",
    "VirtualClock",
    "make_policy",
]
