"""`make_workload(cfg)`: the deterministic request workload an experiment config describes.

Everything in cbjax.bench is pure Python + numpy (no jax), so experiments and tests build a workload cheaply.

A workload is a list of `WorkloadRequest` (cbjax.bench.requests), sorted by `arrival_time` (seconds from the start
of the run). `make_workload` is the one entry point an experiment needs; the pieces it is built from are public
so tests and notebooks can use them directly: `LengthSpec` (lengths.py), `arrival_times` (arrivals.py),
`synthetic_workload`, `mixed_workload`, `shared_prefix_workload`, `session_workload` (generators.py), the file
loaders and writers for JSONL traces, ShareGPT and the peers' JSON (trace_files.py), and the production traces'
loaders (production_traces.py: the Azure LLM inference traces, BurstGPT).

Determinism: every random choice comes from a numpy `Generator` derived from `(seed, stream)`, with one
independent stream per concern (arrivals, prompt lengths, output lengths, token ids, ...). So changing the
arrival process or `request_rate` leaves the requests themselves (lengths and token ids) unchanged: a
request-rate sweep compares policies on the *same* requests, only arriving at different times.

Config fields read by `make_workload` (a dict, an ml_collections ConfigDict or any object with attributes;
a field that is missing or None takes its default; an unknown field is an error, to catch typos):

  kind            "synthetic" | "mixed" | "shared_prefix" | "sessions" | "jsonl" | "sharegpt" | "peers_json" |
                  "azure_llm" | "burstgpt"   (required; the last two: production traces' CSV files,
                  production_traces.py; sessions: multi-turn conversations, below)
  num_requests    int >= 1; required for generated kinds; for files, None means every request in the file;
                  sessions: the number of arrivals (each starts a session or is a one-shot request)
  seed            int >= 0, default 0
  arrival         "offline" (all at t=0) | "poisson" | "gamma" | "weibull" | "trace"; default "trace" for the
                  files that hold times (jsonl, azure_llm, burstgpt), else "offline". "trace" takes arrival times
                  from `path` (for generated kinds `path` is a JSONL file of times: each line a number or an object
                  with `arrival_time`/`timestamp`)
  request_rate    requests/s for poisson, gamma and weibull (inf means offline)
  burstiness      gamma or weibull shape, default 1.0 (== poisson); < 1 is burstier, > 1 more regular
  diurnal_period_s, diurnal_amplitude   poisson/gamma/weibull: the rate cycles as
                  request_rate * (1 + amplitude * sin(2 pi t / period)), amplitude in [0, 1) (arrivals.py)
  trace_rate      arrival="trace": replay the trace compressed or stretched in time to this mean rate (requests/s;
                  the same bursts at another load); None: the trace's own clock
  trace_models, trace_log_types   burstgpt: keep only rows of these models / log types (comma-separated or a list)
  vocab_size      token ids are drawn from [low_id, vocab_size); default 32000. For files, ids must be below it
  low_id          smallest generated token id, default 3 (0..2 are pad/bos/eos in the project's models)
  prompt_len      length spec (see `LengthSpec`; a bare int means fixed); synthetic: the prompt,
                  shared_prefix: the unique suffix after the shared prefix; sessions: the first turn's prompt
  output_len      length spec for max_tokens
  scale           multiplies every generated length (default 1.0), to shrink a workload onto a CPU; also the
                  lengths of the production traces (azure_llm, burstgpt)
  num_prefixes    shared_prefix: number of distinct system prompts (default 4)
  prefix_len      shared_prefix: tokens in each system prompt (required for shared_prefix)
  tenant_per_prefix  shared_prefix: tenant = "prefix-<k>" (default False: every request is tenant "default")
  num_turns       sessions: length spec of the turns per session (required)
  message_len     sessions: length spec of each later turn's new user message (required)
  think_time_s    sessions: the pause between an answer and the next message: seconds (fixed) or a mapping
                  dist="exponential" (mean) | "lognormal" (mean, sigma) | "fixed" (value) (`ThinkTime`; default 0)
  one_shot_fraction  sessions: the share of arrivals that are one-shot requests (no session; default 0)
  path            file to load (jsonl / sharegpt / peers_json) or the arrival trace (arrival="trace")
  max_model_len   clip so prompt_len + max_tokens <= max_model_len (see `clip_to_max_model_len`); sessions end
                  before the first turn whose whole conversation would not fit
  long_threshold  requests without a preset class (mixed preset, or length_class in a JSONL line) are "long"
                  when prompt_len + max_tokens > long_threshold (default 1024), judged before clipping
  deadline_s      if set, requests without a deadline get deadline = arrival_time + deadline_s
  tenant_priority mapping tenant -> priority (lower is more important); requests of a listed tenant get it

Sessions (kind="sessions", generators.session_workload, run closed-loop by cbjax/bench/sessions.py): the arrival
process starts each session; turn k+1's prompt is turn k's prompt + the answer the engine generated + a new message,
sent `think_time_s` after that answer. Turns are "s<i>-t<k>" (tenant "session"), one-shot requests "one-<i>" (tenant
"one_shot"). A later turn's `arrival_time` here is only its earliest possible arrival; the online loop sets the real
one. `arrival="trace"` takes the sessions' start times from `path`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from cbjax.bench.arrivals import ARRIVALS, RANDOM_ARRIVALS, arrival_times, at_mean_rate, check_diurnal
from cbjax.bench.fields import as_choice, as_float, as_int, check_fields, get_field
from cbjax.bench.generators import (
    ThinkTime,
    mixed_workload,
    session_workload,
    shared_prefix_workload,
    synthetic_workload,
)
from cbjax.bench.lengths import LengthSpec
from cbjax.bench.production_traces import load_azure_llm_trace, load_burstgpt
from cbjax.bench.requests import (
    DEFAULT_LONG_THRESHOLD,
    DEFAULT_LOW_ID,
    DEFAULT_VOCAB_SIZE,
    Stream,
    Tokenize,
    WorkloadRequest,
    check_vocab,
    rng_for,
)
from cbjax.bench.trace_files import load_arrival_times, load_jsonl, load_peers_json, load_sharegpt

KINDS = ("synthetic", "mixed", "shared_prefix", "sessions", "jsonl", "sharegpt", "peers_json", "azure_llm", "burstgpt")


def clip_to_max_model_len(req: WorkloadRequest, max_model_len: int) -> WorkloadRequest:
    """Make prompt_len + max_tokens <= max_model_len.

    The output is cut first (max_tokens = max_model_len - prompt_len), since the prompt is what the request *is*.
    When the prompt alone leaves no room for one output token, the prompt keeps its first max_model_len - 1 tokens
    (the head, so shared system prompts stay shared) and max_tokens becomes 1; its text, if any, is dropped
    because it no longer matches the ids.
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if req.prompt_len + req.max_tokens <= max_model_len:
        return req
    if req.prompt_len < max_model_len:
        return dataclasses.replace(req, max_tokens=max_model_len - req.prompt_len)
    return dataclasses.replace(
        req, prompt_token_ids=req.prompt_token_ids[: max_model_len - 1], max_tokens=1, prompt=None
    )


