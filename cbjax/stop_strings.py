"""The engine's side of stop strings: each request that asks for them has a TextStream (cbjax/model/text_stream.py)
fed with its tokens as they reach the host, and one that completes a stop string is finished there (vLLM's
semantics).

The check runs right after the scheduler's update of a step, before the next step is scheduled: the request is
finished through `Scheduler.abort` (which frees its pages and drops the outputs sampled but not received: with
asynchronous scheduling, the token of the step already in flight), then marked finished by a stop, and the tokens
received after the one that completed the stop string (a block of decode steps, accepted drafts) are dropped.
Requests without stop strings cost nothing here: they have no stream.
"""

from cbjax.core.request import FinishReason, Request
from cbjax.core.scheduler import Scheduler
from cbjax.model.text_stream import TextStream
from cbjax.model.tokenizer import Tokenizer


class StopStrings:
    """The streams of the unfinished requests with stop strings, keyed by request."""

    def __init__(self, tokenizer: Tokenizer | None, scheduler: Scheduler):
        self.tokenizer, self.scheduler = tokenizer, scheduler
        self.streams: dict[Request, TextStream] = {}
        self.num_reported: dict[Request, int] = {}  # tokens already handed out in outputs (the deltas' start)

    def __bool__(self) -> bool:
        return bool(self.streams)

    def track(self, req: Request) -> None:
        p = req.params
        self.streams[req] = TextStream(
            self.tokenizer, req.prompt_token_ids, p.stop, p.include_stop_str_in_output, p.min_tokens
        )
        self.num_reported[req] = 0

    def check(self, reqs: list[Request]) -> None:
        """Feed each request's newly received tokens to its stream; finish the ones that completed a stop string."""
        streams = self.streams
        for req in dict.fromkeys(reqs):
            stream = streams.get(req)
            if stream is None or stream.stopped:
                continue
            received = len(req.output_token_ids) - req.num_pending_tokens
            new = req.output_token_ids[stream.num_tokens : received]
            # Finished by the scheduler with reason STOP: its last token is a stop id or EOS.
            by_stop_token = req.finish_reason is FinishReason.STOP
            if stream.add(new, ends_with_stop_token=by_stop_token) is None:
                continue
            last = stream.num_tokens - 1  # the output that completed the stop string
            if not req.is_finished:
                self.scheduler.abort(req)
            req.finish_reason = FinishReason.STOP
            req.drop_outputs_after(last)
            del req.metrics.token_times[last + 1 :]

    def output(self, req: Request, finished: bool) -> tuple[str, str | None, int]:
        """(its visible text, its stop string or None, how many of its received tokens are new since the last
        output). A finished request's stream is forgotten."""
        stream = self.streams[req]
        received = len(req.output_token_ids) - req.num_pending_tokens
        num_new = received - self.num_reported[req]
        self.num_reported[req] = received
        if finished:
            stream.finish()
            del self.streams[req], self.num_reported[req]
        return stream.visible_text(finished), stream.stop_reason, num_new
