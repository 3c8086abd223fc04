"""Workload files: loading traces (JSONL with arrival times, ShareGPT, the peers' JSON) into `WorkloadRequest`s,
and writing them back. Pure Python + numpy (no jax). `cbjax.bench.workload.make_workload` calls these for the file
kinds; the formats and their validation rules are described on each loader.

Text without token ids becomes `tokenize(text)` when a tokenizer is given, else placeholder ids of the estimated
length (`approx_num_tokens`), which is what a random-init model needs.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from cbjax.bench.requests import (
    DEFAULT_LONG_THRESHOLD,
    DEFAULT_LOW_ID,
    DEFAULT_VOCAB_SIZE,
    LENGTH_CLASSES,
    Stream,
    Tokenize,
    WorkloadRequest,
    check_vocab,
    length_class_of,
    random_token_ids,
    rng_for,
)

CHARS_PER_TOKEN = 4  # approx_num_tokens: the usual ~4 characters per BPE token for English text

__all__ = [
    "approx_num_tokens",
    "load_arrival_times",
    "load_jsonl",
    "load_peers_json",
    "load_sharegpt",
    "save_jsonl",
    "save_peers_json",
]


def approx_num_tokens(text: str) -> int:
    """Token count of `text` without a tokenizer: ceil(characters / 4), at least 1 (the usual rule of thumb
    for English text and BPE vocabularies of 32k-100k)."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def _text_to_ids(
    text: str, tokenize: Tokenize | None, rng: np.random.Generator, vocab_size: int, low_id: int
) -> tuple[int, ...]:
    if tokenize is not None:
        return tuple(int(t) for t in tokenize(text))
    return random_token_ids(rng, approx_num_tokens(text), vocab_size, low_id)


def _text_len(text: str, tokenize: Tokenize | None) -> int:
    return max(1, len(tokenize(text))) if tokenize is not None else approx_num_tokens(text)


# ----------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _token_ids(value: Any, vocab_size: int | None, where: str, field: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: '{field}' must be a non-empty list of token ids")
    for j, t in enumerate(value):
        if not _is_int(t) or t < 0:
            raise ValueError(f"{where}: '{field}'[{j}] must be a non-negative int, got {t!r}")
        if vocab_size is not None and t >= vocab_size:
            raise ValueError(f"{where}: '{field}'[{j}] = {t} is out of range for vocab_size={vocab_size}")
    return tuple(value)


