"""Deterministic request workloads: synthetic generators, presets and trace loaders.

Everything here is pure Python + numpy (no jax), so experiments and tests can build a workload cheaply.

A workload is a list of `WorkloadRequest`, sorted by `arrival_time` (seconds from the start of the run).
`make_workload(cfg)` is the one entry point an experiment needs; the pieces it is built from
(`LengthSpec`, `arrival_times`, `mixed_workload`, `shared_prefix_workload`) are public so tests and notebooks can
use them directly; the file loaders and writers (JSONL traces, ShareGPT, the peers' JSON) are in
`cbjax.workload_files`.

Determinism: every random choice comes from a numpy `Generator` derived from `(seed, stream)`, with one
independent stream per concern (arrivals, prompt lengths, output lengths, token ids, ...). So changing the
arrival process or `request_rate` leaves the requests themselves (lengths and token ids) unchanged: a
request-rate sweep compares policies on the *same* requests, only arriving at different times.

Config fields read by `make_workload` (a dict, an ml_collections ConfigDict or any object with attributes;
a field that is missing or None takes its default; an unknown field is an error, to catch typos):

  kind            "synthetic" | "mixed" | "shared_prefix" | "jsonl" | "sharegpt" | "peers_json"   (required)
  num_requests    int >= 1; required for generated kinds; for files, None means every request in the file
  seed            int >= 0, default 0
  arrival         "offline" (all at t=0) | "poisson" | "gamma" | "trace"; default "trace" for jsonl, else
                  "offline". "trace" takes arrival times from `path` (for generated kinds `path` is a JSONL
                  file of times: each line a number or an object with `arrival_time`/`timestamp`)
  request_rate    requests/s for poisson and gamma (inf means offline)
  burstiness      gamma shape, default 1.0 (== poisson); < 1 is burstier, > 1 more regular
  vocab_size      token ids are drawn from [low_id, vocab_size); default 32000. For files, ids must be below it
  low_id          smallest generated token id, default 3 (0..2 are pad/bos/eos in the project's models)
  prompt_len      length spec (see `LengthSpec`; a bare int means fixed); synthetic: the prompt,
                  shared_prefix: the unique suffix after the shared prefix
  output_len      length spec for max_tokens
  scale           multiplies every generated length (default 1.0), to shrink a workload onto a CPU
  num_prefixes    shared_prefix: number of distinct system prompts (default 4)
  prefix_len      shared_prefix: tokens in each system prompt (required for shared_prefix)
  tenant_per_prefix  shared_prefix: tenant = "prefix-<k>" (default False: every request is tenant "default")
  path            file to load (jsonl / sharegpt / peers_json) or the arrival trace (arrival="trace")
  max_model_len   clip so prompt_len + max_tokens <= max_model_len (see `clip_to_max_model_len`)
  long_threshold  requests without a preset class (mixed preset, or length_class in a JSONL line) are "long"
                  when prompt_len + max_tokens > long_threshold (default 1024), judged before clipping
  deadline_s      if set, requests without a deadline get deadline = arrival_time + deadline_s
  tenant_priority mapping tenant -> priority (lower is more important); requests of a listed tenant get it
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "WorkloadRequest",
    "LengthSpec",
    "MixComponent",
    "MIXED_PRESET",
    "KINDS",
    "ARRIVALS",
    "make_workload",
    "arrival_times",
    "random_token_ids",
    "length_class_of",
    "synthetic_workload",
    "mixed_workload",
    "shared_prefix_workload",
    "clip_to_max_model_len",
]

KINDS = ("synthetic", "mixed", "shared_prefix", "jsonl", "sharegpt", "peers_json")
ARRIVALS = ("offline", "poisson", "gamma", "trace")
LENGTH_CLASSES = ("short", "long")
DEFAULT_VOCAB_SIZE = 32000
DEFAULT_LOW_ID = 3
DEFAULT_LONG_THRESHOLD = 1024
CHARS_PER_TOKEN = 4  # approx_num_tokens: the usual ~4 characters per BPE token for English text

Tokenize = Callable[[str], Sequence[int]]

# One independent random stream per concern, so e.g. a new request_rate does not reshuffle the lengths.
_S_ARRIVAL, _S_PROMPT, _S_OUTPUT, _S_TOKENS, _S_MIX, _S_PREFIX = range(6)


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, stream]))


# ----------------------------------------------------------------------------------------------------------
# The request
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload, before it reaches the engine.

    `prompt_token_ids` is what the engine runs. `prompt` keeps the text when the source held text and no ids;
    the ids are then `tokenize(prompt)` if a tokenizer was given to the loader, else placeholder ids of the
    estimated length (`approx_num_tokens`), which is what a random-init model needs.
    `deadline` is absolute, in seconds from the start of the run, like `arrival_time`.
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    tenant: str = "default"
    priority: int = 0
    deadline: float | None = None
    length_class: str = "short"  # "short" or "long"
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


# ----------------------------------------------------------------------------------------------------------
# Config access: a dict, a ConfigDict or a plain object, by attribute or by item
# ----------------------------------------------------------------------------------------------------------


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    """Field `name` of `cfg` (mapping or object); a missing field or a None value gives `default`."""
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        value = cfg.get(name, None)
    else:
        try:
            value = getattr(cfg, name)
        except AttributeError:
            value = None
            if hasattr(cfg, "__getitem__"):
                try:
                    value = cfg[name]
                except (KeyError, IndexError, TypeError):
                    value = None
    return default if value is None else value


def _keys(cfg: Any) -> list[str] | None:
    if isinstance(cfg, Mapping) or callable(getattr(cfg, "keys", None)):
        return [str(k) for k in cfg.keys()]
    if hasattr(cfg, "__dict__"):
        return [k for k in vars(cfg) if not k.startswith("_")]
    return None


def _check_fields(cfg: Any, allowed: Iterable[str], where: str) -> None:
    keys = _keys(cfg)
    if keys is None:
        return
    allowed = tuple(allowed)
    unknown = sorted(set(keys) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed fields are {sorted(allowed)}")


def _as_int(value: Any, field: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    if not isinstance(value, numbers.Integral):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{field} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value}")
    return value


def _as_float(value: Any, field: str, *, positive: bool = False, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{field} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{field} must be finite, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{field} must be > 0, got {value!r}")
    return value


def _as_choice(value: Any, field: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{field} must be one of {list(choices)}, got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------------------
# Lengths
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LengthSpec:
    """A distribution of token counts.

    dist="fixed":     every length is `value`.
    dist="uniform":   integers uniform in [low, high], both inclusive.
    dist="lognormal": exp(N(mu, sigma)) rounded to the nearest integer, then clipped to [min, max];
                      mu = ln(median), or mu = ln(mean) - sigma**2 / 2 when `mean` is given instead
                      (the mean of the unclipped distribution). `min` defaults to 1, `max` to no limit.
    Every length is at least 1.
    """

    dist: str = "fixed"
    value: int | None = None
    low: int | None = None
    high: int | None = None
    median: float | None = None
    mean: float | None = None
    sigma: float | None = None
    min: int | None = None
    max: int | None = None
    field: str = dataclasses.field(default="length", compare=False)  # name used in error messages

    _FIELDS = ("dist", "value", "low", "high", "median", "mean", "sigma", "min", "max")

    def __post_init__(self) -> None:
        f = self.field
        _as_choice(self.dist, f"{f}.dist", ("fixed", "uniform", "lognormal"))
        if self.dist == "fixed":
            if self.value is None:
                raise ValueError(f"{f}.value is required for dist='fixed'")
            _as_int(self.value, f"{f}.value", minimum=1)
        elif self.dist == "uniform":
            for name in ("low", "high"):
                if getattr(self, name) is None:
                    raise ValueError(f"{f}.{name} is required for dist='uniform'")
            low = _as_int(self.low, f"{f}.low", minimum=1)
            high = _as_int(self.high, f"{f}.high", minimum=1)
            if high < low:
                raise ValueError(f"{f}.high must be >= {f}.low, got low={low}, high={high}")
        else:
            if (self.median is None) == (self.mean is None):
                raise ValueError(f"{f}: dist='lognormal' needs exactly one of {f}.median and {f}.mean")
            center = "median" if self.median is not None else "mean"
            _as_float(getattr(self, center), f"{f}.{center}", positive=True)
            if self.sigma is None:
                raise ValueError(f"{f}.sigma is required for dist='lognormal'")
            if _as_float(self.sigma, f"{f}.sigma") < 0:
                raise ValueError(f"{f}.sigma must be >= 0, got {self.sigma!r}")
            lo = _as_int(self.min, f"{f}.min", minimum=1) if self.min is not None else 1
            if self.max is not None and _as_int(self.max, f"{f}.max", minimum=1) < lo:
                raise ValueError(f"{f}.max must be >= {f}.min, got min={lo}, max={self.max}")

    @classmethod
    def from_config(cls, spec: Any, field: str) -> LengthSpec:
        """A spec from a mapping/object with the fields above, or a bare int (== fixed)."""
        if isinstance(spec, LengthSpec):
            return dataclasses.replace(spec, field=field)
        if isinstance(spec, numbers.Real) and not isinstance(spec, bool):
            return cls(dist="fixed", value=_as_int(spec, field, minimum=1), field=field)
        if spec is None or isinstance(spec, (str, bytes)):
            raise ValueError(f"{field} must be a length spec (a mapping with 'dist', ...) or an int, got {spec!r}")
        _check_fields(spec, cls._FIELDS, field)
        kwargs = {name: _get(spec, name) for name in cls._FIELDS}
        kwargs["dist"] = _get(spec, "dist", "fixed")
        return cls(field=field, **kwargs)

    def scaled(self, scale: float) -> LengthSpec:
        """Every length parameter multiplied by `scale` (rounded, at least 1); sigma is unchanged."""
        if scale == 1.0:
            return self

        def s(x):
            return None if x is None else max(1, int(round(x * scale)))

        def sf(x):
            return None if x is None else x * scale

        return dataclasses.replace(
            self, value=s(self.value), low=s(self.low), high=s(self.high), median=sf(self.median),
            mean=sf(self.mean), min=s(self.min), max=s(self.max),
        )

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths as an int64 array."""
        if self.dist == "fixed":
            return np.full(n, int(self.value), dtype=np.int64)
        if self.dist == "uniform":
            return rng.integers(int(self.low), int(self.high) + 1, size=n, dtype=np.int64)
        sigma = float(self.sigma)
        mu = math.log(self.median) if self.median is not None else math.log(self.mean) - sigma**2 / 2
        x = np.rint(rng.lognormal(mu, sigma, size=n))
        lo = int(self.min) if self.min is not None else 1
        hi = int(self.max) if self.max is not None else np.iinfo(np.int64).max
        return np.clip(x, lo, hi).astype(np.int64)


