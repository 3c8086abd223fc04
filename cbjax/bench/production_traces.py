"""Published production traces as workloads: request and response token counts with their arrival times, from
the CSV files of the Azure LLM inference traces and of BurstGPT. Pure Python + numpy (no jax); no file is
downloaded: give the path of one you have (tests use small samples written by hand, tests/bench/data/).

These traces carry lengths and times, never text, so each prompt is that many random token ids (what a random-init
model or a scheduling study needs; seeded by `seed`, one stream as for every generated workload). `scale`
multiplies both lengths (at least 1 token each), to bring a production mix onto a small CPU model.

Formats, as published:
- Azure LLM inference traces (AzurePublicDataset, `AzureLLMInferenceTrace_{code,conv}*.csv`, 2023 and 2024): a header
  `TIMESTAMP,ContextTokens,GeneratedTokens`; TIMESTAMP a date-time such as `2023-11-16 18:15:46.6805900` (7
  fractional digits) or `2024-05-10 00:00:00.009930+00:00`.
- BurstGPT (`BurstGPT_*.csv`): a header `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`;
  Timestamp in seconds from the trace's start. Rows with 0 response tokens (failed requests) are skipped: a request
  must ask for at least one token. `models` / `log_types` keep only the rows of those values (e.g. "ChatGPT",
  "Conversation log").
Arrival times are the file's, in seconds from its first row; `cbjax.bench.workload.make_workload` replays them
(arrival="trace", optionally compressed to a chosen mean rate: `trace_rate`) or replaces them.
"""

from __future__ import annotations

import csv
import datetime
import math
import os
from collections.abc import Iterator, Sequence

from cbjax.bench.requests import (
    DEFAULT_LONG_THRESHOLD,
    DEFAULT_LOW_ID,
    DEFAULT_VOCAB_SIZE,
    Stream,
    WorkloadRequest,
    length_class_of,
    random_token_ids,
    rng_for,
)

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Log Type")


def parse_azure_timestamp(text: str) -> float:
    """Seconds since the epoch of an Azure trace's TIMESTAMP; more than 6 fractional digits are cut to 6 (Python's
    limit), a missing time zone is UTC."""
    text = text.strip()
    date, sep, rest = text.partition(".")
    if sep:
        digits = len(rest) - len(rest.lstrip("0123456789"))
        rest = rest[: min(digits, 6)] + rest[digits:]
        text = f"{date}.{rest}"
    t = datetime.datetime.fromisoformat(text)
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.UTC)
    return t.timestamp()


def _rows(path: str | os.PathLike, columns: Sequence[str]) -> Iterator[tuple[int, dict]]:
    """(line number, row) of a CSV file with a header holding `columns` (ValueError naming the file otherwise)."""
    p = os.fspath(path)
    with open(p, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in reader.fieldnames or []]
        missing = [c for c in columns if c not in header]
        if missing:
            raise ValueError(f"{p}: not this trace's format: the header lacks {missing} (it has {header})")
        reader.fieldnames = header
        for row in reader:
            yield reader.line_num, row


def _count(row: dict, column: str, where: str, minimum: int) -> int:
    text = (row.get(column) or "").strip()
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{where}: {column} must be a whole number, got {text!r}") from None
    if value != int(value) or value < minimum:
        raise ValueError(f"{where}: {column} must be a whole number >= {minimum}, got {text!r}")
    return int(value)


def _requests(
    rows: Sequence[tuple[float, int, int]],
    prefix: str,
    *,
    seed: int,
    scale: float,
    vocab_size: int,
    low_id: int,
    long_threshold: int,
) -> list[WorkloadRequest]:
    """(time, prompt tokens, output tokens) rows as requests: times from the first row's, random prompt ids."""
    rng = rng_for(seed, Stream.TOKENS)
    start = min((t for t, _, _ in rows), default=0.0)
    out = []
    for i, (t, prompt_len, output_len) in enumerate(rows):
        cls = length_class_of(prompt_len, output_len, long_threshold)  # judged on the trace's own lengths
        p, o = max(1, round(prompt_len * scale)), max(1, round(output_len * scale))
        ids = random_token_ids(rng, p, vocab_size, low_id)
        out.append(WorkloadRequest(f"{prefix}-{i}", t - start, ids, o, length_class=cls))
    return out


def load_azure_llm_trace(
    path: str | os.PathLike,
    *,
    num_requests: int | None = None,
    seed: int = 0,
    scale: float = 1.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    low_id: int = DEFAULT_LOW_ID,
    long_threshold: int = DEFAULT_LONG_THRESHOLD,
) -> list[WorkloadRequest]:
    """The first `num_requests` rows (None: all) of an Azure LLM inference trace, as requests "azure-<row>" in
    the file's order. A row with a bad count or time raises ValueError naming the file and line."""
    rows = []
    for line, row in _rows(path, AZURE_COLUMNS):
        if num_requests is not None and len(rows) == num_requests:
            break
        where = f"{os.fspath(path)}, line {line}"
        try:
            t = parse_azure_timestamp(row["TIMESTAMP"] or "")
        except ValueError:
            raise ValueError(f"{where}: TIMESTAMP is not a date-time: {row['TIMESTAMP']!r}") from None
        rows.append((t, _count(row, "ContextTokens", where, 1), _count(row, "GeneratedTokens", where, 1)))
    return _requests(rows, "azure", seed=seed, scale=scale, vocab_size=vocab_size, low_id=low_id,
                     long_threshold=long_threshold)  # fmt: skip


def load_burstgpt(
    path: str | os.PathLike,
    *,
    num_requests: int | None = None,
    seed: int = 0,
    scale: float = 1.0,
    models: Sequence[str] | None = None,
    log_types: Sequence[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    low_id: int = DEFAULT_LOW_ID,
    long_threshold: int = DEFAULT_LONG_THRESHOLD,
) -> list[WorkloadRequest]:
    """The first `num_requests` usable rows (None: all) of a BurstGPT trace, as requests "burstgpt-<k>" in the
    file's order: rows with 0 response tokens, or of a model / log type not asked for, are skipped. A row with a bad
    count or time raises ValueError naming the file and line."""
    keep_models = None if models is None else {str(m) for m in models}
    keep_logs = None if log_types is None else {str(t) for t in log_types}
    rows = []
    for line, row in _rows(path, BURSTGPT_COLUMNS):
        if num_requests is not None and len(rows) == num_requests:
            break
        where = f"{os.fspath(path)}, line {line}"
        if keep_models is not None and (row["Model"] or "").strip() not in keep_models:
            continue
        if keep_logs is not None and (row["Log Type"] or "").strip() not in keep_logs:
            continue
        try:
            t = float(row["Timestamp"])
            if not math.isfinite(t):
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"{where}: Timestamp must be seconds, got {row['Timestamp']!r}") from None
        output_len = _count(row, "Response tokens", where, 0)
        if output_len == 0:  # a failed request in the trace: nothing to generate
            continue
        rows.append((t, _count(row, "Request tokens", where, 1), output_len))
    return _requests(rows, "burstgpt", seed=seed, scale=scale, vocab_size=vocab_size, low_id=low_id,
                     long_threshold=long_threshold)  # fmt: skip
