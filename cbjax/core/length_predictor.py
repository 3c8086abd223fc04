"""Output-length predictors: what the length-aware policies (cbjax/core/length_aware.py) believe a request will
generate, since no scheduler knows it.

  oracle   the request's `max_tokens`. Exact in the experiment workloads, whose requests ignore EOS; in real serving
           it is only an upper bound.
  noisy    the oracle times a multiplicative log-normal error exp(sigma * z), z ~ N(0, 1) drawn from a hash of
           (seed, request id): deterministic, and the same for a request on the real engine and on the simulator.
           sigma 0 is the oracle; 0.5 is off by more than x1.65 for a third of the requests.
  learned  fitted online from the requests that finished: per (tenant, prompt-length bucket), a quantile of the
           last `window` output lengths seen; with too few samples there, the tenant's; then every tenant's; before
           any data, `prior_tokens`. It never reads max_tokens (in the workloads that would be the answer).

A policy asks once per request, when it arrives (`predict`), and keeps the answer, so a waiting request's sort key
stays fixed; the scheduler tells the policy of every finished request (Policy.on_finish), which passes it on
(`observe`). Predictions are whole tokens >= 1.
"""

import hashlib
import math
from collections import deque
from statistics import NormalDist

from cbjax.config import validation as check
from cbjax.core.request import FinishReason, Request

_STANDARD_NORMAL = NormalDist()


class LengthPredictor:
    """The interface: `predict` a request's output tokens when it arrives; `observe` it when it has finished."""

    name = ""

    def predict(self, req: Request) -> int:
        raise NotImplementedError

    def observe(self, req: Request) -> None:
        """A request finished (stopped, reached its length, or was aborted): what it generated is known."""


class OraclePredictor(LengthPredictor):
    """The request's max_tokens."""

    name = "oracle"

    def predict(self, req: Request) -> int:
        return req.params.max_tokens


class NoisyPredictor(LengthPredictor):
    """max_tokens x exp(sigma * z), z a standard normal fixed by (seed, request id)."""

    name = "noisy"

    def __init__(self, sigma: float, seed: int = 0):
        self.sigma = check.real("length predictor sigma", sigma, 0.0)
        self.seed = check.integer("length predictor seed", seed)

    def error(self, request_id: str) -> float:
        """z of this request: a uniform in (0, 1) from a hash (never Python's hash(), which changes per process)
        through the normal's inverse CDF."""
        digest = hashlib.blake2b(f"{self.seed}/{request_id}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "little") + 0.5) / 2.0**64
        return _STANDARD_NORMAL.inv_cdf(u)

    def predict(self, req: Request) -> int:
        return max(1, round(req.params.max_tokens * math.exp(self.sigma * self.error(req.request_id))))


class LearnedPredictor(LengthPredictor):
    """A quantile of the output lengths of finished requests like this one (see the module docstring)."""

    name = "learned"

    def __init__(self, prior_tokens: int = 128, quantile: float = 0.5, window: int = 256, min_samples: int = 8):
        self.prior_tokens = check.integer("learned predictor prior_tokens", prior_tokens, 1)
        self.quantile = check.real("learned predictor quantile", quantile, 0.0, 1.0)
        self.window = check.integer("learned predictor window", window, 1)
        self.min_samples = check.integer("learned predictor min_samples", min_samples, 1, self.window)
        # (tenant, bucket), (tenant,) and () -> the last `window` output lengths seen there
        self.samples: dict[tuple, deque[int]] = {}

    @staticmethod
    def bucket(num_prompt_tokens: int) -> int:
        """Prompt lengths in powers of two: [2^(b-1), 2^b) is bucket b."""
        return num_prompt_tokens.bit_length()

    def _levels(self, req: Request) -> tuple[tuple, ...]:
        return ((req.tenant, self.bucket(req.num_prompt_tokens)), (req.tenant,), ())

    def predict(self, req: Request) -> int:
        for level in self._levels(req):
            seen = self.samples.get(level)
            if seen is not None and len(seen) >= self.min_samples:
                ordered = sorted(seen)
                return max(1, ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))])
        return self.prior_tokens

    def observe(self, req: Request) -> None:
        if req.finish_reason is FinishReason.ABORT:
            return  # cut short by the client: says nothing of the request's length
        n = len(req.output_token_ids)
        for level in self._levels(req):
            self.samples.setdefault(level, deque(maxlen=self.window)).append(n)


PREDICTORS = ("oracle", "noisy", "learned")


def make_length_predictor(
    kind: str, *, sigma: float | None = None, seed: int = 0, prior_tokens: int | None = None
) -> LengthPredictor:
    """A predictor by name (PREDICTORS). `sigma` is noisy's (required there), `prior_tokens` learned's (default
    128); either given to another predictor is an error, as is a seed for a predictor without randomness."""
    kind = check.choice("length_predictor", kind, PREDICTORS)
    if sigma is not None and kind != "noisy":
        raise ValueError(f"sigma is an option of the noisy length predictor, not of {kind!r}")
    if prior_tokens is not None and kind != "learned":
        raise ValueError(f"prior_tokens is an option of the learned length predictor, not of {kind!r}")
    if seed != 0 and kind != "noisy":
        raise ValueError(f"predictor_seed is an option of the noisy length predictor, not of {kind!r}")
    if kind == "noisy":
        if sigma is None:
            raise ValueError("the noisy length predictor needs sigma (the log-normal error's standard deviation)")
        return NoisyPredictor(sigma, seed)
    if kind == "learned":
        return LearnedPredictor() if prior_tokens is None else LearnedPredictor(prior_tokens)
    return OraclePredictor()