# ----------------------------------------------------------------------------------------------------------
# Arrivals
# ----------------------------------------------------------------------------------------------------------


def arrival_times(
    n: int,
    process: str = "offline",
    *,
    rng: np.random.Generator | None = None,
    request_rate: float | None = None,
    burstiness: float = 1.0,
    trace: Sequence[float] | None = None,
) -> np.ndarray:
    """`n` non-decreasing arrival times in seconds, the first at 0 (except for a trace, see below).

    offline: all at 0.
    poisson: exponential gaps with mean 1/request_rate.
    gamma:   gamma gaps with shape = burstiness and scale = 1/(request_rate * burstiness), as `vllm bench serve`:
             the mean gap stays 1/request_rate and the coefficient of variation is 1/sqrt(burstiness).
             burstiness=1 is exactly the poisson process (same draws, same times).
    trace:   the first `n` times of `trace`, shifted so the earliest is 0 and sorted.
    A request_rate of inf means offline, as in vLLM.
    """
    n = _as_int(n, "num_requests", minimum=0)
    process = _as_choice(process, "arrival", ARRIVALS)
    if process == "trace":
        if trace is None:
            raise ValueError("arrival='trace' needs a trace of arrival times")
        if len(trace) < n:
            raise ValueError(f"arrival trace has {len(trace)} times, fewer than num_requests={n}")
        t = np.asarray(trace[:n], dtype=np.float64)
        if not np.all(np.isfinite(t)):
            raise ValueError("arrival trace holds a non-finite time")
        return np.sort(t - t.min()) if n else t
    if process == "offline":
        return np.zeros(n)
    if request_rate is None:
        raise ValueError(f"request_rate is required for arrival={process!r}")
    rate = _as_float(request_rate, "request_rate", positive=True, allow_inf=True)
    shape = 1.0 if process == "poisson" else _as_float(burstiness, "burstiness", positive=True)
    if math.isinf(rate):
        return np.zeros(n)
    if rng is None:
        raise ValueError("a numpy Generator (rng) is required for random arrivals")
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


