"""Workload generators: independent random lengths, the chat/RAG/code long-short mix, shared system prompts.
Every request arrives at 0 here; `make_workload` sets the arrival times."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from cbjax.bench.fields import as_float, as_int
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
