"""The draft model's half of a ModelRunner (speculative_config method "draft"): its parameters, its paged KV cache
and keeping that cache up to date.

The draft's KV pages have the target's geometry (`num_pages + 1` pages of `page_size` tokens, the last one the
spare that takes padding writes) and are addressed through the target's page tables: no page pool of its own,
and pages freed, shared by the prefix cache or recycled are the target's decisions.

Its prefill rides along lazily: before a verifying step, each speculating sequence's draft KV is brought up to its
computed tokens by a ragged prefill of the draft over the tokens it lacks (`draft_prefill`, one program per token
bucket, compiled at warmup). A sequence that speculates every step lacks nothing (the step's proposal loop writes
the draft K/V of every position the target computes, draft_proposals.py); one that starts speculating catches up
on its whole context once; one that never speculates (k = 0 from an adaptive rule) costs the draft nothing, so a
step without drafts runs exactly the program it runs without speculation. The host tracks, per request, how many
leading tokens have draft K/V; a preempted request (recompute or swap: its pages change) starts again from 0.
"""

import functools

import jax
from flax import nnx

from cbjax.core.request import RequestStatus
from cbjax.core.scheduler_output import ScheduledSeq, SchedulerOutput
from cbjax.model.config import ModelConfig
from cbjax.model.llama import AttentionMetadata, Llama
from cbjax.runner.compilation.counter import CompileCounter
from cbjax.runner.compilation.program_family import ProgramFamily
from cbjax.runner.kv_cache import allocate_kv_cache, num_device_pages
from cbjax.runner.placement import PlacedParams, Placement, place_params
from cbjax.runner.step_input import BucketTable, empty_step_input, pack_step


@functools.partial(jax.jit, static_argnames=("graphdef", "backend", "interpret"), donate_argnames=("kv_caches",))
def _draft_prefill(params, kv_caches, inp, *, graphdef, backend: str, interpret: bool):
    """The draft's forward over a ragged batch of context tokens, for their K/V only (no logits)."""
    module_def, treedef = graphdef.value
    model = nnx.merge(module_def, jax.tree.unflatten(treedef, params))
    md = AttentionMetadata(inp.slot_mapping, inp.kv_lens, inp.page_indices, inp.cu_q_lens, inp.num_seqs)
    _, kv_caches = model(inp.token_ids, inp.positions, kv_caches, md, backend, interpret)
    return kv_caches