# ----------------------------------------------------------------------------------------------------------
# Generators
# ----------------------------------------------------------------------------------------------------------


def length_class_of(prompt_len: int, max_tokens: int, long_threshold: int = DEFAULT_LONG_THRESHOLD) -> str:
    """"long" when prompt_len + max_tokens > long_threshold, else "short" (for requests without a preset class)."""
    return "long" if prompt_len + max_tokens > long_threshold else "short"


def random_token_ids(rng: np.random.Generator, length: int, vocab_size: int, low_id: int = DEFAULT_LOW_ID) -> tuple[int, ...]:
    """`length` ids uniform in [low_id, vocab_size), as a tuple of Python ints."""
    return tuple(rng.integers(low_id, vocab_size, size=int(length)).tolist())


def _check_vocab(vocab_size: Any, low_id: Any) -> tuple[int, int]:
    vocab_size = _as_int(vocab_size, "vocab_size", minimum=1)
    low_id = _as_int(low_id, "low_id", minimum=0)
    if low_id >= vocab_size:
        raise ValueError(f"low_id must be < vocab_size, got low_id={low_id}, vocab_size={vocab_size}")
    return vocab_size, low_id


def synthetic_workload(
    num_requests: int,
    prompt_len: LengthSpec,
    output_len: LengthSpec,
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    low_id: int = DEFAULT_LOW_ID,
    long_threshold: int = DEFAULT_LONG_THRESHOLD,
) -> list[WorkloadRequest]:
    """Independent prompt and output lengths, random prompt ids; length_class by `length_class_of`.
    All arrive at 0 (`make_workload` sets the arrival times, see `arrival_times`)."""
    vocab_size, low_id = _check_vocab(vocab_size, low_id)
    p = prompt_len.sample(_rng(seed, _S_PROMPT), num_requests)
    o = output_len.sample(_rng(seed, _S_OUTPUT), num_requests)
    tok = _rng(seed, _S_TOKENS)
    return [
        WorkloadRequest(f"req-{i}", 0.0, random_token_ids(tok, p[i], vocab_size, low_id), int(o[i]),
                        length_class=length_class_of(int(p[i]), int(o[i]), long_threshold))
        for i in range(num_requests)
    ]


