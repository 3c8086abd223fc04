"""Log-probabilities in OpenAI's response shapes, from the engine's (vLLM's) form: one {token id: Logprob} per
output token, the chosen token first, then the top k (SamplingParams.logprobs; cbjax/core/outputs.py).

- completions: {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}], "text_offset": [int]};
  top_logprobs holds every entry the engine gave (the chosen token and the top k: up to k + 1, as OpenAI and vLLM).
- chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}; the top k by
  log-probability.

JSON has no -inf: a log-probability below -9999 is sent as -9999.0 (vLLM's clamp).
"""

from collections.abc import Callable

MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


class TokenText:
    """A token id's text as shown in logprobs: the engine's decoded_token, else the tokenizer's, else `token_id:N`
    (vLLM's spelling for a model without a tokenizer)."""

    def __init__(self, decode: Callable[[list[int]], str] | None):
        self.decode = decode

    def __call__(self, token: int, entry=None) -> str:
        if entry is not None and getattr(entry, "decoded_token", None) is not None:
            return entry.decoded_token
        if self.decode is None:
            return f"token_id:{token}"
        return self.decode([token])


def completion_logprobs(entries: list[dict], token_ids: list[int], text: TokenText, offset: int) -> tuple[dict, int]:
    """The completions shape of these tokens' logprobs, whose text starts at character `offset` of the choice's text;
    returns it and the offset after them."""
    tokens, chosen, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        s = text(token, entry.get(token))
        tokens.append(s)
        chosen.append(_lp(entry[token].logprob) if token in entry else None)
        tops.append({text(t, lp): _lp(lp.logprob) for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(entries: list[dict], token_ids: list[int], text: TokenText, top_k: int) -> dict:
    """The chat shape of these tokens' logprobs, with the top `top_k` alternatives of each."""
    content = []
    for token, entry in zip(token_ids, entries):
        best = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top_k]
        s = text(token, entry.get(token))
        content.append(
            {
                "token": s,
                "logprob": _lp(entry[token].logprob) if token in entry else MIN_LOGPROB,
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {"token": (a := text(t, lp)), "logprob": _lp(lp.logprob), "bytes": list(a.encode())}
                    for t, lp in best
                ],
            }
        )
    return {"content": content}
