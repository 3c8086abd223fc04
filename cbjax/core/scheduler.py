"""The iteration-level scheduler: which sequences run this step, how many tokens each, and their pages.

Every step has a token budget (`max_num_batched_tokens`) and a slot cap (`max_num_seqs`). Each scheduled sequence
computes its next uncomputed tokens: a whole prompt, a prompt chunk, one decode token, or the recompute of a
preempted sequence are all the same operation. A sequence whose chunk reaches the end of its context samples one
new token. Finished sequences leave at `update`, so their slot and pages serve the very next step.
"""

from collections.abc import Sequence

from cbjax.config.cache import CacheConfig
from cbjax.core.clock import Clock
from cbjax.core.decode_walk import general_visits
from cbjax.core.host_prefix_cache import HostPrefixCache, cached_prefix_pages, prefix_hits
from cbjax.core.multi_step import plan_decode_steps
from cbjax.core.page_pool import PagePool, chain_hashes
from cbjax.core.policy import Policy
from cbjax.core.preemption import preempt_lower, yield_pages
from cbjax.core.request import FinishReason, Request, RequestStatus
from cbjax.core.scheduler_config import SchedulerConfig, pages_for
from cbjax.core.scheduler_output import ScheduledSeq, SchedulerOutput
from cbjax.core.scheduler_view import ReadOnlyScheduler
from cbjax.core.sequence_group import (
    copy_on_write,
    follower_swap_in_pages,
    fork_group,
    fork_ready_groups,
    hand_over,
    leads_unforked,
    shared_write_page,
    slots_wanted,
)
from cbjax.core.sorted_ranking import Ranking, SortedWaiting
from cbjax.core.speculation import scheduling as speculation
from cbjax.core.speculation.speculative_blocks import is_speculative_block, receive_speculative_block
from cbjax.core.speculation.speculator import Speculator
from cbjax.core.step_plan import Placement as _Placement
from cbjax.core.step_plan import StepPlan as _Step
from cbjax.core.step_results import receive_step
from cbjax.core.waiting_queue import WaitingQueue
from cbjax.core.window_eviction import drop_outside_window, max_pages_held

__all__ = ["ReadOnlyScheduler", "Scheduler", "SchedulerConfig", "pages_for"]

# Read per generated token: an enum member read off its class costs ~0.1 us on Python 3.11, a global ~0.01 us.
_RUNNING, _FINISHED = RequestStatus.RUNNING, RequestStatus.FINISHED


