"""Workload generators: independent random lengths, the chat/RAG/code long-short mix, shared system prompts,
multi-turn sessions. Every request (every session) starts at 0 here; `make_workload` sets the arrival times."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from cbjax.bench.fields import as_choice, as_float, as_int, check_fields, get_field
from cbjax.bench.lengths import LengthSpec
from cbjax.bench.requests import (
    DEFAULT_LONG_THRESHOLD,
    DEFAULT_LOW_ID,
    DEFAULT_VOCAB_SIZE,
    Stream,
    WorkloadRequest,
    check_vocab,
    length_class_of,
    random_token_ids,
    rng_for,
)


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
    vocab_size, low_id = check_vocab(vocab_size, low_id)
    p = prompt_len.sample(rng_for(seed, Stream.PROMPT), num_requests)
    o = output_len.sample(rng_for(seed, Stream.OUTPUT), num_requests)
    tok = rng_for(seed, Stream.TOKENS)
    return [
        WorkloadRequest(
            f"req-{i}",
            0.0,
            random_token_ids(tok, p[i], vocab_size, low_id),
            int(o[i]),
            length_class=length_class_of(int(p[i]), int(o[i]), long_threshold),
        )
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
    MixComponent(
        "chat", 0.60, _ln(256, 0.6, 16, 1024, "chat.prompt_len"), _ln(128, 0.6, 8, 512, "chat.output_len"), "short"
    ),
    MixComponent(
        "rag", 0.25, _ln(2048, 0.35, 768, 4096, "rag.prompt_len"), _ln(128, 0.5, 16, 512, "rag.output_len"), "long"
    ),
    MixComponent(
        "code", 0.15, _ln(512, 0.5, 64, 2048, "code.prompt_len"), _ln(1024, 0.4, 256, 2048, "code.output_len"), "long"
    ),
)


def _exact_counts(n: int, fractions: Sequence[float]) -> list[int]:
    """Split n by fractions with the largest-remainder rule, so a small workload still has the right mix."""
    total = float(sum(fractions))
    raw = [n * f / total for f in fractions]
    counts = [math.floor(r) for r in raw]
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
    scale = as_float(scale, "scale", positive=True)
    vocab_size, low_id = check_vocab(vocab_size, low_id)
    counts = _exact_counts(num_requests, [c.fraction for c in components])
    which = np.repeat(np.arange(len(components)), counts)
    rng_for(seed, Stream.MIX).shuffle(which)
    p_rng, o_rng, tok = rng_for(seed, Stream.PROMPT), rng_for(seed, Stream.OUTPUT), rng_for(seed, Stream.TOKENS)
    plens = np.empty(num_requests, dtype=np.int64)
    olens = np.empty(num_requests, dtype=np.int64)
    for k, comp in enumerate(components):
        idx = np.flatnonzero(which == k)
        plens[idx] = comp.prompt_len.scaled(scale).sample(p_rng, len(idx))
        olens[idx] = comp.output_len.scaled(scale).sample(o_rng, len(idx))
    out = []
    for i in range(num_requests):
        comp = components[which[i]]
        out.append(
            WorkloadRequest(
                f"req-{i}",
                0.0,
                random_token_ids(tok, plens[i], vocab_size, low_id),
                int(olens[i]),
                tenant=comp.name,
                length_class=comp.length_class,
            )
        )
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
    num_prefixes = as_int(num_prefixes, "num_prefixes", minimum=1)
    prefix_len = as_int(prefix_len, "prefix_len", minimum=1)
    vocab_size, low_id = check_vocab(vocab_size, low_id)
    pre_rng = rng_for(seed, Stream.PREFIX)
    prefixes = [random_token_ids(pre_rng, prefix_len, vocab_size, low_id) for _ in range(num_prefixes)]
    group = rng_for(seed, Stream.MIX).integers(0, num_prefixes, size=num_requests)
    slens = suffix_len.sample(rng_for(seed, Stream.PROMPT), num_requests)
    olens = output_len.sample(rng_for(seed, Stream.OUTPUT), num_requests)
    tok = rng_for(seed, Stream.TOKENS)
    out = []
    for i in range(num_requests):
        g = int(group[i])
        ids = prefixes[g] + random_token_ids(tok, slens[i], vocab_size, low_id)
        tenant = f"prefix-{g}" if tenant_per_prefix else "default"
        out.append(
            WorkloadRequest(
                f"req-{i}",
                0.0,
                ids,
                int(olens[i]),
                tenant=tenant,
                length_class=length_class_of(len(ids), int(olens[i]), long_threshold),
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class ThinkTime:
    """Seconds a user pauses between reading an answer and sending the next message.

    dist="fixed":       every pause is `value` (>= 0).
    dist="exponential": mean `mean` (> 0): memoryless pauses, most short, a few long.
    dist="lognormal":   mean `mean` (> 0) and `sigma` (>= 0) of the log: the heavier tail measured in chat logs.
    """

    dist: str = "fixed"
    value: float | None = None
    mean: float | None = None
    sigma: float | None = None
    field: str = dataclasses.field(default="think_time_s", compare=False)  # name used in error messages

    _FIELDS = ("dist", "value", "mean", "sigma")

    def __post_init__(self) -> None:
        f = self.field
        as_choice(self.dist, f"{f}.dist", ("fixed", "exponential", "lognormal"))
        if self.dist == "fixed":
            if self.value is None or as_float(self.value, f"{f}.value") < 0:
                raise ValueError(f"{f}.value must be a number of seconds >= 0 for dist='fixed', got {self.value!r}")
            return
        if self.mean is None:
            raise ValueError(f"{f}.mean is required for dist={self.dist!r}")
        as_float(self.mean, f"{f}.mean", positive=True)
        if self.dist == "lognormal" and (self.sigma is None or as_float(self.sigma, f"{f}.sigma") < 0):
            raise ValueError(f"{f}.sigma must be a number >= 0 for dist='lognormal', got {self.sigma!r}")

    @classmethod
    def from_config(cls, spec, field: str = "think_time_s") -> ThinkTime:
        """A bare number (fixed seconds) or a mapping with the fields above."""
        if isinstance(spec, ThinkTime):
            return dataclasses.replace(spec, field=field)
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            return cls(dist="fixed", value=spec, field=field)
        if spec is None or isinstance(spec, (str, bytes)):
            raise ValueError(f"{field} must be a number of seconds or a mapping with 'dist', ..., got {spec!r}")
        check_fields(spec, cls._FIELDS, field)
        kwargs = {k: get_field(spec, k) for k in cls._FIELDS}
        kwargs["dist"] = get_field(spec, "dist", "fixed")
        return cls(field=field, **kwargs)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.dist == "fixed":
            return np.full(n, float(self.value))
        if self.dist == "exponential":
            return rng.exponential(float(self.mean), size=n)
        sigma = float(self.sigma)
        return rng.lognormal(math.log(self.mean) - sigma**2 / 2, sigma, size=n)


def session_workload(
    num_sessions: int,
    *,
    prompt_len: LengthSpec,
    message_len: LengthSpec,
    output_len: LengthSpec,
    num_turns: LengthSpec,
    think_time: ThinkTime,
    one_shot_fraction: float = 0.0,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    low_id: int = DEFAULT_LOW_ID,
    max_model_len: int | None = None,
    long_threshold: int = DEFAULT_LONG_THRESHOLD,
) -> list[list[WorkloadRequest]]:
    """Multi-turn conversations, one list of turns per arrival (cbjax/bench/sessions.py runs them closed-loop).

    A share `one_shot_fraction` of the arrivals (exact, seeded order) are one-shot requests ("one-<i>", tenant
    "one_shot"): a prompt of `prompt_len`, no session. The others are sessions ("s<i>-t<k>", tenant "session") of
    `num_turns` turns: turn 0's prompt is `prompt_len` random ids; turn k > 0 carries only its new message
    (`message_len` ids) and a think time; every answer is `output_len` tokens. Greedy with EOS ignored, answers are
    exactly that long, so every turn's full prompt length is known here: a session ends before the first turn whose
    prompt + answer would exceed `max_model_len` (length_class is judged on that full prompt). Turn 0 starts at 0
    and turn k's `arrival_time` is the sum of the think times before it (its earliest possible arrival).
    """
    one_shot_fraction = as_float(one_shot_fraction, "one_shot_fraction")
    if not 0.0 <= one_shot_fraction <= 1.0:
        raise ValueError(f"one_shot_fraction must be in [0, 1], got {one_shot_fraction}")
    vocab_size, low_id = check_vocab(vocab_size, low_id)
    n_one = _exact_counts(num_sessions, [one_shot_fraction, 1.0 - one_shot_fraction])[0]
    one_shot = np.zeros(num_sessions, dtype=bool)
    one_shot[:n_one] = True
    rng_for(seed, Stream.MIX).shuffle(one_shot)
    first = prompt_len.sample(rng_for(seed, Stream.PROMPT), num_sessions)
    turns = num_turns.sample(rng_for(seed, Stream.TURNS), num_sessions)
    out_rng, msg_rng = rng_for(seed, Stream.OUTPUT), rng_for(seed, Stream.MESSAGE)
    think_rng = rng_for(seed, Stream.THINK)
    tok = rng_for(seed, Stream.TOKENS)
    arrivals = []
    for i in range(num_sessions):
        k_max = 1 if one_shot[i] else int(turns[i])
        # Lengths and think times are drawn for every turn, kept or not, so max_model_len cuts sessions short
        # without changing the lengths of the others.
        outs = output_len.sample(out_rng, k_max)
        msgs = message_len.sample(msg_rng, k_max)
        thinks = think_time.sample(think_rng, k_max)
        context, start, group = 0, 0.0, []
        for k in range(k_max):
            new = int(first[i]) if k == 0 else int(msgs[k])
            prompt = context + new
            if k > 0 and max_model_len is not None and prompt + int(outs[k]) > max_model_len:
                break
            start += 0.0 if k == 0 else float(thinks[k])
            ids = random_token_ids(tok, new, vocab_size, low_id)
            cls = length_class_of(prompt, int(outs[k]), long_threshold)
            if one_shot[i]:
                group.append(WorkloadRequest(f"one-{i}", 0.0, ids, int(outs[k]), tenant="one_shot", length_class=cls))
            else:
                group.append(
                    WorkloadRequest(
                        f"s{i}-t{k}", start, ids, int(outs[k]), tenant="session", length_class=cls,
                        session_id=f"s{i}", turn=k, think_time_s=0.0 if k == 0 else float(thinks[k]),
                    )
                )  # fmt: skip
            context = prompt + int(outs[k])
        arrivals.append(group)
    return arrivals
