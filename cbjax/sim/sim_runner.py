"""SimRunner: the runner contract (cbjax/core/runner_contract.py: dispatch / fetch / execute, swaps,
warmup, num_compiles) with a cost model in place of a model. No jax: the engine, its Scheduler and every policy
run unchanged on top of it.

Time: the runner owns the virtual clock's advance. `fetch` moves the clock by the step's cost (swap copies
included) before it returns, so the scheduler stamps the step's tokens with the end of the step, exactly where
cbjax.bench.online's `after_execute` hook moves the clock for the real engine on a virtual clock. Asynchronous
scheduling works as on the real engine (step n+1 is scheduled before step n's tokens are received, at the time
step n started); the simulated steps still run one after another, each advancing the clock by its own cost.

Tokens: a sampling sequence gets a token id that is never an end of sequence (a fixed function of the request id
and the token's index, so runs are deterministic and prefix-cache hashes of generated tokens do not collide
across requests); requests listed in `stop_after` get the EOS id as their n-th token. The workload's lengths
(max_tokens, or `stop_after`) decide when a request ends; greedy exactness is not the point.
"""

import dataclasses
import zlib
from collections.abc import Mapping

from cbjax.core.clock import VirtualClock
from cbjax.core.runner_contract import check_warmup_mode
from cbjax.core.scheduler_output import SchedulerOutput
from cbjax.sim.cost_model import CostModel
from cbjax.sim.features import StepFeatures, step_features


@dataclasses.dataclass
class SimStepHandle:
    """A dispatched simulated step (the fields the engine reads of cbjax.runner's StepHandle, plus the cost)."""

    out: SchedulerOutput
    tokens: list[int]  # a plain list: the scheduler reads them one by one (numpy scalars would cost more)
    features: StepFeatures
    cost_s: float  # simulated seconds: what the clock advances by at fetch
    padded_tokens: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_s: float = 0.0  # real seconds spent copying: none (the simulated copy time is in cost_s)
    wait_s: float = 0.0  # real seconds waited for the device: none


