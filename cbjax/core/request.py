"""A generation request as the scheduler sees it: tokens, progress, pages and timestamps."""

import enum

from cbjax.core.outputs import RequestMetrics
from cbjax.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV was freed (recompute) or moved to host (swap)
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token or EOS
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"


# An output token sampled on the device whose value the host does not know yet (asynchronous scheduling).
PENDING_TOKEN = -1


class Request:
    """One sequence. Its context is `prompt_token_ids + output_token_ids`; the first `num_computed_tokens` of it
    have their K/V in the cache (in `pages`), or will have once the steps already scheduled have run. Prefill,
    decode and recompute after preemption are all the same operation: compute the next uncomputed tokens; when the
    chunk reaches the end of the context, sample one more.

    A step that samples appends a `PENDING_TOKEN` when it is scheduled; the sampled value replaces it when the
    step's results reach the host (`receive_token`). So the next step can be scheduled, and even run (the device
    feeds the token in), before the host has seen it: `num_pending_tokens` trailing outputs are such tokens.
    """

    __slots__ = (
        "admission_order",
        "all_token_ids",
        "arrival_order",
        "bad_word_ids",
        "constraint",
        "cumulative_logprob",
        "deadline",
        "error",
        "finish_reason",
        "group",
        "host_pages",
        "last_scheduled_time",
        "logprobs",
        "metrics",
        "needs_extras",
        "num_computed_tokens",
        "num_dropped_pages",
        "num_pending_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_registered_pages",
        "output_token_ids",
        "page_hashes",
        "pages",
        "params",
        "policy_state",
        "priority",
        "prompt_logprobs",
        "prompt_token_ids",
        "request_id",
        "samples_with_extras",
        "seed",
        "shares_pages",
        "spec_context",
        "status",
        "tenant",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        seed: int,
        arrival_order: int,
        priority: int = 0,
        tenant: str = "default",
        deadline: float | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # The prompt never changes: its length is a plain attribute, not a property (read for every token).
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.params = params
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        # The whole context in one list, kept in step with output_token_ids, so packing a step slices one list.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        # The KV pages of context positions [num_dropped_pages * G, ...), in order. A sliding-window model's pages
        # that no query can read any more are released from the front (Scheduler: evict_outside_window).
        self.pages: list[int] = []
        self.num_dropped_pages = 0
        self.finish_reason: FinishReason | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.seed = seed
        self.arrival_order = arrival_order
        self.num_preemptions = 0
        self.priority = priority
        self.tenant = tenant
        self.error: str | None = None
        self.deadline = deadline  # absolute, on the engine's clock (edf)
        self.host_pages: list[int] = []  # swapped out: the host pages holding the KV of the computed tokens
        self.page_hashes: list[int] = []  # prefix cache: chained hash of each full page of the context so far
        self.num_registered_pages = 0  # pages[:n] are in the prefix cache (or were offered to it)
        self.admission_order = -1  # increases with every admission (running order, victim choice)
        self.last_scheduled_time = arrival_time  # when the request last got tokens (aging, starvation guards)
        self.policy_state = None  # whatever the policy keeps per request (mlfq: level and attained service)
        # Filled by the engine when the request is added (from params.bad_words and params.structured): the token
        # sequences never to complete, and the structured-output state (a core.structured_outputs.TokenConstraint).
        self.bad_word_ids: tuple[tuple[int, ...], ...] = ()
        self.constraint = None
        # n > 1 or best_of: the core.sequence_group.SequenceGroup this request is a sample of (None: a lone one).
        self.group = None
        # Holds pages another sequence may hold too and write into (a group's sample, a forked beam: kv_fork.py):
        # the scheduler checks for copy-on-write before it writes.
        self.shares_pages = False
        # Sampling extras (cbjax/runner/extras_runner.py), read per step as plain flags: whether the request's
        # tokens are sampled with extras, and whether it needs the extras at all (prompt_logprobs too).
        self.samples_with_extras = params.needs_sampling_extras
        self.needs_extras = self.samples_with_extras or params.prompt_logprobs is not None
        # vLLM's logprob outputs, filled as the tokens reach the host: one {token id: Logprob} per received output
        # (None without params.logprobs), their sum, and per prompt token (None first, then dicts).
        self.logprobs: list[dict] | None = None if params.logprobs is None else []
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list | None = None
        self.spec_context = None  # speculation: the context as a numpy array, extended as it grows (speculator.py)

    @property
    def needs_host_history(self) -> bool:
        """Whether sampling its next token reads its previous outputs on the host (a constraint's bitmask, a logits
        processor, a bad word of several tokens): the engine receives its step before scheduling the next."""
        return self.samples_with_extras and bool(
            self.constraint is not None
            or self.params.logits_processors
            or any(len(word) > 1 for word in self.bad_word_ids)
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def num_remaining_output_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def known_output_token_ids(self) -> list[int]:
        """The outputs the host has received (without the trailing pending ones)."""
        return self.output_token_ids[: len(self.output_token_ids) - self.num_pending_tokens]

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)

    def append_pending_token(self) -> None:
        self.output_token_ids.append(PENDING_TOKEN)
        self.all_token_ids.append(PENDING_TOKEN)
        self.num_pending_tokens += 1

    def receive_token(self, token: int) -> int:
        """The value of the oldest pending output; returns its index in output_token_ids."""
        i = len(self.output_token_ids) - self.num_pending_tokens
        self.output_token_ids[i] = token
        self.all_token_ids[self.num_prompt_tokens + i] = token
        self.num_pending_tokens -= 1
        return i

    def stop_reason(self, i: int, eos_token_id: int | None, max_model_len: int) -> FinishReason | None:
        """Whether output i (just received) ends the request: a stop id or EOS, or max_tokens or max_model_len."""
        p, token = self.params, self.output_token_ids[i]
        if token in p.stop_token_ids or (not p.ignore_eos and eos_token_id is not None and token == eos_token_id):
            return FinishReason.STOP
        if i + 1 >= p.max_tokens or self.num_prompt_tokens + i + 1 >= max_model_len:
            return FinishReason.LENGTH
        return None

    def pending_is_final(self, max_model_len: int) -> bool:
        """A pending output is its final one (max_tokens or max_model_len): it finishes when that token arrives."""
        return self.num_pending_tokens > 0 and (
            len(self.output_token_ids) >= self.params.max_tokens or len(self.all_token_ids) >= max_model_len
        )

    def drop_outputs_after(self, i: int) -> None:
        """Forget outputs past index i (pending ones that a stop made moot)."""
        del self.output_token_ids[i + 1 :]
        del self.all_token_ids[self.num_prompt_tokens + i + 1 :]
        self.num_pending_tokens = 0

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, pages={len(self.pages)})"
        )
