"""The OpenAI request bodies the server accepts, parsed and checked into one `GenerationRequest`, and OpenAI's error
shape.

Parsing is strict, as the issue asks: an unknown field is a 400 naming it, and so is a known OpenAI field whose
value would need a feature cbjax does not have (echo, suffix, tools). The values clients send by default for those
fields (`echo: false`, ...) are accepted, so the official client and `vllm bench serve` work unchanged. The sampling
options (n, best_of, logprobs, penalties, min_tokens, stop, logit_bias, seed, response_format, and vLLM's extras
repetition_penalty, min_tokens, bad_words, include_stop_str_in_output) are parsed into their Python types here and
checked by `SamplingParams` and the engine; their `ValueError` messages become the 400's message.
"""

import dataclasses
from typing import Any

from cbjax.config import validation as check
from cbjax.core.sampling_params import SamplingParams
from cbjax.core.structured_outputs import StructuredOutputs


class ProtocolError(Exception):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Fields with no effect here, accepted only at the value that asks for nothing (what clients send by default).
_INERT = {
    "echo": (None, False),
    "suffix": (None, ""),
    "parallel_tool_calls": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
}
# Per endpoint: a completion has no top_logprobs (its logprobs is the count), a chat no best_of.
_COMPLETION_INERT = {"top_logprobs": (None, 0)}
_CHAT_INERT = {"best_of": (None, 1)}
_FREE = {"model", "user", "stream_options"}  # checked on their own (or not at all: `user` is any string)
_SAMPLING = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "response_format",
    # vLLM's extensions
    "repetition_penalty",
    "min_tokens",
    "bad_words",
    "include_stop_str_in_output",
}
# cbjax's extensions: scheduling hints for the policies, and the generated token ids in the response (vLLM's name).
_CBJAX = {"priority", "tenant", "deadline_ms", "return_token_ids"}
_BOTH = frozenset(_INERT) | _FREE | _SAMPLING | _CBJAX
COMPLETION_FIELDS = _BOTH | frozenset(_COMPLETION_INERT) | {"prompt", "best_of"}
CHAT_FIELDS = _BOTH | frozenset(_CHAT_INERT) | {"messages", "max_completion_tokens", "top_logprobs"}


@dataclasses.dataclass
class GenerationRequest:
    """One completion or chat request, checked. `prompt` is text or token ids (chat: the rendered template)."""

    kind: str  # "completion" | "chat"
    prompt: "str | list[int]"
    max_tokens: int | None  # None: the rest of the context (chat's default)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    model: str | None = None
    priority: int = 0
    tenant: str = "default"
    deadline_ms: float | None = None  # relative to arrival; the `edf` policy reads it
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None  # completions: `logprobs`; chat: `top_logprobs` when `logprobs` is true
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    bad_words: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    structured: StructuredOutputs | None = None  # from response_format

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams for this request (ValueError naming a bad value: a 400)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            n=self.n,
            best_of=self.best_of,
            logprobs=self.logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            bad_words=self.bad_words,
            logit_bias=self.logit_bias,
            stop=self.stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured=self.structured,
        )


def _bad(message: str, param: str | None) -> ProtocolError:
    return ProtocolError(message, 400, param=param)


_is_int = check.is_integer


def _get(body: dict, name: str, default, checker):
    """body[name] through one of cbjax.config.validation's checkers (None or absent: `default`); a refusal is a 400
    naming the field."""
    v = body.get(name, default)
    if v is None:
        return default
    try:
        return checker(f"'{name}'", v)
    except ValueError as e:
        raise _bad(str(e), name) from None


def _get_int(body: dict, name: str, default):
    return _get(body, name, default, check.integer)


def _get_float(body: dict, name: str, default):
    return _get(body, name, default, check.real)


def _get_bool(body: dict, name: str, default: bool) -> bool:
    return _get(body, name, default, check.boolean)


def _get_str(body: dict, name: str, default):
    return _get(body, name, default, lambda n, v: check.text(n, v, empty=True))


def _check_fields(body: Any, allowed: frozenset, inert: dict) -> None:
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _bad(f"unknown field(s) {unknown}; this server accepts {sorted(allowed)}", unknown[0])
    for name, accepted in (_INERT | inert).items():
        if name in body and not _inert(body[name], accepted):
            raise _bad(f"'{name}'={body[name]!r} is not supported (accepted: {list(accepted)})", name)


def _inert(v, accepted: tuple) -> bool:
    # Same type too: `n: true` is not `n: 1`.
    return any(v is None if a is None else (type(v) is type(a) and v == a) for a in accepted)