class Scheduler:
    """Walks the policy's ranking each step, giving each request its next chunk while the token budget and the
    slots last; preempts (by recompute or swap) when pages run out; admits waiting requests with prefix-cache hits.
    The counters (preemptions, swapped pages, recomputed tokens) are cumulative; the engine reports per-step
    differences."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        clock: Clock,
        *,
        sliding_window: int | None = None,
        policy: Policy | None = None,
        speculator: Speculator | None = None,
    ):
        """`config` and `cache` with their sizes resolved (max_model_len, num_pages, num_host_pages: the engine's
        build does it); `sliding_window`: the model's (it attends to that many last positions only); `policy`: a
        policy object instead of config.policy's (custom policies)."""
        if config.max_model_len is None or cache.num_pages is None or cache.num_host_pages is None:
            raise ValueError("the scheduler needs max_model_len, num_pages and num_host_pages set (not None)")
        self.config, self.cache = config, cache
        self.speculator = speculator  # None: no speculative decoding (speculation/scheduling.py: the scheduler's part)
        self.clock = clock
        self.policy = policy or config.make_policy()
        self.policy.attach(ReadOnlyScheduler(self))
        tier = cache.num_host_cache_pages  # the prefix cache's host tier (host_prefix_cache.py); None or 0: none
        self.host_cache = HostPrefixCache(tier, cache.page_size, base=cache.num_host_pages) if tier else None
        self.pool = PagePool(cache.num_pages, enable_caching=cache.enable_prefix_caching, host_tier=self.host_cache)
        # Pages kept free at admission so running sequences can grow without an immediate preemption.
        self.watermark_pages = int(config.watermark_fraction * cache.num_pages)
        # The attention window whose outside pages are freed (None: no eviction).
        self.window = sliding_window if cache.evict_outside_window else None
        swap = config.preemption_mode == "swap" and cache.num_host_pages > 0
        self.host_pool = PagePool(cache.num_host_pages) if swap else None
        # In the policy's order when it has a waiting_key (the fast path), else in the order requests joined it.
        self.waiting = WaitingQueue(self.policy.waiting_key)
        self.running: list[Request] = []  # in admission order
        self.forking: list[Request] = []  # running heads of sequence groups not forked yet: a slot per sample held
        self._num_admissions = 0
        self.num_preemptions = 0
        self.num_swapped_out_pages = self.num_swapped_in_pages = 0
        self.num_recomputed_tokens = 0  # computed tokens whose KV a recompute preemption dropped
        self.kv_handoff = None  # disaggregated serving: keeps a finished request's pages to send (core/kv_handoff.py)

    # ---- queue management -------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.policy.on_arrival(request, self.clock.now())
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        self.unqueue(request)
        request.drop_outputs_after(len(request.known_output_token_ids) - 1)  # what was sampled but not received
        self.finish(request, FinishReason.ABORT)

    def unqueue(self, req: Request) -> None:
        """Take an unfinished request out of the running set or the waiting queue (a sample waiting inside its
        preempted group is in neither)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_ever_fit(self, num_tokens: int) -> bool:
        cfg, G = self.config, self.cache.page_size
        pages = pages_for(num_tokens, G)
        if self.window is not None:
            pages = max_pages_held(num_tokens, self.window, G, cfg.max_num_batched_tokens)
        return num_tokens <= cfg.max_model_len and pages <= self.cache.num_pages

    def next_event_time(self) -> float | None:
        """When the policy will admit although no request arrives or finishes (a static batch's timeout)."""
        return self.policy.next_event_time(self.running, self.waiting.requests)

    def num_free_slots(self) -> int:
        """Slots a waiting request may take: max_num_seqs less the running requests and the samples that groups
        admitted but not forked yet will add (core/sequence_group.py)."""
        held = len(self.running) + sum(len(h.group.followers) for h in self.forking)
        return self.config.max_num_seqs - held

    def left_running(self, req: Request) -> None:
        """`req` left the running set (preempted or finished): a group head that had not forked frees its slots."""
        if req.group is not None and req in self.forking:
            self.forking.remove(req)

    def cached_prefix_tokens(self, req: Request) -> int:
        """Tokens of the request's context a fresh admission would find in the prefix cache (either tier)."""
        return cached_prefix_pages(self.pool, self.host_cache, req, self.cache.page_size) * self.cache.page_size

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Walk the policy's ranking: each request gets its next chunk while the token budget and the slots last,
        making room (preempting lower-ranked requests) where the policy allows it."""
        now = self.clock.now()
        if self.window is not None:
            for req in self.running:
                drop_outside_window(self.pool, req, self.window, self.cache.page_size)
        if self.forking:
            fork_ready_groups(self, now)
        step = _Step(
            SchedulerOutput([], 0, [], now),
            self.config.max_num_batched_tokens,
            may_admit=self.policy.may_admit(self.running, self.waiting.requests, now),
        )
        drafting = self.speculator is not None and self.speculator.begin_step(self.speculator.batch_size(self)) > 0
        if self.policy.admits_whole_batch:
            self._admit_batch(step)
        ranking = self._rank(self.running, now)
        preempted, max_len = step.preempted, self.config.max_model_len
        # Running sequences' decodes are planned inside general_visits; the visits it yields take the full path.
        for req, lower in general_visits(self, ranking, step, drafting):
            if step.budget <= 0:
                break
            waiting = req.status is not _RUNNING
            if (
                id(req) in preempted
                or (waiting and not step.may_admit)
                or (req.num_pending_tokens > 0 and req.pending_is_final(max_len))
            ):
                continue
            if req.pages and not drafting and self._extend(req, step):
                continue  # the common case: a running sequence's next chunk, its pages at hand (no drafts: k = 0)
            place = self._placement(req, step.budget)
            if place is None:
                # An unsplittable prompt waits for a step with room; later requests do not jump ahead of it.
                step.may_admit &= not waiting
                continue
            place = self._make_room(req, place, ranking.running, lower, step)
            if place is not None:
                self._commit(req, place, step)
        self.waiting.release()  # the ranking, which read the queue's snapshot, is done with
        if self.host_pool is not None:
            self.host_pool.free(step.host_frees)
        step.out.num_batched_tokens = self.config.max_num_batched_tokens - step.budget
        plan_decode_steps(self, step.out)
        if self.host_cache is not None:  # its copies of evicted pages out (a block's pages too), of host hits back in
            self.host_cache.drain_into(step.out.swap_out, step.out.swap_in)
        return step.out

    def _rank(self, running: list[Request], now: float, *, with_running: bool = True) -> Ranking:
        """The policy's order of `running` and the waiting requests: from the sorted queue (fast path) or from
        `rank` (then the running requests' order is read off the ranking unless `with_running` is False)."""
        policy = self.policy
        if self.waiting.sorted:
            for req in policy.stale_waiting_keys(now):
                self.waiting.rekey(req)
            return policy.rank_sorted(running, SortedWaiting(*self.waiting.snapshot()), now)
        order = policy.rank(running, self.waiting.snapshot()[0], now)
        return Ranking(order, [r for r in order if r.status is RequestStatus.RUNNING] if with_running else [])

    def _admit_batch(self, step: _Step) -> None:
        """Static batching: move a whole batch into the running set, then admit nothing else this step."""
        if step.may_admit:
            free_slots = self.num_free_slots()
            order = self._rank([], step.out.time, with_running=False).order
            batch = [] if free_slots >= 0 else list(order)[:free_slots]
            for req in order if free_slots > 0 else ():
                free_slots -= slots_wanted(req)  # a group that has not forked takes one per sample
                if free_slots < 0:
                    break
                batch.append(req)
                if free_slots == 0:
                    break
            for req in batch:
                self.admit(req)
        step.may_admit = False

    def _make_room(
        self, req: Request, place: _Placement, ranked_running: list[Request], lower: int, step: _Step
    ) -> _Placement | None:
        """A slot and pages for `req`, preempting requests ranked below it (`ranked_running[lower:]`) as the policy
        allows. Returns the placement to commit (counted again after any preemption), or None when there is no
        room this step."""
        waiting = req.status is not RequestStatus.RUNNING
        if not waiting and place.pages_needed <= self.pool.num_free:
            return place  # the common case: a running sequence whose pages are there
        lower_ranked = ranked_running[lower:]
        slots = slots_wanted(req) if waiting else 0
        if slots and self.num_free_slots() < slots:
            if not self.policy.preempt_for_slot or not preempt_lower(
                self, req, lower_ranked, step, slots=slots, target=self._pages_wanted(place, waiting)
            ):
                step.may_admit = False
                return None
            place = self._placement(req, step.budget)  # the victim's release may have turned hits evictable
        if self.pool.can_allocate(self._pages_wanted(place, waiting)):
            return place
        if not waiting:
            step.may_admit = False  # a running sequence lacked pages: admit nothing more this step
        preempted = self.num_preemptions
        preempt_lower(self, req, lower_ranked, step, slots=0, target=self._pages_wanted(place, waiting))
        # Victims' releases may have turned some of its cache hits evictable: count again (if there were victims;
        # with a speculator always, as before: its drafts are proposed again).
        if self.num_preemptions != preempted or self.speculator is not None:
            place = self._placement(req, step.budget)
            if self.pool.can_allocate(self._pages_wanted(place, waiting)):
                return place
        if waiting:
            step.may_admit = False  # head-of-line: no later request jumps ahead for lack of pages
        else:
            yield_pages(self, req, step)  # nothing ranked below it to free pages: it yields its own
        return None

    def _commit(self, req: Request, place: _Placement, step: _Step) -> None:
        """Schedule `req` this step as `place` describes: admit it if waiting, give it its pages, charge the
        budget. Its tokens count as computed from now on, and a token it samples is pending until `update`."""
        if req.status is not _RUNNING:
            self.admit(req)
        if place.num_new_pages or req.host_pages or not req.pages:  # else a running sequence's pages suffice
            self._place(req, place, step)
        if leads_unforked(req) and req.num_computed_tokens >= req.group.fork_point:
            fork_group(self, req, step.out.time, step)  # its prompt came from the prefix cache or host memory
        self._scheduled(req, place.num_computed_tokens, place.num_new_tokens, place.draft_token_ids, step)

    def _extend(self, req: Request, step: _Step) -> bool:
        """_placement, _make_room and _commit, with no Placement built, for a running sequence (speculation off) whose
        new pages are free: the hot path. False (nothing done) when they are not: the general path makes room."""
        computed = req.num_computed_tokens
        n = self._num_new_tokens(req, computed, step.budget)
        if n:
            G = self.cache.page_size
            new_pages = (computed + n + G - 1) // G - req.num_dropped_pages - len(req.pages)  # pages_for - have
            if req.shares_pages and shared_write_page(self.pool, req, G) >= 0:
                if max(new_pages, 0) + 1 > self.pool.num_free:
                    return False
                step.out.page_copies.append(copy_on_write(self.pool, req, G, self.policy.choose_eviction))
            if new_pages > 0:
                if new_pages > self.pool.num_free:
                    return False
                req.pages.extend(self.pool.allocate(new_pages, self.policy.choose_eviction))
            self._scheduled(req, computed, n, [], step)
        return True

    def _scheduled(self, req: Request, computed: int, num_new: int, drafts: list[int], step: _Step) -> None:
        """Charge the step for `req`'s chunk and drafts: computed from now on; a token it samples pends until update."""
        end = computed + num_new
        samples = end == len(req.all_token_ids)
        n = num_new + len(drafts)  # drafts are computed (and paid for) like any token
        out = step.out
        out.seqs.append(ScheduledSeq(req, computed, n, samples, drafts))
        step.budget -= n
        now = out.time
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = now
        req.last_scheduled_time = now
        self.policy.on_scheduled(req, n, now)
        # Unverified drafts do not count as computed: what is accepted is added at `update`, the rest rolled back.
        req.num_computed_tokens = end
        if samples:
            req.append_pending_token()

    def _pages_wanted(self, place: _Placement, waiting: bool) -> int:
        # A newcomer also leaves the watermark free, so running sequences can grow.
        return place.pages_needed + (self.watermark_pages if waiting and self.running else 0)

    def _num_new_tokens(self, req: Request, computed: int, budget: int) -> int:
        left = len(req.all_token_ids) - computed
        if leads_unforked(req) and computed < req.group.fork_point:
            left = req.group.fork_point - computed  # the head computes the prompt up to the fork (sequence_group.py)
        chunk_size = self.policy.chunk_size
        n = left if left <= budget else budget
        if chunk_size is not None and n > chunk_size:
            n = chunk_size
        if n < left:
            chunked = self.policy.chunked_prefill
            if chunked is None:
                chunked = self.config.enable_chunked_prefill
            # Without chunking a context waits for a step with room for all of it, unless no step could hold it.
            if not chunked and left <= self.config.max_num_batched_tokens:
                return 0
        return n

    def _placement(self, req: Request, budget: int) -> _Placement | None:
        G = self.cache.page_size
        hits, host_hits = [], 0
        if req.pages:  # running: extend (nothing to look up, revive or swap in)
            computed = req.num_computed_tokens
            n = self._num_new_tokens(req, computed, budget)
            if n == 0:
                return None
            have = req.num_dropped_pages + len(req.pages)
            drafts = [] if self.speculator is None else speculation.drafts(self, req, computed, n, budget, have)
            new_pages = max(0, (computed + n + len(drafts) + G - 1) // G - have)  # pages_for - have
            if req.shares_pages and shared_write_page(self.pool, req, G) >= 0:
                new_pages += 1  # its copy of the shared page it writes into (_place makes it)
            return _Placement(computed, n, hits, new_pages, 0, 0, drafts)
        if req.host_pages:  # swapped out: its pages come back from host
            computed, have = req.num_computed_tokens, req.num_dropped_pages + len(req.host_pages)
        else:  # fresh, recomputing, or admitted in a static batch and not started: the prefix cache may help
            hits, host_hits = prefix_hits(self.pool, self.host_cache, req, G)  # host hits: copied back
            computed, have = (len(hits) + host_hits) * G, len(hits) + host_hits
        n = self._num_new_tokens(req, computed, budget)
        if n == 0:
            return None
        drafts = [] if self.speculator is None else speculation.drafts(self, req, computed, n, budget, have)
        total = pages_for(computed + n + len(drafts), G)
        if self.policy.reserve_to_completion and not req.pages:
            lifetime = pages_for(min(req.num_prompt_tokens + req.params.max_tokens, self.config.max_model_len), G)
            if self.window is not None:  # what it holds at most once decoding, not what it passes through
                lifetime = min(lifetime, pages_for(self.window, G) + 1)
            total = max(total, lifetime)
        revived = self.pool.num_unreferenced(hits)
        swapped_in = len(req.host_pages) + follower_swap_in_pages(req, G) + host_hits if not req.pages else 0
        return _Placement(computed, n, hits, max(0, total - have), revived, swapped_in, drafts)

    def _place(self, req: Request, place: _Placement, step: _Step) -> None:
        """Give the request the pages the placement describes."""
        pool = self.pool
        if req.host_pages:
            device = pool.allocate(len(req.host_pages), self.policy.choose_eviction)
            step.out.swap_in.extend(zip(req.host_pages, device))
            self.num_swapped_in_pages += len(device)
            step.host_frees.extend(req.host_pages)
            req.host_pages = []
            req.pages = device
        elif not req.pages:
            n, G = len(place.hits), self.cache.page_size
            host_hits = place.num_computed_tokens // G - n  # the host tier's hits after the device hits (prefix_hits)
            if pool.enable_caching:
                pool.record_query(req.num_tokens, (n + host_hits) * G)
            pool.incref(place.hits)  # first: the host hits' device pages must not evict these
            req.pages = list(place.hits)
            if host_hits:
                hashes = req.page_hashes[n : n + host_hits]
                req.pages += self.host_cache.bring_back(hashes, pool, self.policy.choose_eviction)
            req.num_registered_pages = len(req.pages)
            req.num_computed_tokens = place.num_computed_tokens
        new_pages = place.num_new_pages
        if req.shares_pages and req.pages:
            copy = copy_on_write(pool, req, self.cache.page_size, self.policy.choose_eviction)
            if copy is not None:
                step.out.page_copies.append(copy)
                new_pages -= 1
        if new_pages:
            req.pages.extend(pool.allocate(new_pages, self.policy.choose_eviction))

    def admit(self, req: Request) -> None:
        """Move a waiting request into the running set."""
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        req.admission_order = self._num_admissions
        self._num_admissions += 1
        self.running.append(req)
        if leads_unforked(req):
            self.forking.append(req)

    # ---- after the step ---------------------------------------------------------------------------------------
    def update(
        self, out: SchedulerOutput, sampled: Sequence[int], eos_token_id: int | None, now: float, first_step: int = 0
    ) -> list[Request]:
        """The results of step `out` reached the host (step_results.receive_step says how they are applied; a block
        of steps may arrive in parts, `first_step` the index of the first row given). Returns the requests that got
        a token."""
        if is_speculative_block(out):  # (core/speculation/speculative_blocks.py)
            return receive_speculative_block(self, out, sampled, eos_token_id, now)
        return receive_step(self, out, sampled, eos_token_id, now, first_step)

    def register_full_pages(self, req: Request) -> None:
        """Offer the pages whose every token now has its KV computed to the prefix cache (and is known: pending
        tokens, of a block of steps or of a step already scheduled, cannot be hashed yet)."""
        G = self.cache.page_size
        full = min(req.num_computed_tokens, len(req.all_token_ids) - req.num_pending_tokens) // G
        if full > req.num_registered_pages:
            chain_hashes(req.all_token_ids, G, req.page_hashes, upto=full * G)
            # Pages already dropped (outside a sliding window) are gone: nothing to offer.
            for i in range(max(req.num_registered_pages, req.num_dropped_pages), full):
                self.pool.register(req.pages[i - req.num_dropped_pages], req.page_hashes[i])
            req.num_registered_pages = full

    def finish(self, req: Request, reason: FinishReason, now: float | None = None) -> None:
        self.left_running(req)
        if req.group is not None:
            hand_over(self, req)  # it may have led a preempted group back
        if self.kv_handoff is None or not self.kv_handoff.keeps(req, reason):
            self.pool.free(req.pages)
        req.pages = []
        if req.host_pages:
            self.host_pool.free(req.host_pages)
            req.host_pages = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.metrics.finished_time = self.clock.now() if now is None else now
        self.policy.on_finish(req, req.metrics.finished_time)