@dataclasses.dataclass(frozen=True)
class MixComponent:
    name: str
    fraction: float
    prompt_len: LengthSpec
    output_len: LengthSpec
    length_class: str


def _ln(median: float, sigma: float, lo: int, hi: int, field: str) -> LengthSpec:
    return LengthSpec("lognormal", median=median, sigma=sigma, min=lo, max=hi, field=field)


# The long/short stress mix (lengths at scale=1.0; all lognormal, median given, clipped to [min, max]):
#   chat  60%  prompt median  256 (sigma 0.6, 16..1024)    output median  128 (sigma 0.6,   8..512)   short
#   rag   25%  prompt median 2048 (sigma 0.35, 768..4096)  output median  128 (sigma 0.5,  16..512)   long
#   code  15%  prompt median  512 (sigma 0.5, 64..2048)    output median 1024 (sigma 0.4, 256..2048)  long
# RAG stresses prefill (long prompts that block or get chunked); code stresses decode slots and KV pages
# (long outputs that hold memory for a long time); chat is the latency-sensitive majority caught behind both.
MIXED_PRESET: tuple[MixComponent, ...] = (
    MixComponent("chat", 0.60, _ln(256, 0.6, 16, 1024, "chat.prompt_len"), _ln(128, 0.6, 8, 512, "chat.output_len"), "short"),
    MixComponent("rag", 0.25, _ln(2048, 0.35, 768, 4096, "rag.prompt_len"), _ln(128, 0.5, 16, 512, "rag.output_len"), "long"),
    MixComponent("code", 0.15, _ln(512, 0.5, 64, 2048, "code.prompt_len"), _ln(1024, 0.4, 256, 2048, "code.output_len"), "long"),
)