_CONFIG_FIELDS = (
    "kind",
    "num_requests",
    "seed",
    "arrival",
    "request_rate",
    "burstiness",
    "diurnal_period_s",
    "diurnal_amplitude",
    "trace_rate",
    "trace_models",
    "trace_log_types",
    "vocab_size",
    "low_id",
    "prompt_len",
    "output_len",
    "scale",
    "num_prefixes",
    "prefix_len",
    "tenant_per_prefix",
    "num_turns",
    "message_len",
    "think_time_s",
    "one_shot_fraction",
    "path",
    "max_model_len",
    "long_threshold",
    "deadline_s",
    "tenant_priority",
)
_GENERATED = ("synthetic", "mixed", "shared_prefix", "sessions")
_SESSION_FIELDS = ("num_turns", "message_len", "think_time_s", "one_shot_fraction")
_TIMED_FILES = ("jsonl", "azure_llm", "burstgpt")  # files whose requests carry their own arrival times
_PRODUCTION = ("azure_llm", "burstgpt")  # lengths without text: random ids, `scale` applies


def make_workload(cfg: Any, *, tokenize: Tokenize | None = None) -> list[WorkloadRequest]:
    """Build the workload described by `cfg` (fields in the module docstring), sorted by arrival time.

    Order of operations: requests (generated or loaded, first `num_requests`, length_class decided) ->
    arrival times -> `clip_to_max_model_len` -> deadlines -> tenant priorities. `tokenize` is only used for text in
    trace files.
    """
    check_fields(cfg, _CONFIG_FIELDS, "workload config")
    kind = get_field(cfg, "kind")
    if kind is None:
        raise ValueError(f"kind is required, one of {list(KINDS)}")
    kind = as_choice(kind, "kind", KINDS)
    seed = as_int(get_field(cfg, "seed", 0), "seed", minimum=0)
    n = get_field(cfg, "num_requests")
    n = None if n is None else as_int(n, "num_requests", minimum=1)
    arrival = as_choice(get_field(cfg, "arrival", "trace" if kind in _TIMED_FILES else "offline"), "arrival", ARRIVALS)
    vocab_size, low_id = check_vocab(
        get_field(cfg, "vocab_size", DEFAULT_VOCAB_SIZE), get_field(cfg, "low_id", DEFAULT_LOW_ID)
    )
    scale = as_float(get_field(cfg, "scale", 1.0), "scale", positive=True)
    path = get_field(cfg, "path")
    max_model_len = get_field(cfg, "max_model_len")
    if max_model_len is not None:
        max_model_len = as_int(max_model_len, "max_model_len", minimum=2)
    long_threshold = as_int(get_field(cfg, "long_threshold", DEFAULT_LONG_THRESHOLD), "long_threshold", minimum=0)
    deadline_s = get_field(cfg, "deadline_s")
    if deadline_s is not None:
        deadline_s = as_float(deadline_s, "deadline_s", positive=True)
    # Validate the arrival parameters up front, so a bad rate fails before any file is read.
    if arrival in RANDOM_ARRIVALS:
        if get_field(cfg, "request_rate") is None:
            raise ValueError(f"request_rate is required for arrival={arrival!r}")
        as_float(get_field(cfg, "request_rate"), "request_rate", positive=True, allow_inf=True)
        as_float(get_field(cfg, "burstiness", 1.0), "burstiness", positive=True)
    diurnal = check_diurnal(get_field(cfg, "diurnal_period_s"), get_field(cfg, "diurnal_amplitude", 0.0))
    if diurnal[0] is not None and arrival not in RANDOM_ARRIVALS:
        raise ValueError(f"a diurnal cycle modulates a rate: it needs arrival in {RANDOM_ARRIVALS}, got {arrival!r}")
    trace_rate = get_field(cfg, "trace_rate")
    if trace_rate is not None:
        if arrival != "trace":
            raise ValueError(f"trace_rate rescales a replayed trace: it needs arrival='trace', got {arrival!r}")
        trace_rate = as_float(trace_rate, "trace_rate", positive=True)
    if arrival == "trace" and kind in ("sharegpt", "peers_json"):
        raise ValueError(f"arrival='trace' is not available for kind={kind!r}: its file holds no arrival times")
    if (kind not in _GENERATED or arrival == "trace") and path is None:
        raise ValueError(
            f"path is required for kind={kind!r}" + (" with arrival='trace'" if kind in _GENERATED else "")
        )
    if kind not in _GENERATED + _PRODUCTION and scale != 1.0:
        raise ValueError(f"scale applies to generated workloads and production traces only, not kind={kind!r}")
    filters = {f: _names(get_field(cfg, f), f) for f in ("trace_models", "trace_log_types")}
    if kind != "burstgpt" and any(v is not None for v in filters.values()):
        raise ValueError(f"trace_models and trace_log_types filter BurstGPT rows only, not kind={kind!r}")
    misplaced = [f for f in _SESSION_FIELDS if get_field(cfg, f) is not None]
    if kind != "sessions" and misplaced:
        raise ValueError(f"{misplaced} describe multi-turn sessions: they need kind='sessions', not kind={kind!r}")
    session_starts = None  # sessions: each request's offset from its session's start

    if kind in _GENERATED:
        if n is None:
            raise ValueError(f"num_requests is required for kind={kind!r}")
        if kind == "mixed":
            reqs = mixed_workload(n, seed=seed, scale=scale, vocab_size=vocab_size, low_id=low_id)
        elif kind == "sessions":
            groups = session_workload(
                n,
                prompt_len=_required_spec(cfg, "prompt_len", kind).scaled(scale),
                message_len=_required_spec(cfg, "message_len", kind).scaled(scale),
                output_len=_required_spec(cfg, "output_len", kind).scaled(scale),
                num_turns=_required_spec(cfg, "num_turns", kind),
                think_time=ThinkTime.from_config(get_field(cfg, "think_time_s", 0.0)),
                one_shot_fraction=get_field(cfg, "one_shot_fraction", 0.0),
                seed=seed,
                vocab_size=vocab_size,
                low_id=low_id,
                max_model_len=max_model_len,
                long_threshold=long_threshold,
            )
            reqs = [r for g in groups for r in g]
            session_starts = [i for i, g in enumerate(groups) for _ in g]
        else:
            out_spec = _required_spec(cfg, "output_len", kind).scaled(scale)
            in_spec = _required_spec(cfg, "prompt_len", kind).scaled(scale)
            if kind == "synthetic":
                reqs = synthetic_workload(
                    n, in_spec, out_spec, seed=seed, vocab_size=vocab_size, low_id=low_id, long_threshold=long_threshold
                )
            else:
                prefix_len = get_field(cfg, "prefix_len")
                if prefix_len is None:
                    raise ValueError("prefix_len is required for kind='shared_prefix'")
                prefix_len = max(1, round(as_int(prefix_len, "prefix_len", minimum=1) * scale))
                reqs = shared_prefix_workload(
                    n,
                    num_prefixes=get_field(cfg, "num_prefixes", 4),
                    prefix_len=prefix_len,
                    suffix_len=in_spec,
                    output_len=out_spec,
                    seed=seed,
                    vocab_size=vocab_size,
                    low_id=low_id,
                    tenant_per_prefix=bool(get_field(cfg, "tenant_per_prefix", False)),
                    long_threshold=long_threshold,
                )
    else:
        if kind == "jsonl":
            reqs = load_jsonl(
                path,
                tokenize=tokenize,
                vocab_size=vocab_size,
                low_id=low_id,
                seed=seed,
                require_arrival=arrival == "trace",
                long_threshold=long_threshold,
            )
        elif kind in _PRODUCTION:
            common = dict(num_requests=n, seed=seed, scale=scale, vocab_size=vocab_size, low_id=low_id,
                          long_threshold=long_threshold)  # fmt: skip
            if kind == "azure_llm":
                reqs = load_azure_llm_trace(path, **common)
            else:
                reqs = load_burstgpt(
                    path, models=filters["trace_models"], log_types=filters["trace_log_types"], **common
                )
        elif kind == "sharegpt":
            reqs = load_sharegpt(
                path, tokenize=tokenize, vocab_size=vocab_size, low_id=low_id, seed=seed, long_threshold=long_threshold
            )
        else:
            reqs = load_peers_json(path, vocab_size=vocab_size, long_threshold=long_threshold)
        if n is not None:
            if n > len(reqs):
                raise ValueError(f"num_requests={n} but {os.fspath(path)} holds only {len(reqs)} usable requests")
            reqs = reqs[:n]
        n = len(reqs)

    if arrival == "trace" and kind in _TIMED_FILES:
        # Replay the file's own clock, shifted so that the first arrival is at 0.
        offset = min((r.arrival_time for r in reqs), default=0.0)
        times = [r.arrival_time - offset for r in reqs]
    elif arrival == "trace":
        times = arrival_times(n, "trace", trace=load_arrival_times(path)).tolist()
    else:
        times = arrival_times(
            n,
            arrival,
            rng=rng_for(seed, Stream.ARRIVAL),
            request_rate=get_field(cfg, "request_rate"),
            burstiness=get_field(cfg, "burstiness", 1.0),
            diurnal_period_s=diurnal[0],
            diurnal_amplitude=diurnal[1],
        ).tolist()
    if trace_rate is not None:
        times = at_mean_rate(times, trace_rate).tolist()
    if session_starts is not None:  # the times above start sessions; a later turn is offset from its session's start
        times = [times[i] + r.arrival_time for i, r in zip(session_starts, reqs)]
    # A deadline read from a file keeps its slack (deadline - arrival) when the arrival time moves.
    reqs = [
        dataclasses.replace(
            r, arrival_time=float(t), deadline=None if r.deadline is None else r.deadline - r.arrival_time + float(t)
        )
        for r, t in zip(reqs, times)
    ]
    if max_model_len is not None:
        reqs = [clip_to_max_model_len(r, max_model_len) for r in reqs]
    if deadline_s is not None:
        reqs = [
            r if r.deadline is not None else dataclasses.replace(r, deadline=r.arrival_time + deadline_s) for r in reqs
        ]
    tenant_priority = get_field(cfg, "tenant_priority")
    if tenant_priority is not None:
        tenant_priority = {str(t): as_int(p, f"tenant_priority[{t!r}]") for t, p in dict(tenant_priority).items()}
        reqs = [
            dataclasses.replace(r, priority=tenant_priority[r.tenant]) if r.tenant in tenant_priority else r
            for r in reqs
        ]
    reqs.sort(key=lambda r: r.arrival_time)  # stable: ties keep their generation / file order
    return reqs


def _names(value: Any, name: str) -> tuple[str, ...] | None:
    """A filter's values: None, a comma-separated string or a sequence of strings."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(v).strip() for v in items if str(v).strip())
    if not names:
        raise ValueError(f"{name} is empty: give at least one value, or None to keep every row")
    return names


def _required_spec(cfg: Any, name: str, kind: str) -> LengthSpec:
    spec = get_field(cfg, name)
    if spec is None:
        raise ValueError(f"{name} is required for kind={kind!r}")
    return LengthSpec.from_config(spec, name)
