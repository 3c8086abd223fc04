"""What the engine hands back: per-request outputs (vLLM-shaped) and their timing records."""

from dataclasses import dataclass, field, fields


@dataclass
class RequestMetrics:
    """Timestamps of one request, in the engine clock's seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token became available
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's log-probability under the model's raw logits, its rank in the vocabulary (1: the most
    likely) and its text (None: not decoded)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionOutput:
    """One completion. `token_ids` is everything generated so far; `new_token_ids` what this step added.

    A streaming engine builds one per request per step (`received`): a view of the request's outputs that copies
    them into lists only when a field is first read. A stream's consumer reads the delta, rarely the whole output, and
    copying every output so far for every request at every step made the host's work per token grow with the length
    of the output. Read late, a view gives the same lists as a copy made at once: an output the host has received
    never changes (later tokens are only appended, or pending ones dropped, after it).

    `text` is the decoded output when the engine has a tokenizer: decoded when first read (`decode`, a callable
    given by the engine: no decoding for outputs nobody reads), or set at once for requests with stop strings (the
    engine's incremental text, cut at the stop). `stop_reason` is vLLM's: the stop string or stop token id that
    ended the output, None when it ended otherwise (EOS included)."""

    __slots__ = (
        "_decode",
        "_new_token_ids",
        "_num_new",
        "_num_received",
        "_outputs",
        "_text",
        "_token_ids",
        "cumulative_logprob",
        "finish_reason",
        "index",
        "logprobs",
        "stop_reason",
    )

    def __init__(
        self,
        index: int,
        token_ids: list[int],
        new_token_ids: list[int],
        finish_reason: str | None,
        text: str | None = None,
        stop_reason: "str | int | None" = None,
        logprobs: list[dict] | None = None,
        cumulative_logprob: float | None = None,
    ):
        """`logprobs` (SamplingParams.logprobs only): one {token id: Logprob} per output token, the chosen token
        first, then the top k; `cumulative_logprob`: the sum of the chosen tokens' logprobs."""
        self.logprobs, self.cumulative_logprob = logprobs, cumulative_logprob
        self.index, self.finish_reason, self._text, self.stop_reason = index, finish_reason, text, stop_reason
        self._decode = None
        self._token_ids, self._new_token_ids = token_ids, new_token_ids
        self._outputs, self._num_received, self._num_new = None, 0, 0

    @classmethod
    def received(
        cls, index: int, outputs: list[int], num_received: int, num_new: int, finish_reason: str | None
    ) -> "CompletionOutput":
        """A view of `outputs[:num_received]` (the request's output list; it may grow later) whose last `num_new`
        tokens are this step's."""
        self = cls.__new__(cls)
        self.index, self.finish_reason = index, finish_reason
        self._text = self._decode = self.stop_reason = None
        self.logprobs = self.cumulative_logprob = None
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
    def text(self) -> str | None:
        if self._text is None and self._decode is not None:
            self._text = self._decode(self.token_ids)
        return self._text

    @text.setter
    def text(self, value: str | None) -> None:
        self._text = value

    def decode_text_with(self, decode) -> "CompletionOutput":
        """Make `text` `decode(token_ids)`, computed when first read."""
        self._decode = decode
        return self

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> tuple:
        return self.index, self.token_ids, self.new_token_ids, self.finish_reason, self.text, self.stop_reason

    def __eq__(self, other) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # mutable, like the dataclass it replaces

    def __repr__(self) -> str:
        index, tokens, new, reason, text, stop_reason = self._fields()
        return (
            f"CompletionOutput(index={index!r}, token_ids={tokens!r}, new_token_ids={new!r}, "
            f"finish_reason={reason!r}, text={text!r}, stop_reason={stop_reason!r})"
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
    # SamplingParams.prompt_logprobs: None for the first prompt token, then a {token id: Logprob} per prompt token
    prompt_logprobs: list | None = None

    def stream_delta(self) -> list[int]:
        """The token ids its first completion got in the step that returned it (`outputs[0].new_token_ids`; with
        n > 1 read each completion's): what a stream sends on. Read this way, a streamed output may never build its
        completion object (ReceivedOutput)."""
        return self.outputs[0].new_token_ids if self.outputs else []


class ReceivedOutput(RequestOutput):
    """A streaming step's output of a plain request (one completion, no logprobs, no stop strings): a RequestOutput
    whose `outputs` (the CompletionOutput) is built when first read, from what the step received.

    At 64 streaming sequences every step returns 64 outputs, and a stream's reader usually wants only the request id,
    whether it finished and the new tokens (`stream_delta`, read without building the completion). The fields fixed
    when the step returned (received count, new count, finish reason) are kept here; `complete(request, num_received,
    num_new, finish_reason)` builds the completion from them whenever it is read, with the same contents as if built
    at once (a received output never changes later: see CompletionOutput)."""

    _outputs = None  # the completion once built

    def __init__(self, request, num_received: int, num_new: int, finish_reason, finished: bool, complete):
        # One of these is built per token: the fields a stream's reader seldom reads and that never change (its
        # prompt, prompt logprobs) are read from the request when read (properties below), not copied.
        self._request, self._num_received, self._num_new, self._complete = request, num_received, num_new, complete
        self.request_id, self.finish_reason, self.finished = request.request_id, finish_reason, finished
        self.metrics, self.error = request.metrics, request.error

    prompt_token_ids = property(lambda self: self._request.prompt_token_ids)
    prompt_logprobs = property(lambda self: self._request.prompt_logprobs)  # (set before its first output)

    @property
    def outputs(self) -> list[CompletionOutput]:
        if self._outputs is None:
            self._outputs = [self._complete(self._request, self._num_received, self._num_new, self.finish_reason)]
        return self._outputs

    @outputs.setter
    def outputs(self, value: list[CompletionOutput]) -> None:
        self._outputs = value

    def stream_delta(self) -> list[int]:
        if self._outputs is not None:
            return super().stream_delta()
        n, k = self._num_received, self._num_new
        return self._request.output_token_ids[n - k : n] if k else []

    def materialize(self) -> RequestOutput:
        """The same output as a plain RequestOutput (for a copy, a pickle, a comparison)."""
        return RequestOutput(**{f.name: getattr(self, f.name) for f in fields(RequestOutput)})

    def __eq__(self, other) -> bool:
        if not isinstance(other, RequestOutput):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(RequestOutput))

    __hash__ = None

    def __reduce__(self):  # (pickled as the plain output: the engine it reads from stays behind)
        return self.materialize().__reduce__()

    def __repr__(self) -> str:
        return repr(self.materialize())


@dataclass
class StepDeltas:
    """One `LLMEngine.step_deltas()` call's results in bulk (what `step()` returns, read without an object per token).

    `request_ids[i]` got the one new token `token_ids[i]` and neither finished nor needs more than its token ids (a
    plain request: no sample group, no logprobs, no stop strings); every other output of the step (a finished request,
    several tokens at once, a group, logprobs, stop strings, an abort) is a RequestOutput in `outputs`, as `step()`
    would return it. Together they are exactly what `step()` would have returned for the same step."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
