"""What the engine hands back: per-request outputs (vLLM-shaped) and their timing records."""

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timestamps of one request, in the engine clock's seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token became available
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    """One completion. `token_ids` is everything generated so far; `new_token_ids` what this step added."""

    index: int
    token_ids: list[int]
    new_token_ids: list[int]
    finish_reason: str | None
    text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the request was refused or failed; finish_reason is then "abort"
    prompt: str | None = None
