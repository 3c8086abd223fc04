"""Serving metrics with the definitions of `vllm bench serve`, plus per-step engine metrics.

Pure Python + numpy (no jax). Times are seconds on the engine's clock (real or virtual); every latency in the
summary is reported in milliseconds.

Per request (only *completed* requests: finished with reason "stop" or "length"):
  TTFT   = first_token_time - arrival_time                       (includes queueing, as in vLLM)
  TPOT   = (E2E - TTFT) / (output_len - 1)                         (requests with output_len <= 1 are left out)
  ITL    = every gap between consecutive token times, pooled over all requests
  E2E    = finished_time - arrival_time
  queue  = first_scheduled_time - arrival_time
Aborted and unfinished requests are counted (num_aborted, num_unfinished) but are in no latency statistic and no
throughput: as in vLLM, a failed request contributes no tokens.

Throughput over `duration` = last finished_time - first arrival_time (any request, aborted ones included), unless
given: request_throughput = completed / duration; output_throughput = completed requests' output tokens / duration;
total_token_throughput = their prompt + output tokens / duration.
Goodput = completed requests meeting every given SLO, per second. SLOs are {"ttft_ms", "tpot_ms", "e2e_ms"}, each
<= bound to pass; a missing or None bound is not checked. As in vLLM, a one-token request passes the TPOT SLO
(its TPOT counts as 0). slo_attainment = good requests / all requests.

Statistics of each latency: `<name>_ms_{mean,p50,p90,p99,std}` (np.percentile with linear interpolation, std with
ddof=0 like vLLM); repeated with a "short_" / "long_" prefix for each length class. Empty samples give NaN.

The TTFT tail, where a policy starves some requests: ttft_ms_max, and ttft_worst5_share = the share of the summed
TTFT of all completed requests that the worst 5% of them (by TTFT, ceil(5% of n)) carry: 0.05 when every request
waits alike, near 1 when a few wait for everyone. Multi-turn sessions: {first,later}_turn_ttft_ms_{mean,p50,p99}
split TTFT between first turns (and one-shot requests: nothing of theirs is cached) and later turns (whose prompt
holds the conversation so far).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from cbjax.bench.requests import LENGTH_CLASSES

__all__ = [
    "SLO_KEYS",
    "RequestRecord",
    "StepRecord",
    "percentiles",
    "request_latencies",
    "step_summary",
    "summarize",
    "worst_share",
]

FINISH_REASONS = ("stop", "length", "abort", None)
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")
LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue")
NAN = float("nan")


@dataclasses.dataclass
class RequestRecord:
    """What happened to one request. `token_times[i]` is when output token i became available on the host;
    it holds `output_len` times, or is empty when the engine did not record per-token times (then ITL has no
    samples from this request). `first_token_time` defaults to `token_times[0]` when left None."""

    request_id: str
    prompt_len: int
    output_len: int
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    finished_time: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None (still running)
    length_class: str = "short"
    tenant: str = "default"
    num_preemptions: int = 0
    turn: int = 0  # a multi-turn session's turn (0: its first, or a one-shot request)

    def __post_init__(self) -> None:
        where = f"RequestRecord {self.request_id!r}"
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"{where}: finish_reason must be one of {list(FINISH_REASONS)}, got {self.finish_reason!r}"
            )
        if self.length_class not in LENGTH_CLASSES:
            raise ValueError(f"{where}: length_class must be one of {list(LENGTH_CLASSES)}, got {self.length_class!r}")
        if self.prompt_len < 0 or self.output_len < 0:
            raise ValueError(f"{where}: prompt_len and output_len must be >= 0")
        if self.token_times and len(self.token_times) != self.output_len:
            raise ValueError(f"{where}: {len(self.token_times)} token_times for output_len={self.output_len}")
        if self.finish_reason in ("stop", "length") and self.finished_time is None:
            raise ValueError(f"{where}: finish_reason={self.finish_reason!r} needs a finished_time")
        if self.first_token_time is None and self.token_times:
            self.first_token_time = self.token_times[0]

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("stop", "length")

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


@dataclasses.dataclass
class StepRecord:
    """One engine step. `num_preemptions` is the preemptions *in this step*; `compiles` is the runner's running
    count of compilations so far (a counter, so the summary takes its last value)."""

    time: float  # when its results reached the host
    num_running: int = 0
    num_waiting: int = 0
    num_scheduled_seqs: int = 0
    max_num_seqs: int = 0
    num_scheduled_tokens: int = 0
    padded_tokens: int = 0  # the token bucket the step was padded to
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    num_preemptions: int = 0
    host_s: float = 0.0
    device_s: float = 0.0
    compiles: int = 0
    # Preemption cost in this step: KV pages moved by swap (bytes and the copies' wall time), and tokens whose KV a
    # recompute preemption dropped (they are computed again when the request resumes).
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_s: float = 0.0
    recomputed_tokens: int = 0
    # Prefix cache in this step: context tokens looked up at admission, and those found cached.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    # Of those, found in the prefix cache's host tier (recompute avoided by a copy), and that tier's copies in pages:
    # device->host of evicted cached pages, host->device of host hits (their bytes are in swap_out / swap_in_bytes).
    prefix_host_hit_tokens: int = 0
    host_cache_out_pages: int = 0
    host_cache_in_pages: int = 0
    replica: int = 0  # data-parallel engines: which replica took the step
    # Disaggregated serving (cbjax/disaggregated.py): the KV transfers into this decode engine that its step is the
    # first to use (the requests it adopted since its previous step), their pages, bytes and copy seconds.
    kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0
    scheduled_time: float = 0.0  # when the step was scheduled (and dispatched); `time`: when its results arrived

    @classmethod
    def from_engine(cls, record: dict, t0: float) -> StepRecord:
        """An engine's step record (a dict of these fields) with its times taken from `t0` (the run's start)."""
        if t0 == 0.0 and "scheduled_time" in record:  # (a run from time 0: t - 0.0 is t, so no copy to make)
            return cls(**record)
        return cls(**{**record, "time": record["time"] - t0, "scheduled_time": record.get("scheduled_time", t0) - t0})

    # > 1: a block of this many decode steps in one dispatch (cbjax/core/multi_step.py); the other fields describe
    # its first step, and the summary counts it as that many steps of that shape.
    decode_steps: int = 1
    # Rows the block computed for nothing: slots idle past their last step, or past a stop inside the block.
    block_wasted_tokens: int = 0
    # Speculative decoding in this step: draft tokens verified and accepted, the sequences that verified drafts,
    # and both counts by draft position (index 0: the first draft of a sequence).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verified_seqs: int = 0
    spec_drafted_by_position: list = dataclasses.field(default_factory=list)
    spec_accepted_by_position: list = dataclasses.field(default_factory=list)


def percentiles(values: Iterable[float], ps: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """{"mean", "p50", "p90", "p99", "std"} of `values` (other percentiles via `ps`); all NaN when empty."""
    x = np.asarray(list(values), dtype=np.float64)
    keys = ["mean", *(f"p{p:g}" for p in ps), "std"]
    if x.size == 0:
        return {k: NAN for k in keys}
    out = {"mean": float(x.mean())}
    for p, v in zip(ps, np.percentile(x, list(ps))):  # linear interpolation, numpy's default
        out[f"p{p:g}"] = float(v)
    out["std"] = float(x.std())
    return out


def _ttft(r: RequestRecord) -> float | None:
    return None if r.first_token_time is None else r.first_token_time - r.arrival_time


def _tpot(r: RequestRecord) -> float | None:
    ttft = _ttft(r)
    if ttft is None or r.output_len <= 1:
        return None
    return (r.finished_time - r.arrival_time - ttft) / (r.output_len - 1)


def request_latencies(requests: Iterable[RequestRecord]) -> dict[str, list[float]]:
    """Latency samples in seconds, {"ttft", "tpot", "itl", "e2e", "queue"}, from completed requests only."""
    out: dict[str, list[float]] = {k: [] for k in LATENCIES}
    for r in requests:
        if not r.completed:
            continue
        if (ttft := _ttft(r)) is not None:
            out["ttft"].append(ttft)
        if (tpot := _tpot(r)) is not None:
            out["tpot"].append(tpot)
        out["itl"].extend(np.diff(np.asarray(r.token_times, dtype=np.float64)).tolist())
        out["e2e"].append(r.finished_time - r.arrival_time)
        if r.first_scheduled_time is not None:
            out["queue"].append(r.first_scheduled_time - r.arrival_time)
    return out


def _latency_stats(requests: Sequence[RequestRecord], prefix: str) -> dict[str, float]:
    out = {}
    for name, samples in request_latencies(requests).items():
        for stat, v in percentiles(np.asarray(samples) * 1e3).items():
            out[f"{prefix}{name}_ms_{stat}"] = v
    return out


def worst_share(values: Sequence[float], fraction: float = 0.05) -> float:
    """The share of sum(values) carried by the largest ceil(fraction * n) values; NaN when empty or all zero."""
    x = np.sort(np.asarray(values, dtype=np.float64))[::-1]
    total = float(x.sum())
    if x.size == 0 or total <= 0:
        return NAN
    return float(x[: math.ceil(fraction * x.size)].sum()) / total


def _ttft_tail(done: Sequence[RequestRecord]) -> dict[str, float]:
    ttft = [t for r in done if (t := _ttft(r)) is not None]
    out = {"ttft_ms_max": max(ttft) * 1e3 if ttft else NAN, "ttft_worst5_share": worst_share(ttft)}
    for name, group in (("first_turn", [r for r in done if r.turn == 0]), ("later_turn", [r for r in done if r.turn])):
        stats = percentiles([t * 1e3 for r in group if (t := _ttft(r)) is not None], (50, 99))
        out.update({f"{name}_ttft_ms_{k}": stats[k] for k in ("mean", "p50", "p99")})
    return out


def _rate(count: float, duration: float) -> float:
    if count == 0:
        return 0.0
    return count / duration if math.isfinite(duration) and duration > 0 else NAN


def _check_slo(slo: Mapping[str, Any] | None) -> dict[str, float]:
    if slo is None:
        return {}
    unknown = sorted(set(slo) - set(SLO_KEYS))
    if unknown:
        raise ValueError(f"slo: unknown key(s) {unknown}; allowed keys are {list(SLO_KEYS)}")
    out = {}
    for k, v in slo.items():
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"slo[{k!r}] must be a positive number of milliseconds or None, got {v!r}")
        out[k] = float(v) / 1e3
    return out


def _is_good(r: RequestRecord, slo_s: Mapping[str, float]) -> bool:
    if not r.completed:
        return False
    if "ttft_ms" in slo_s:
        ttft = _ttft(r)
        if ttft is None or ttft > slo_s["ttft_ms"]:
            return False
    if "tpot_ms" in slo_s:
        tpot = _tpot(r)
        if tpot is not None and tpot > slo_s["tpot_ms"]:  # one-token requests pass, as vLLM's TPOT of 0
            return False
    return not ("e2e_ms" in slo_s and r.finished_time - r.arrival_time > slo_s["e2e_ms"])


def step_summary(steps: Sequence[StepRecord]) -> dict[str, float]:
    """Per-step engine metrics (a block of N decode steps counts as N steps of its first step's shape):
      num_steps (model steps), num_dispatches (records); running_mean, waiting_mean (sequences);
      slot_occupancy_mean = mean of
      num_scheduled_seqs / max_num_seqs; kv_util_mean / kv_util_max of kv_pages_used / kv_pages_total;
      scheduled_tokens_mean; padding_waste = 1 - sum(num_scheduled_tokens) / sum(padded_tokens);
      step_preemptions (sum); host_s, device_s (sums) and host_fraction / device_fraction of host_s + device_s;
      compiles (the counter's last value) and compiles_after_first_step (last - first: recompiles during the run);
      swap_out_bytes, swap_in_bytes, swap_s, recomputed_tokens, prefix_queried_tokens, prefix_hit_tokens,
      prefix_host_hit_tokens, host_cache_out_pages, host_cache_in_pages, block_wasted_tokens (sums)
      and prefix_cache_hit_rate = prefix_hit_tokens / prefix_queried_tokens (NaN when nothing was looked up);
      speculative decoding (vLLM's definitions): spec_draft_tokens, spec_accepted_tokens (sums),
      spec_acceptance_rate = accepted / drafted, spec_mean_acceptance_length = 1 + accepted / verifying sequence-steps
      (tokens a sequence gains per verifying step), spec_acceptance_pos1..4 (accepted / drafted at the first four
      draft positions; all of them: `acceptance_by_position`), spec_drafts_per_step (mean drafted tokens per
      step); NaN without drafts.
    Steps with max_num_seqs == 0 or kv_pages_total == 0 are left out of the corresponding ratio."""
    n = len(steps)

    def mean(xs, keep=lambda s: True):
        weights = [s.decode_steps for s in steps if keep(s)]
        return float(np.average(xs, weights=weights)) if len(xs) else NAN

    has_slots, has_pages = (lambda s: s.max_num_seqs > 0), (lambda s: s.kv_pages_total > 0)
    occupancy = [s.num_scheduled_seqs / s.max_num_seqs for s in steps if has_slots(s)]
    kv = [s.kv_pages_used / s.kv_pages_total for s in steps if has_pages(s)]
    padded = sum(s.padded_tokens * s.decode_steps for s in steps)
    scheduled = sum(s.num_scheduled_tokens * s.decode_steps for s in steps)
    host = float(sum(s.host_s for s in steps))
    device = float(sum(s.device_s for s in steps))
    busy = host + device
    return {
        "num_steps": int(sum(s.decode_steps for s in steps)),
        "num_dispatches": n,
        "running_mean": mean([s.num_running for s in steps]),
        "waiting_mean": mean([s.num_waiting for s in steps]),
        "slot_occupancy_mean": mean(occupancy, has_slots),
        "kv_util_mean": mean(kv, has_pages),
        "kv_util_max": float(max(kv)) if kv else NAN,
        "scheduled_tokens_mean": mean([s.num_scheduled_tokens for s in steps]),
        "padding_waste": 1.0 - scheduled / padded if padded > 0 else NAN,
        "step_preemptions": int(sum(s.num_preemptions for s in steps)),
        "host_s": host,
        "device_s": device,
        "host_fraction": host / busy if busy > 0 else NAN,
        "device_fraction": device / busy if busy > 0 else NAN,
        "compiles": int(steps[-1].compiles) if n else 0,
        "compiles_after_first_step": int(steps[-1].compiles - steps[0].compiles) if n else 0,
        **{k: int(sum(getattr(s, k) for s in steps)) for k in _STEP_COUNTS},
        "swap_s": float(sum(s.swap_s for s in steps)),
        "prefix_cache_hit_rate": (
            sum(s.prefix_hit_tokens for s in steps) / queried
            if (queried := sum(s.prefix_queried_tokens for s in steps))
            else NAN
        ),
        **_speculation_summary(steps),
    }


def acceptance_by_position(steps: Sequence[StepRecord]) -> list[float]:
    """Speculative decoding: accepted / drafted at each draft position (index 0: a sequence's first draft)."""
    K = max((len(s.spec_drafted_by_position) for s in steps), default=0)
    drafted, accepted = np.zeros(K), np.zeros(K)
    for s in steps:
        drafted[: len(s.spec_drafted_by_position)] += s.spec_drafted_by_position
        accepted[: len(s.spec_accepted_by_position)] += s.spec_accepted_by_position
    return [float(a / d) if d else NAN for a, d in zip(accepted, drafted)]


# The summary's acceptance by position is flat (scalars only): its first positions, each a column.
SUMMARY_POSITIONS = 4


def _speculation_summary(steps: Sequence[StepRecord]) -> dict:
    drafted = sum(s.spec_draft_tokens for s in steps)
    accepted = sum(s.spec_accepted_tokens for s in steps)
    verified = sum(s.spec_verified_seqs for s in steps)
    by_position = acceptance_by_position(steps)
    by_position += [NAN] * (SUMMARY_POSITIONS - len(by_position))
    return {
        "spec_draft_tokens": int(drafted),
        "spec_accepted_tokens": int(accepted),
        "spec_acceptance_rate": accepted / drafted if drafted else NAN,
        "spec_mean_acceptance_length": 1.0 + accepted / verified if verified else NAN,
        **{f"spec_acceptance_pos{i + 1}": by_position[i] for i in range(SUMMARY_POSITIONS)},
        "spec_drafts_per_step": drafted / len(steps) if steps else NAN,
    }


_STEP_COUNTS = (
    "swap_out_bytes",
    "swap_in_bytes",
    "recomputed_tokens",
    "prefix_queried_tokens",
    "prefix_hit_tokens",
    "prefix_host_hit_tokens",
    "host_cache_out_pages",
    "host_cache_in_pages",
    "block_wasted_tokens",
)


def summarize(
    requests: Sequence[RequestRecord],
    steps: Sequence[StepRecord] = (),
    slo: Mapping[str, float | None] | None = None,
    duration: float | None = None,
) -> dict[str, float | int]:
    """A flat, JSON-serialisable dict of every metric (definitions in the module docstring and `step_summary`).

    Counts: num_requests, num_completed, num_aborted, num_unfinished, num_good, total_input_tokens,
    total_output_tokens, num_preempted_requests, request_preemptions; per class: {short,long}_num_requests and
    {short,long}_completion_rate (completed / requests of the class; NaN without any).
    Rates: duration_s, request_throughput, output_throughput, total_token_throughput, goodput, slo_attainment.
    Latencies: {,short_,long_}{ttft,tpot,itl,e2e,queue}_ms_{mean,p50,p90,p99,std}; the TTFT tail: ttft_ms_max,
    ttft_worst5_share, {first,later}_turn_ttft_ms_{mean,p50,p99}.
    """
    requests = list(requests)
    slo_s = _check_slo(slo)
    if duration is not None:
        if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not duration > 0:
            raise ValueError(f"duration must be a positive number of seconds, got {duration!r}")
        duration = float(duration)
    else:
        finished = [r.finished_time for r in requests if r.finished_time is not None]
        duration = max(finished) - min(r.arrival_time for r in requests) if finished else NAN

    done = [r for r in requests if r.completed]
    num_good = sum(_is_good(r, slo_s) for r in requests)
    in_tokens = sum(r.prompt_len for r in done)
    out_tokens = sum(r.output_len for r in done)
    out: dict[str, float | int] = {
        "num_requests": len(requests),
        "num_completed": len(done),
        "num_aborted": sum(r.aborted for r in requests),
        "num_unfinished": sum(r.finish_reason is None for r in requests),
        "num_good": num_good,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "num_preempted_requests": sum(r.num_preemptions > 0 for r in requests),
        "request_preemptions": sum(r.num_preemptions for r in requests),
        "duration_s": duration,
        "request_throughput": _rate(len(done), duration),
        "output_throughput": _rate(out_tokens, duration),
        "total_token_throughput": _rate(in_tokens + out_tokens, duration),
        "goodput": _rate(num_good, duration),
        "slo_attainment": num_good / len(requests) if requests else NAN,
    }
    out.update(_latency_stats(done, ""))
    out.update(_ttft_tail(done))
    for cls in LENGTH_CLASSES:
        group = [r for r in requests if r.length_class == cls]
        out[f"{cls}_num_requests"] = len(group)
        out[f"{cls}_completion_rate"] = sum(r.completed for r in group) / len(group) if group else NAN
        out.update(_latency_stats([r for r in group if r.completed], f"{cls}_"))
    out.update(step_summary(list(steps)))
    return out