def _read_json_lines(path: str | os.PathLike) -> Iterable[tuple[int, str, Any]]:
    """(1-based line number, where, parsed value) for each non-blank line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}, line {lineno}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            yield lineno, where, value


def load_jsonl(
    path: str | os.PathLike,
    *,
    tokenize: Tokenize | None = None,
    vocab_size: int | None = DEFAULT_VOCAB_SIZE,
    low_id: int = DEFAULT_LOW_ID,
    seed: int = 0,
    require_arrival: bool = True,
    long_threshold: int = DEFAULT_LONG_THRESHOLD,
) -> list[WorkloadRequest]:
    """A JSONL trace, one request per line, in file order (times as written, not shifted; see `make_workload`).

    Each line is an object with:
      arrival_time (or timestamp)  number, seconds; required unless require_arrival=False (then 0.0)
      prompt_token_ids or prompt   a list of ids, or text (ids via `tokenize`, else placeholders, see
                                   `WorkloadRequest`); both may be given, the ids are used
      max_tokens (or output_len)   int >= 1
      optional: request_id (str, unique; default "req-<k>"), tenant (str), priority (int),
                deadline (number, same clock as arrival_time),
                length_class ("short" | "long"; default by `length_class_of`)
    Blank lines are skipped. A malformed line raises ValueError naming the file, the 1-based line and the problem.
    """
    vrng = None
    out: list[WorkloadRequest] = []
    seen: dict[str, int] = {}
    for lineno, where, obj in _read_json_lines(path):
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        key = "arrival_time" if "arrival_time" in obj else "timestamp"
        if key in obj:
            if not _is_num(obj[key]):
                raise ValueError(f"{where}: '{key}' must be a finite number, got {obj[key]!r}")
            arrival = float(obj[key])
        elif require_arrival:
            raise ValueError(f"{where}: missing 'arrival_time' (or 'timestamp')")
        else:
            arrival = 0.0
        text = obj.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{where}: 'prompt' must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in obj:
            ids = _token_ids(obj["prompt_token_ids"], vocab_size, where, "prompt_token_ids")
        elif text is not None:
            if vrng is None:
                vrng = rng_for(seed, Stream.TOKENS)
            ids = _text_to_ids(text, tokenize, vrng, vocab_size or DEFAULT_VOCAB_SIZE, low_id)
        else:
            raise ValueError(f"{where}: missing 'prompt_token_ids' or 'prompt'")
        okey = "max_tokens" if "max_tokens" in obj else "output_len"
        if okey not in obj:
            raise ValueError(f"{where}: missing 'max_tokens' (or 'output_len')")
        if not _is_int(obj[okey]) or obj[okey] < 1:
            raise ValueError(f"{where}: '{okey}' must be an int >= 1, got {obj[okey]!r}")
        rid = obj.get("request_id", f"req-{len(out)}")
        if not isinstance(rid, str):
            raise ValueError(f"{where}: 'request_id' must be a string, got {rid!r}")
        if rid in seen:
            raise ValueError(f"{where}: duplicate request_id {rid!r} (first on line {seen[rid]})")
        seen[rid] = lineno
        tenant = obj.get("tenant", "default")
        if not isinstance(tenant, str):
            raise ValueError(f"{where}: 'tenant' must be a string, got {tenant!r}")
        priority = obj.get("priority", 0)
        if not _is_int(priority):
            raise ValueError(f"{where}: 'priority' must be an int, got {priority!r}")
        deadline = obj.get("deadline")
        if deadline is not None and not _is_num(deadline):
            raise ValueError(f"{where}: 'deadline' must be a finite number, got {deadline!r}")
        lclass = obj.get("length_class", length_class_of(len(ids), obj[okey], long_threshold))
        if lclass not in LENGTH_CLASSES:
            raise ValueError(f"{where}: 'length_class' must be one of {list(LENGTH_CLASSES)}, got {lclass!r}")
        out.append(
            WorkloadRequest(
                rid,
                arrival,
                ids,
                obj[okey],
                tenant=tenant,
                priority=priority,
                deadline=None if deadline is None else float(deadline),
                length_class=lclass,
                prompt=text,
            )
        )
    return out


def load_arrival_times(path: str | os.PathLike) -> list[float]:
    """Arrival times from a JSONL file: each line a number, or an object with `arrival_time` (or `timestamp`)."""
    times = []
    for _, where, obj in _read_json_lines(path):
        if isinstance(obj, dict):
            key = "arrival_time" if "arrival_time" in obj else "timestamp"
            if key not in obj:
                raise ValueError(f"{where}: missing 'arrival_time' (or 'timestamp')")
            obj = obj[key]
        if not _is_num(obj):
            raise ValueError(f"{where}: arrival time must be a finite number, got {obj!r}")
        times.append(float(obj))
    return times


def _load_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{os.fspath(path)}: invalid JSON at line {e.lineno}, column {e.colno} ({e.msg})"
            ) from None


def load_sharegpt(
    path: str | os.PathLike,
    *,
    tokenize: Tokenize | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    low_id: int = DEFAULT_LOW_ID,
    seed: int = 0,
    long_threshold: int = DEFAULT_LONG_THRESHOLD,
) -> list[WorkloadRequest]:
    """ShareGPT JSON: a list of {"conversations": [{"from": "human" | "gpt", "value": str}, ...], ...}.

    Prompt = the first human turn; max_tokens = the length of the first gpt reply after it. Lengths come from
    `tokenize` when given, else `approx_num_tokens`; prompt ids are then placeholders (see `WorkloadRequest`).
    Other roles ("system", ...) are ignored. Entries without a non-empty human turn followed by a non-empty gpt
    reply are skipped, as real dumps hold many. A structurally malformed entry raises ValueError naming the
    file and the 0-based entry index. Request ids are "sharegpt-<entry index>"; all arrive at 0.
    """
    data = _load_json(path)
    p = os.fspath(path)
    if not isinstance(data, list):
        raise ValueError(f"{p}: expected a JSON list of conversations, got {type(data).__name__}")
    vocab_size, low_id = check_vocab(vocab_size, low_id)
    rng = rng_for(seed, Stream.TOKENS)
    out = []
    for i, entry in enumerate(data):
        where = f"{p}, entry {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
            raise ValueError(f"{where}: expected an object with a 'conversations' list")
        human = reply = None
        for j, turn in enumerate(entry["conversations"]):
            if (
                not isinstance(turn, dict)
                or not isinstance(turn.get("from"), str)
                or not isinstance(turn.get("value"), str)
            ):
                raise ValueError(f"{where}: conversations[{j}] must be an object with string 'from' and 'value'")
            if human is None and turn["from"] == "human":
                human = turn["value"]
            elif human is not None and turn["from"] == "gpt":
                reply = turn["value"]
                break
        if not human or not reply:
            continue
        ids = _text_to_ids(human, tokenize, rng, vocab_size, low_id)
        olen = _text_len(reply, tokenize)
        out.append(
            WorkloadRequest(
                f"sharegpt-{i}",
                0.0,
                ids,
                olen,
                prompt=human,
                length_class=length_class_of(len(ids), olen, long_threshold),
            )
        )
    return out


def load_peers_json(
    path: str | os.PathLike,
    *,
    vocab_size: int | None = DEFAULT_VOCAB_SIZE,
    long_threshold: int = DEFAULT_LONG_THRESHOLD,
) -> list[WorkloadRequest]:
    """The peer-baseline format (shared/peers/make_workload.py): a JSON list of
    {"prompt_token_ids": [...], "max_new_tokens": n}; all offline, ids "req-<entry index>" (the dump order of
    the peer scripts). A malformed entry raises ValueError naming the file and the 0-based entry index."""
    data = _load_json(path)
    p = os.fspath(path)
    if not isinstance(data, list):
        raise ValueError(f"{p}: expected a JSON list of requests, got {type(data).__name__}")
    out = []
    for i, entry in enumerate(data):
        where = f"{p}, entry {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
        if "prompt_token_ids" not in entry:
            raise ValueError(f"{where}: missing 'prompt_token_ids'")
        ids = _token_ids(entry["prompt_token_ids"], vocab_size, where, "prompt_token_ids")
        n = entry.get("max_new_tokens")
        if not _is_int(n) or n < 1:
            raise ValueError(f"{where}: 'max_new_tokens' must be an int >= 1, got {n!r}")
        out.append(WorkloadRequest(f"req-{i}", 0.0, ids, n, length_class=length_class_of(len(ids), n, long_threshold)))
    return out


def save_jsonl(requests: Iterable[WorkloadRequest], path: str | os.PathLike) -> None:
    """Write the JSONL trace format of `load_jsonl`; `make_workload(kind="jsonl")` replays it exactly."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            obj: dict[str, Any] = {
                "request_id": r.request_id,
                "arrival_time": float(r.arrival_time),
                "prompt_token_ids": list(r.prompt_token_ids),
                "max_tokens": int(r.max_tokens),
                "tenant": r.tenant,
                "priority": int(r.priority),
                "length_class": r.length_class,
            }
            if r.deadline is not None:
                obj["deadline"] = float(r.deadline)
            if r.prompt is not None:
                obj["prompt"] = r.prompt
            f.write(json.dumps(obj) + "\n")


def save_peers_json(requests: Iterable[WorkloadRequest], path: str | os.PathLike) -> None:
    """Write the peer-baseline format, so the HF / vLLM baselines run the same prompts (arrivals are dropped)."""
    data = [{"prompt_token_ids": list(r.prompt_token_ids), "max_new_tokens": int(r.max_tokens)} for r in requests]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