def _exact_counts(n: int, fractions: Sequence[float]) -> list[int]:
    """Split n by fractions with the largest-remainder rule, so a small workload still has the right mix."""
    total = float(sum(fractions))
    raw = [n * f / total for f in fractions]
    counts = [int(math.floor(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def mixed_workload(
    num_requests: int,
    *,
    seed: int = 0,
    scale: float = 1.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    low_id: int = DEFAULT_LOW_ID,
    components: Sequence[MixComponent] = MIXED_PRESET,
) -> list[WorkloadRequest]:
    """The chat/RAG/code mix (`MIXED_PRESET`), every length multiplied by `scale`.

    The number of requests of each component is exact (largest remainder of n * fraction); their order is a
    seeded shuffle. `tenant` is the component name ("chat", "rag", "code").
    """
    scale = _as_float(scale, "scale", positive=True)
    vocab_size, low_id = _check_vocab(vocab_size, low_id)
    counts = _exact_counts(num_requests, [c.fraction for c in components])
    which = np.repeat(np.arange(len(components)), counts)
    _rng(seed, _S_MIX).shuffle(which)
    p_rng, o_rng, tok = _rng(seed, _S_PROMPT), _rng(seed, _S_OUTPUT), _rng(seed, _S_TOKENS)
    plens = np.empty(num_requests, dtype=np.int64)
    olens = np.empty(num_requests, dtype=np.int64)
    for k, comp in enumerate(components):
        idx = np.flatnonzero(which == k)
        plens[idx] = comp.prompt_len.scaled(scale).sample(p_rng, len(idx))
        olens[idx] = comp.output_len.scaled(scale).sample(o_rng, len(idx))
    out = []
    for i in range(num_requests):
        comp = components[which[i]]
        out.append(WorkloadRequest(
            f"req-{i}", 0.0, random_token_ids(tok, plens[i], vocab_size, low_id), int(olens[i]),
            tenant=comp.name, length_class=comp.length_class,
        ))
    return out


def shared_prefix_workload(
    num_requests: int,
    *,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: LengthSpec,
    output_len: LengthSpec,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    low_id: int = DEFAULT_LOW_ID,
    tenant_per_prefix: bool = False,
    long_threshold: int = DEFAULT_LONG_THRESHOLD,
) -> list[WorkloadRequest]:
    """`num_prefixes` random system prompts of `prefix_len` tokens; each request picks one uniformly at random
    and appends its own random suffix (`suffix_len`). With `tenant_per_prefix`, tenant = "prefix-<k>".
    length_class by `length_class_of` on the whole prompt."""
    num_prefixes = _as_int(num_prefixes, "num_prefixes", minimum=1)
    prefix_len = _as_int(prefix_len, "prefix_len", minimum=1)
    vocab_size, low_id = _check_vocab(vocab_size, low_id)
    pre_rng = _rng(seed, _S_PREFIX)
    prefixes = [random_token_ids(pre_rng, prefix_len, vocab_size, low_id) for _ in range(num_prefixes)]
    group = _rng(seed, _S_MIX).integers(0, num_prefixes, size=num_requests)
    slens = suffix_len.sample(_rng(seed, _S_PROMPT), num_requests)
    olens = output_len.sample(_rng(seed, _S_OUTPUT), num_requests)
    tok = _rng(seed, _S_TOKENS)
    out = []
    for i in range(num_requests):
        g = int(group[i])
        ids = prefixes[g] + random_token_ids(tok, slens[i], vocab_size, low_id)
        tenant = f"prefix-{g}" if tenant_per_prefix else "default"
        out.append(WorkloadRequest(f"req-{i}", 0.0, ids, int(olens[i]), tenant=tenant,
                                   length_class=length_class_of(len(ids), int(olens[i]), long_threshold)))
    return out


# ----------------------------------------------------------------------------------------------------------
# Post-processing shared by every kind
# ----------------------------------------------------------------------------------------------------------


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
    return dataclasses.replace(req, prompt_token_ids=req.prompt_token_ids[: max_model_len - 1], max_tokens=1, prompt=None)


# ----------------------------------------------------------------------------------------------------------
# The entry point
# ----------------------------------------------------------------------------------------------------------

_CONFIG_FIELDS = (
    "kind", "num_requests", "seed", "arrival", "request_rate", "burstiness", "vocab_size", "low_id",
    "prompt_len", "output_len", "scale", "num_prefixes", "prefix_len", "tenant_per_prefix", "path",
    "max_model_len", "long_threshold", "deadline_s", "tenant_priority",
)
_GENERATED = ("synthetic", "mixed", "shared_prefix")


def make_workload(cfg: Any, *, tokenize: Tokenize | None = None) -> list[WorkloadRequest]:
    """Build the workload described by `cfg` (fields in the module docstring), sorted by arrival time.

    Order of operations: requests (generated or loaded, first `num_requests`, length_class decided) ->
    arrival times -> `clip_to_max_model_len` -> deadlines -> tenant priorities. `tokenize` is only used for text in
    trace files.
    """
    _check_fields(cfg, _CONFIG_FIELDS, "workload config")
    kind = _get(cfg, "kind")
    if kind is None:
        raise ValueError(f"kind is required, one of {list(KINDS)}")
    kind = _as_choice(kind, "kind", KINDS)
    seed = _as_int(_get(cfg, "seed", 0), "seed", minimum=0)
    n = _get(cfg, "num_requests")
    n = None if n is None else _as_int(n, "num_requests", minimum=1)
    arrival = _as_choice(_get(cfg, "arrival", "trace" if kind == "jsonl" else "offline"), "arrival", ARRIVALS)
    vocab_size, low_id = _check_vocab(_get(cfg, "vocab_size", DEFAULT_VOCAB_SIZE), _get(cfg, "low_id", DEFAULT_LOW_ID))
    scale = _as_float(_get(cfg, "scale", 1.0), "scale", positive=True)
    path = _get(cfg, "path")
    max_model_len = _get(cfg, "max_model_len")
    if max_model_len is not None:
        max_model_len = _as_int(max_model_len, "max_model_len", minimum=2)
    long_threshold = _as_int(_get(cfg, "long_threshold", DEFAULT_LONG_THRESHOLD), "long_threshold", minimum=0)
    deadline_s = _get(cfg, "deadline_s")
    if deadline_s is not None:
        deadline_s = _as_float(deadline_s, "deadline_s", positive=True)
    # Validate the arrival parameters up front, so a bad rate fails before any file is read.
    if arrival in ("poisson", "gamma"):
        if _get(cfg, "request_rate") is None:
            raise ValueError(f"request_rate is required for arrival={arrival!r}")
        _as_float(_get(cfg, "request_rate"), "request_rate", positive=True, allow_inf=True)
        _as_float(_get(cfg, "burstiness", 1.0), "burstiness", positive=True)
    if arrival == "trace" and kind in ("sharegpt", "peers_json"):
        raise ValueError(f"arrival='trace' is not available for kind={kind!r}: its file holds no arrival times")
    if (kind not in _GENERATED or arrival == "trace") and path is None:
        raise ValueError(f"path is required for kind={kind!r}" + (" with arrival='trace'" if kind in _GENERATED else ""))
    if kind not in _GENERATED and scale != 1.0:
        raise ValueError(f"scale applies to generated workloads only, not kind={kind!r}")

    # The loaders build on this module's request type and helpers, so they are imported here, not at the top.
    from cbjax.workload_files import load_arrival_times, load_jsonl, load_peers_json, load_sharegpt

    if kind in _GENERATED:
        if n is None:
            raise ValueError(f"num_requests is required for kind={kind!r}")
        if kind == "mixed":
            reqs = mixed_workload(n, seed=seed, scale=scale, vocab_size=vocab_size, low_id=low_id)
        else:
            out_spec = _required_spec(cfg, "output_len", kind).scaled(scale)
            in_spec = _required_spec(cfg, "prompt_len", kind).scaled(scale)
            if kind == "synthetic":
                reqs = synthetic_workload(n, in_spec, out_spec, seed=seed, vocab_size=vocab_size, low_id=low_id,
                                          long_threshold=long_threshold)
            else:
                prefix_len = _get(cfg, "prefix_len")
                if prefix_len is None:
                    raise ValueError("prefix_len is required for kind='shared_prefix'")
                prefix_len = max(1, int(round(_as_int(prefix_len, "prefix_len", minimum=1) * scale)))
                reqs = shared_prefix_workload(
                    n, num_prefixes=_get(cfg, "num_prefixes", 4), prefix_len=prefix_len, suffix_len=in_spec,
                    output_len=out_spec, seed=seed, vocab_size=vocab_size, low_id=low_id,
                    tenant_per_prefix=bool(_get(cfg, "tenant_per_prefix", False)), long_threshold=long_threshold,
                )
    else:
        if kind == "jsonl":
            reqs = load_jsonl(path, tokenize=tokenize, vocab_size=vocab_size, low_id=low_id, seed=seed,
                              require_arrival=arrival == "trace", long_threshold=long_threshold)
        elif kind == "sharegpt":
            reqs = load_sharegpt(path, tokenize=tokenize, vocab_size=vocab_size, low_id=low_id, seed=seed,
                                 long_threshold=long_threshold)
        else:
            reqs = load_peers_json(path, vocab_size=vocab_size, long_threshold=long_threshold)
        if n is not None:
            if n > len(reqs):
                raise ValueError(f"num_requests={n} but {os.fspath(path)} holds only {len(reqs)} usable requests")
            reqs = reqs[:n]
        n = len(reqs)

    if arrival == "trace" and kind == "jsonl":
        # Replay the file's own clock, shifted so that the first arrival is at 0.
        offset = min((r.arrival_time for r in reqs), default=0.0)
        times = [r.arrival_time - offset for r in reqs]
    elif arrival == "trace":
        times = arrival_times(n, "trace", trace=load_arrival_times(path)).tolist()
    else:
        times = arrival_times(n, arrival, rng=_rng(seed, _S_ARRIVAL), request_rate=_get(cfg, "request_rate"),
                              burstiness=_get(cfg, "burstiness", 1.0)).tolist()
    # A deadline read from a file keeps its slack (deadline - arrival) when the arrival time moves.
    reqs = [
        dataclasses.replace(r, arrival_time=float(t),
                            deadline=None if r.deadline is None else r.deadline - r.arrival_time + float(t))
        for r, t in zip(reqs, times)
    ]
    if max_model_len is not None:
        reqs = [clip_to_max_model_len(r, max_model_len) for r in reqs]
    if deadline_s is not None:
        reqs = [r if r.deadline is not None else dataclasses.replace(r, deadline=r.arrival_time + deadline_s)
                for r in reqs]
    tenant_priority = _get(cfg, "tenant_priority")
    if tenant_priority is not None:
        tenant_priority = {str(t): _as_int(p, f"tenant_priority[{t!r}]") for t, p in dict(tenant_priority).items()}
        reqs = [dataclasses.replace(r, priority=tenant_priority[r.tenant]) if r.tenant in tenant_priority else r
                for r in reqs]
    reqs.sort(key=lambda r: r.arrival_time)  # stable: ties keep their generation / file order
    return reqs


def _required_spec(cfg: Any, name: str, kind: str) -> LengthSpec:
    spec = _get(cfg, name)
    if spec is None:
        raise ValueError(f"{name} is required for kind={kind!r}")
    return LengthSpec.from_config(spec, name)
