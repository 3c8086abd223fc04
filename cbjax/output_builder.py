"""OutputBuilder: the engine's RequestOutputs of a step, from the requests that got tokens or finished in it.

A streaming engine returns an output per running request per step. A plain request's output (one completion, no
logprobs, no stop strings) is a ReceivedOutput (core/outputs.py): it keeps what the step received and builds its
CompletionOutput only when read, so a stream that reads `stream_delta()` costs no per-token completion object.
Every other output is built at once: stop strings' incremental text is state that advances with each step, a
group's samples make one output together, and logprobs are sliced as received.
"""

import collections
from collections.abc import Callable

from cbjax.core.outputs import CompletionOutput, ReceivedOutput, RequestOutput, StepDeltas
from cbjax.core.request import FinishReason, Request, RequestStatus
from cbjax.core.sequence_group import group_output
from cbjax.model.config import ModelConfig
from cbjax.stop_strings import StopStrings

# Read per token: an enum member read off its class costs ~0.1 us on Python 3.11, a global ~0.01 us.
_FINISHED = RequestStatus.FINISHED


class OutputBuilder:
    """Builds an engine's outputs. `requests` and `with_extras` are the engine's own tables: a request whose final
    output is built leaves them (the engine no longer knows it, as vLLM's)."""

    def __init__(
        self,
        tokenizer,
        model_config: ModelConfig,
        stop_strings: StopStrings,
        requests: dict[str, Request],
        with_extras: dict[Request, int],
    ):
        self.tokenizer, self.model_config, self.stop_strings = tokenizer, model_config, stop_strings
        self.requests, self.with_extras = requests, with_extras
        self._decode = None if tokenizer is None else tokenizer.decode  # (bound once: read per output)

    def is_plain(self, req: Request) -> bool:
        """Whether `req`'s outputs need nothing but its token ids (one completion: no sample group, no logprobs, no
        stop strings): then a streamed output is a ReceivedOutput, or a pair of lists in bulk (`deltas`). The loops
        over a step's requests below test the same, inline."""
        return req.group is None and req.logprobs is None and req not in self.stop_strings.streams

    def outputs(self, changed: list[Request]) -> list[RequestOutput]:
        """One output per request in `changed` (in order of first appearance), with as many new tokens as it appears
        times: once per token received (several with speculation or a block of decode steps)."""
        counts = _token_counts(changed)
        output, streams, complete = self.output, self.stop_strings.streams, self.completion
        outputs = []
        add = outputs.append
        for r, n in counts.items():
            if r.group is not None:  # a group's samples make one output (in first-seen order)
                members = {r.group or r: r for r in counts}.values()  # one per group (or lone request), in order
                return [
                    output(m, counts[m]) if m.group is None else self._group_output(m.group, counts) for m in members
                ]
            if r.status is _FINISHED or r.logprobs is not None or r in streams:
                add(output(r, n))
            else:  # `output`'s usual case, inline (once per request per streaming step: is_plain, unfinished)
                add(ReceivedOutput(r, len(r.output_token_ids) - r.num_pending_tokens, n, None, False, complete))
        return outputs

    def deltas(self, changed: list[Request]) -> StepDeltas:
        """`outputs(changed)` in bulk: a plain request's one new token goes into two lists (no object per token), the
        rest are outputs as `outputs` builds them."""
        counts = _token_counts(changed)
        streams, ids, tokens, rest = self.stop_strings.streams, [], [], []
        for r, n in counts.items():
            # (is_plain and unfinished, inline: once per request per streaming step)
            if n == 1 and r.group is None and r.status is not _FINISHED and r.logprobs is None and r not in streams:
                ids.append(r.request_id)
                tokens.append(r.output_token_ids[len(r.output_token_ids) - r.num_pending_tokens - 1])
            else:
                rest += [r] * n
        return StepDeltas(ids, tokens, self.outputs(rest) if rest else [])

    def _group_output(self, group, counts: dict) -> RequestOutput:
        """A sequence group's one output: a completion per sample (core/sequence_group.py)."""
        out = group_output(group, [self.output(s, counts.get(s, 0), sample=True) for s in group.samples])
        if out.finished:
            self.requests.pop(group.head.request_id, None)
        return out

    def output(self, req: Request, num_new: int, sample: bool = False) -> RequestOutput:
        """The output of a request (of its group: `_group_output`), or of one `sample` of a group."""
        if req.group is not None and not sample:
            return self._group_output(req.group, {req: num_new})
        finished = req.status is _FINISHED
        if finished and req.group is None:
            self.requests.pop(req.request_id, None)
            self.with_extras.pop(req, None)
        reason = req.finish_reason
        reason = None if reason is None else reason.value
        n = len(req.output_token_ids) - req.num_pending_tokens  # what the host has received (known_output_token_ids)
        if not sample and self.is_plain(req):  # (req.group is None here: a group's outputs come as one above)
            return ReceivedOutput(req, n, num_new, reason, finished, self.completion)
        completion = self._completion_at_once(req, n, num_new, reason, finished)
        out = RequestOutput(req.request_id, req.prompt_token_ids, [completion], finished, req.metrics, req.error)
        out.prompt_logprobs = req.prompt_logprobs
        return out

    def _completion_at_once(self, req: Request, n: int, num_new: int, reason, finished: bool) -> CompletionOutput:
        """A completion with logprobs or stop strings, or a group's sample: built now (see the module's docstring)."""
        text = None
        if req in self.stop_strings.streams:
            text, stop_string, num_new = self.stop_strings.output(req, finished)
        completion = self.completion(req, n, num_new, reason)
        if req.logprobs is not None:
            completion.logprobs, completion.cumulative_logprob = req.logprobs[:n], req.cumulative_logprob
        if text is not None:
            completion.text = text
            completion.stop_reason = stop_string if stop_string is not None else self._stop_token(req)
        return completion

    def completion(self, req: Request, n: int, num_new: int, reason: str | None) -> CompletionOutput:
        """The completion of `req` when the host had received `n` of its tokens, the last `num_new` of them new,
        ended for `reason` (None: still running); its text decoded when read."""
        completion = CompletionOutput.received(0, req.output_token_ids, n, num_new, reason)
        if self._decode is not None:
            if reason is None:
                completion.decode_text_with(self._decode)
            else:
                completion.decode_text_with(self._decoder(req))
                completion.stop_reason = self._stop_token(req)
        return completion

    def _decoder(self, req: Request) -> Callable[[list[int]], str]:
        """How an output's text is decoded when read: the text of a stop token (or EOS) that ended it is left out,
        unless include_stop_str_in_output (vLLM)."""
        decode = self.tokenizer.decode
        if req.finish_reason is FinishReason.STOP and not req.params.include_stop_str_in_output:
            return lambda ids: decode(ids[:-1])
        return decode

    def _stop_token(self, req: Request) -> int | None:
        """vLLM's stop_reason of an output ended by a token: the stop token id, None for EOS (or the checkpoint's
        other eos ids, which add_request made stop ids)."""
        p, tokens = req.params, req.output_token_ids
        if req.finish_reason is not FinishReason.STOP or not tokens:
            return None
        t, mcfg = tokens[-1], self.model_config
        if not p.ignore_eos and (t == mcfg.eos_token_id or t in mcfg.extra_eos_token_ids):
            return None
        return t if t in p.stop_token_ids else None


def _token_counts(changed: list[Request]) -> dict[Request, int]:
    """Each request of `changed` (in order of first appearance) -> how many times it appears: the tokens it got."""
    counts = dict.fromkeys(changed, 1)
    return counts if len(counts) == len(changed) else collections.Counter(changed)  # (a Counter only when needed)