def _common(body: dict, headers, kind: str, prompt, max_tokens: int | None) -> GenerationRequest:
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise _bad(f"'stop' must be a string or a list of strings, got {stop!r}", "stop")
    if any(not s for s in stop):
        raise _bad("'stop' strings must not be empty", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise _bad(f"'stop_token_ids' must be a list of integers, got {stop_ids!r}", "stop_token_ids")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise _bad(f"'stream_options' accepts only include_usage, got {opts!r}", "stream_options")
        include_usage = _get_bool(opts, "include_usage", False)
    stream = _get_bool(body, "stream", False)
    if opts is not None and not stream:
        raise _bad("'stream_options' is only allowed with stream=true", "stream_options")
    # Headers name the scheduling hints too, so a load generator can set them without changing bodies.
    hdr = {k.lower(): v for k, v in (headers or {}).items()}
    priority = _get_int(body, "priority", None)
    if priority is None and "x-priority" in hdr:
        try:
            priority = int(hdr["x-priority"])
        except ValueError:
            raise _bad(f"X-Priority must be an integer, got {hdr['x-priority']!r}", "priority") from None
    tenant = _get_str(body, "tenant", None) or hdr.get("x-tenant") or "default"
    deadline_ms = _get_float(body, "deadline_ms", None)
    if deadline_ms is None and "x-deadline-ms" in hdr:
        try:
            deadline_ms = float(hdr["x-deadline-ms"])
        except ValueError:
            raise _bad(f"X-Deadline-Ms must be a number, got {hdr['x-deadline-ms']!r}", "deadline_ms") from None
    return GenerationRequest(
        kind=kind,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_get_float(body, "temperature", 1.0),
        top_p=_get_float(body, "top_p", 1.0),
        top_k=_get_int(body, "top_k", -1),
        seed=_get_int(body, "seed", None),
        stop=stop,
        stop_token_ids=tuple(int(t) for t in stop_ids),
        ignore_eos=_get_bool(body, "ignore_eos", False),
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_get_bool(body, "return_token_ids", False),
        model=_get_str(body, "model", None),
        priority=priority or 0,
        tenant=tenant,
        deadline_ms=deadline_ms,
        n=_get_int(body, "n", 1),
        presence_penalty=_get_float(body, "presence_penalty", 0.0),
        frequency_penalty=_get_float(body, "frequency_penalty", 0.0),
        repetition_penalty=_get_float(body, "repetition_penalty", 1.0),
        min_tokens=_get_int(body, "min_tokens", 0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        bad_words=_strings(body, "bad_words"),
        include_stop_str_in_output=_get_bool(body, "include_stop_str_in_output", False),
        structured=_response_format(body.get("response_format")),
    )


def _strings(body: dict, name: str) -> tuple[str, ...]:
    v = body.get(name)
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise _bad(f"'{name}' must be a list of non-empty strings, got {v!r}", name)
    return tuple(v)


def _logit_bias(v) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} (JSON keys are strings) -> {int: float}; SamplingParams clamps to [-100, 100] and
    the engine checks the ids against the vocabulary."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad(f"'logit_bias' must be an object of token id -> bias, got {v!r}", "logit_bias")
    out = {}
    for k, bias in v.items():
        try:
            token = int(k)
        except ValueError:
            raise _bad(f"'logit_bias' keys must be token ids, got {k!r}", "logit_bias") from None
        try:
            out[token] = check.real(f"'logit_bias[{k}]'", bias)
        except ValueError as e:
            raise _bad(str(e), "logit_bias") from None
    return out or None


def _response_format(v) -> StructuredOutputs | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = v.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad("response_format json_schema needs 'json_schema': {'schema': {...}}", "response_format")
        try:
            return StructuredOutputs(json=schema)
        except ValueError as e:
            raise _bad(str(e), "response_format") from None
    raise _bad(f"'response_format' must have type 'text', 'json_object' or 'json_schema', got {v!r}", "response_format")


def _prompt(body: dict):
    """Text, token ids, or a batch of exactly one of those (what the client sends for a single prompt list)."""
    if "prompt" not in body:
        raise _bad("'prompt' is required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all(_is_int(t) for t in p):
        return [int(t) for t in p]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise _bad(f"a batch of {len(p)} prompts is not supported: send one prompt per request", "prompt")
    raise _bad("'prompt' must be a string or a list of token ids", "prompt")


def parse_completion(body: Any, headers=None) -> GenerationRequest:
    """`POST /v1/completions` body -> GenerationRequest (ProtocolError 400 when malformed)."""
    _check_fields(body, COMPLETION_FIELDS, _COMPLETION_INERT)
    req = _common(body, headers, "completion", _prompt(body), _get_int(body, "max_tokens", 16))
    req.logprobs = _get_int(body, "logprobs", None)
    req.best_of = _get_int(body, "best_of", None)
    if req.stream and req.best_of is not None and req.best_of != req.n:
        raise _bad("best_of != n cannot be streamed: the best samples are known only at the end", "best_of")
    return req


def parse_chat(body: Any, headers=None) -> tuple[GenerationRequest, list[dict]]:
    """`POST /v1/chat/completions` body -> (GenerationRequest without its prompt yet, the messages)."""
    _check_fields(body, CHAT_FIELDS, _CHAT_INERT)
    logprobs = _get_bool(body, "logprobs", False)
    top = _get_int(body, "top_logprobs", None)
    if top is not None and not logprobs:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a 'role' string", "messages")
        content = m.get("content")
        if isinstance(content, list):  # the content-parts form: text parts only
            if not all(
                isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content
            ):
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(c["text"] for c in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": m["role"], "content": content})
    max_tokens = _get_int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _get_int(body, "max_tokens", None)
    req = _common(body, headers, "chat", "", max_tokens)
    req.logprobs = (top or 0) if logprobs else None
    return req, out