class DraftRunner:
    """The draft's parameters and KV pages (placed as the target's) and its catch-up prefill programs, which count
    their compiles on the target runner's `compiles`. Built by `build_draft_runner`."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        weights: PlacedParams,
        kv_caches: list,
        placement: Placement,
        buckets: BucketTable,
        backend: str,
        interpret: bool,
        cpu_impls,
        compiles: CompileCounter,
    ):
        self.cfg = cfg
        self.params, self.graphdef = weights
        self.kv_caches = kv_caches
        self.buckets, self.pad_page = buckets, num_device_pages(kv_caches)
        self.backend, self.interpret, self.device, self._cpu_impls = backend, interpret, placement.device, cpu_impls
        self.avals = placement.abstract((self.params, self.kv_caches))
        # Per request: its leading tokens whose draft K/V are in place (bounded by its computed tokens when read).
        self.computed: dict = {}
        self.prefill_programs = ProgramFamily(buckets.token_buckets, self._build_prefill, self._prefill_key, compiles)
        self.num_prefill_tokens = 0  # tokens the catch-up prefills computed (the draft's prefill cost)

    def key(self) -> tuple:
        """What identifies the draft in a program key."""
        return (self.graphdef, tuple((a.shape, a.dtype) for a in jax.tree.leaves(self.avals)))

    def _prefill_key(self, T: int) -> tuple:
        b = self.buckets
        device = None if self.device is None else self.device.id
        return ("draft-prefill", self.key(), self.backend, self._cpu_impls, self.interpret, device, T, b.slots(T))

    def _build_prefill(self, T: int):
        b = self.buckets
        inp = empty_step_input(T, b.slots(T), b.pages_per_seq, self.pad_page, b.page_size)
        params, kv_caches = self.avals
        lowered = _draft_prefill.lower(
            params, kv_caches, inp, graphdef=self.graphdef, backend=self.backend, interpret=self.interpret
        )
        return lowered.compile()

    def before_step(self, out: SchedulerOutput, verify: bool) -> None:
        """Called as each step is dispatched, before its program: forget preempted requests' draft KV and, for a
        verifying step, bring every speculating sequence's draft KV up to its computed tokens."""
        for req in out.preempted:
            self.computed.pop(req, None)
        if not verify:
            # A plain step (or block) writes no draft K/V: what the draft holds past the target's computed tokens
            # is a rejected draft's, and must not count once the target moves past it.
            for s in out.seqs:
                if self.computed.get(s.request, 0) > s.num_computed_tokens:
                    self.computed[s.request] = s.num_computed_tokens
            return
        chunks = []
        for s in out.seqs:
            if s.draft_token_ids:
                req, computed = s.request, s.num_computed_tokens  # it computes its last token and its drafts
                have = min(self.computed.get(req, 0), computed)
                if have < computed:
                    chunks.append((req, have, computed - have))
                # The step's proposal loop writes draft K/V up to its last draft; reading it back is bounded by the
                # computed tokens the scheduler keeps, so rejected drafts' positions are never trusted.
                self.computed[req] = computed + 1 + len(s.draft_token_ids)
        if len(self.computed) > 2 * self.buckets.max_num_seqs:
            self.computed = {r: n for r, n in self.computed.items() if r.status is not RequestStatus.FINISHED}
        self._catch_up(chunks)

    def _catch_up(self, chunks) -> None:
        """Draft prefills over (request, first token, count) chunks, in calls of at most the largest token bucket
        (a long context is split across calls, in order)."""
        cap = self.buckets.token_buckets[-1]
        call, used = [], 0
        for req, start, count in chunks:
            while count:
                take = min(count, cap - used)
                call.append(ScheduledSeq(req, start, take, False))
                used, start, count = used + take, start + take, count - take
                if used == cap:
                    self._prefill(call, used)
                    call, used = [], 0
        if call:
            self._prefill(call, used)

    def _prefill(self, seqs: list[ScheduledSeq], num_tokens: int) -> None:
        inp, _ = pack_step(SchedulerOutput(seqs, num_tokens, [], 0.0), self.buckets, self.pad_page, {})
        program = self.prefill_programs.get(inp.token_ids.shape[0])
        self.kv_caches = program(self.params, self.kv_caches, inp)
        self.num_prefill_tokens += num_tokens


def build_draft_runner(
    model: Llama,
    *,
    num_pages: int,
    page_size: int,
    kv_cache_dtype: str,
    placement: Placement,
    buckets: BucketTable,
    backend: str,
    interpret: bool,
    cpu_impls,
    compiles: CompileCounter,
) -> DraftRunner:
    """The draft half of a runner whose KV cache has `num_pages` pages of `page_size` tokens: the draft's parameters
    and a cache of the same geometry, placed as the target's. ValueError without speculation (buckets'
    max_draft_tokens 0) or on a mesh (tensor parallelism)."""
    if not buckets.max_draft_tokens or placement.mesh is not None:
        raise ValueError("a draft model needs speculation (max_draft_tokens > 0) and no tensor parallelism")
    return DraftRunner(
        model.cfg,
        weights=place_params(model, placement),
        kv_caches=allocate_kv_cache(
            model.cfg, num_pages=num_pages, page_size=page_size, kv_cache_dtype=kv_cache_dtype, placement=placement
        ),
        placement=placement,
        buckets=buckets,
        backend=backend,
        interpret=interpret,
        cpu_impls=cpu_impls,
        compiles=compiles,
    )
