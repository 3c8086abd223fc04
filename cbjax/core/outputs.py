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


class CompletionOutput:
    """One completion. `token_ids` is everything generated so far; `new_token_ids` what this step added.

    A streaming engine builds one per request per step (`received`): a view of the request's outputs that copies
    them into lists only when a field is first read. A stream's consumer reads the delta, rarely the whole output, and
    copying every output so far for every request at every step made the host's work per token grow with the length
    of the output. Read late, a view gives the same lists as a copy made at once: an output the host has received
    never changes (later tokens are only appended, or pending ones dropped, after it)."""

    __slots__ = (
        "_new_token_ids",
        "_num_new",
        "_num_received",
        "_outputs",
        "_token_ids",
        "finish_reason",
        "index",
        "text",
    )

    def __init__(
        self,
        index: int,
        token_ids: list[int],
        new_token_ids: list[int],
        finish_reason: str | None,
        text: str | None = None,
    ):
        self.index, self.finish_reason, self.text = index, finish_reason, text
        self._token_ids, self._new_token_ids = token_ids, new_token_ids
        self._outputs, self._num_received, self._num_new = None, 0, 0

    @classmethod
    def received(
        cls, index: int, outputs: list[int], num_received: int, num_new: int, finish_reason: str | None
    ) -> "CompletionOutput":
        """A view of `outputs[:num_received]` (the request's output list; it may grow later) whose last `num_new`
        tokens are this step's."""
        self = cls.__new__(cls)
        self.index, self.finish_reason, self.text = index, finish_reason, None
        self._token_ids = self._new_token_ids = None
        self._outputs, self._num_received, self._num_new = outputs, num_received, num_new
        return self

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is None:
            self._token_ids = self._outputs[: self._num_received]
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids = value

    @property
    def new_token_ids(self) -> list[int]:
        if self._new_token_ids is None:
            n, k = self._num_received, self._num_new
            self._new_token_ids = self._outputs[n - k : n] if k else []
        return self._new_token_ids

    @new_token_ids.setter
    def new_token_ids(self, value: list[int]) -> None:
        self._new_token_ids = value

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> tuple:
        return self.index, self.token_ids, self.new_token_ids, self.finish_reason, self.text

    def __eq__(self, other) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # mutable, like the dataclass it replaces

    def __repr__(self) -> str:
        index, tokens, new, reason, text = self._fields()
        return (
            f"CompletionOutput(index={index!r}, token_ids={tokens!r}, new_token_ids={new!r}, "
            f"finish_reason={reason!r}, text={text!r})"
        )


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the request was refused or failed; finish_reason is then "abort"
    prompt: str | None = None