class SimRunner:
    """Runs SchedulerOutputs on a cost model. `buckets` is the engine's BucketTable (any object with
    `token_bucket(n)`); `kv_bytes_per_page` sizes the swap copies; `vocab_size`, `eos_token_id` and
    `stop_token_ids` choose the token ids it emits."""

    advances_clock = True  # cbjax.bench.online leaves the clock to the runner

    def __init__(
        self,
        cost_model: CostModel,
        clock: VirtualClock,
        *,
        buckets,
        kv_bytes_per_page: int,
        vocab_size: int,
        eos_token_id: int | None,
        stop_token_ids: tuple[int, ...] = (),
        stop_after: Mapping[str, int] | None = None,
    ):
        if not isinstance(clock, VirtualClock):
            raise ValueError(f"the simulator needs a VirtualClock, got {type(clock).__name__}")
        self.cost_model = cost_model
        self.clock = clock
        self.buckets = buckets
        self.kv_bytes_per_page = int(kv_bytes_per_page)
        self.eos_token_id = eos_token_id
        self.stop_after = dict(stop_after or {})
        self.num_compiles = 0
        self.num_steps = 0
        self.simulated_s = 0.0  # sum of the step costs
        self.swap_out_bytes_total = 0
        self.swap_in_bytes_total = 0
        self.num_copied_pages = 0  # copy-on-write (core/sequence_group.py): priced in the step (copy_bytes)
        # Host pages whose swap-in another resource has paid for: the disaggregated simulator's KV transfers land
        # there and their link time is priced in the transfer (cbjax/sim/disaggregated.py), so not again here.
        self.prepaid_host_pages: set[int] = set()
        self.last_step: SimStepHandle | None = None
        forbidden = {t for t in (eos_token_id, *stop_token_ids) if t is not None}
        self._ids = [t for t in range(min(vocab_size, 4096)) if t not in forbidden and t >= 3] or [0]
        self._base = _Bases()

    def warmup(self, mode: str = "full") -> float:
        """Nothing to build: 0 seconds."""
        check_warmup_mode(mode)
        return 0.0

    def wait_until_warm(self) -> None:
        """Nothing is ever being built."""
        return None

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> tuple[float, int, int]:
        """No copy happens; returns (0 real seconds, bytes out, bytes in). Their simulated time is in the step's
        cost (StepFeatures.swap_bytes)."""
        out_bytes, in_bytes = len(swap_out) * self.kv_bytes_per_page, len(swap_in) * self.kv_bytes_per_page
        self.swap_out_bytes_total += out_bytes
        self.swap_in_bytes_total += in_bytes
        return 0.0, out_bytes, in_bytes

    def _token(self, request_id: str, index: int) -> int:
        n = self.stop_after.get(request_id)
        if n is not None and index + 1 >= n and self.eos_token_id is not None:
            return self.eos_token_id
        return self._ids[(self._base[request_id] + 7919 * index) % len(self._ids)]

    def _block_tokens(self, out: SchedulerOutput) -> list[list[int]]:
        """A block of decode steps (cbjax/core/multi_step.py): a row of tokens per step; a sequence's k pending
        placeholders, just appended, are its outputs in steps 0..k-1 (0 past them)."""
        rows = [[0] * len(out.seqs) for _ in range(out.num_steps)]
        for j, s in enumerate(out.seqs):
            req = s.request
            first = len(req.output_token_ids) - s.num_steps
            for i in range(s.num_steps):
                rows[i][j] = self._token(req.request_id, first + i)
        return rows

    def _tokens(self, out: SchedulerOutput) -> list[int]:
        """`_token` of each sequence's sampled output (0 where it samples none), the index of a sampled output being
        its pending placeholder's, just appended. This runs once per generated token, so without `stop_after` it is
        `_token`'s formula inline, in one comprehension."""
        if out.num_steps > 1:
            return self._block_tokens(out)
        if self.stop_after:
            token = self._token
            return [
                token(s.request.request_id, len(s.request.output_token_ids) - 1) if s.samples_token else 0
                for s in out.seqs
            ]
        ids, bases, n = self._ids, self._base, len(self._ids)
        return [
            ids[(bases[(r := s.request).request_id] + 7919 * (len(r.output_token_ids) - 1)) % n]
            if s.samples_token
            else 0
            for s in out.seqs
        ]

    def dispatch(self, out: SchedulerOutput) -> SimStepHandle:
        """Price the step and choose its tokens (the index of a sampled token is known at scheduling time: the
        pending placeholder the scheduler just appended)."""
        padded = self.buckets.token_bucket(out.num_batched_tokens) if out.seqs else 0
        _, out_bytes, in_bytes = self.swap(out.swap_out, out.swap_in)
        features = step_features(out, padded, self.kv_bytes_per_page)
        if self.prepaid_host_pages:
            features = self._without_prepaid(out, features)
        self.num_copied_pages += len(out.page_copies)
        tokens = self._tokens(out)
        # A block of N decode steps costs N times its first step (its contexts grow by at most N - 1 tokens).
        cost = self.cost_model.step_time(features) * out.num_steps
        handle = SimStepHandle(out, tokens, features, cost, padded, out_bytes, in_bytes)
        self.last_step = handle
        return handle

    def _without_prepaid(self, out: SchedulerOutput, features: StepFeatures) -> StepFeatures:
        """The features less the swap-ins of prepaid host pages (each paid once); a swap-out that reuses a prepaid
        page's id makes it an ordinary page again."""
        prepaid = self.prepaid_host_pages
        paid = [h for h, _ in out.swap_in if h in prepaid]
        prepaid.difference_update(paid)
        prepaid.difference_update(h for _, h in out.swap_out)
        if not paid:
            return features
        return dataclasses.replace(features, swap_bytes=features.swap_bytes - len(paid) * self.kv_bytes_per_page)

    def fetch(self, handle: SimStepHandle) -> list[int]:
        """The step ends: the clock moves by its cost; returns its tokens in out.seqs order."""
        self.clock.advance(handle.cost_s)
        self.simulated_s += handle.cost_s
        self.num_steps += 1
        return handle.tokens

    def execute(self, out: SchedulerOutput) -> list[int]:
        """dispatch + fetch: one step, synchronously."""
        return self.fetch(self.dispatch(out))


class _Bases(dict):
    """request id -> the crc32 its token ids start from, computed the first time a request id is read."""

    def __missing__(self, request_id: str) -> int:
        base = self[request_id] = zlib.crc32(request_id.encode())
        return base
