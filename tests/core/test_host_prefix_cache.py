"""The prefix cache's host tier, bookkeeping only (no model): what a device eviction copies out, the tier's LRU and
budget, the copies a host hit brings back, the pins that keep a step's copies apart, and the scheduler's use of it."""

import random

import pytest

from cbjax.config.cache import CacheConfig
from cbjax.core import PagePool, Request, SamplingParams, Scheduler, VirtualClock
from cbjax.core.host_prefix_cache import HostPrefixCache
from tests.core.fake_runner import FakeRunner, reference
from tests.core.scheduler_setup import FlatConfig, make_scheduler

PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def cached_pool(num_pages: int, tier: HostPrefixCache) -> PagePool:
    return PagePool(num_pages, enable_caching=True, host_tier=tier)


def release_cached(pool: PagePool, hashes: list[int]) -> list[int]:
    """Pages registered under `hashes` and released: evictable, each holding its hash's KV."""
    pages = pool.allocate(len(hashes))
    for p, h in zip(pages, hashes):
        pool.register(p, h)
    pool.free(pages)
    return pages


def drained(tier: HostPrefixCache) -> tuple[list, list]:
    out, into = [], []
    tier.drain_into(out, into)
    return out, into


def test_a_device_eviction_is_copied_out_at_the_tiers_offset():
    tier = HostPrefixCache(4, page_size=16, base=10)
    pool = cached_pool(2, tier)
    a, b = release_cached(pool, [101, 102])
    assert drained(tier) == ([], [])  # cached on the device: nothing copied yet
    pool.allocate(2)  # both reused
    out, into = drained(tier)
    assert sorted(d for d, _ in out) == sorted([a, b]) and into == []
    assert all(10 <= h < 14 for _, h in out)  # host page ids after the swap pool's 10
    assert 101 in tier and 102 in tier and tier.num_pages_out == 2
    pool.check_consistent()


def test_the_tier_evicts_its_least_recently_used_page_at_its_budget():
    tier = HostPrefixCache(2, page_size=16)
    pool = cached_pool(1, tier)
    for h in (1, 2, 3):
        release_cached(pool, [h])  # each allocation evicts the previous hash into the tier
        drained(tier)  # (a step: its copies handed over)
    assert tier.lru_hashes() == [1, 2] and tier.num_evictions == 0
    release_cached(pool, [4])  # spills 3: the tier is full, 1 (least recent) goes
    assert tier.lru_hashes() == [2, 3] and tier.num_evictions == 1 and 1 not in tier
    drained(tier)
    tier.check_consistent()


def test_a_page_written_this_step_is_not_reused_in_the_same_step():
    tier = HostPrefixCache(1, page_size=16)
    pool = cached_pool(2, tier)
    release_cached(pool, [1, 2])
    pool.allocate(2)  # both evicted in one step: the second finds the only host page already written this step
    out, _ = drained(tier)
    assert len(out) == 1 and tier.num_dropped == 1
    pool.check_consistent()


def test_an_inclusive_tier_copies_a_page_out_once():
    tier = HostPrefixCache(4, page_size=16)
    pool = cached_pool(1, tier)
    release_cached(pool, [7])
    pool.free(pool.allocate(1))  # 7 spills; the reused page, unregistered, goes back to the free list
    assert len(drained(tier)[0]) == 1
    (dev,) = tier.bring_back([7], pool)
    assert pool.lookup([7]) == [dev]  # registered on the device again; the tier keeps its copy
    out, into = drained(tier)
    assert out == [] and into == [(tier.base + 0, dev)]
    pool.free([dev])
    pool.allocate(1)  # 7 evicted from the device a second time: the host still holds it, nothing copied
    assert drained(tier) == ([], []) and tier.num_pages_out == 1 and tier.num_pages_in == 1
    assert tier.hit_tokens == 16
    pool.check_consistent()


def test_a_host_page_read_this_step_is_never_a_copy_out_destination():
    # A 1-page tier holding hash 5; a bring-back reads it while the device evicts hash 6 in the same step.
    tier = HostPrefixCache(1, page_size=16)
    pool = cached_pool(1, tier)
    release_cached(pool, [5])
    pool.free(pool.allocate(1))  # 5 spills to the tier
    drained(tier)
    release_cached(pool, [6])  # the device page now caches 6
    (dev,) = tier.bring_back([5], pool)  # needs the device page: 6 is evicted, but the only host page is pinned
    out, into = drained(tier)
    assert out == [] and into == [(0, dev)] and tier.num_dropped == 1 and 6 not in tier
    pool.check_consistent()


def test_a_pinned_page_is_skipped_for_the_next_lru_page():
    tier = HostPrefixCache(2, page_size=16)
    pool = cached_pool(1, tier)
    for h in (1, 2, 3):
        release_cached(pool, [h])  # 1 and 2 spill, 1 least recent; 3 stays on the device
        drained(tier)
    tier.bring_back([1], pool)  # pins 1; its device page evicts 3, whose spill takes 2's host page, not 1's
    out, into = drained(tier)
    assert tier.lru_hashes() == [3, 1] and len(out) == 1 and out[0][1] != into[0][0]
    tier.check_consistent()


def test_host_tier_validation():
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        HostPrefixCache(0, page_size=16)
    with pytest.raises(ValueError, match="base must be >= 0"):
        HostPrefixCache(1, page_size=16, base=-1)
    with pytest.raises(ValueError, match="needs enable_caching"):
        PagePool(4, host_tier=HostPrefixCache(1, page_size=16))


def test_cache_config_refuses_a_host_tier_without_prefix_caching():
    with pytest.raises(ValueError, match="set enable_prefix_caching=True"):
        CacheConfig(host_cache_gib=1.0)
    with pytest.raises(ValueError, match="host_cache_gib must be"):
        CacheConfig(enable_prefix_caching=True, host_cache_gib=-1.0)
    assert CacheConfig(enable_prefix_caching=True, host_cache_gib=0.5).host_cache_gib == 0.5


def run(sched, clock):
    """Step a scheduler to completion with token 1 sampled for every sampling sequence; checks after each step."""
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        outs.append(out)
        sched.update(out, [1] * len(out.seqs), None, clock.now())
        sched.pool.check_consistent()
    return outs


def test_the_scheduler_skips_host_hits_like_device_hits():
    clock = VirtualClock()
    cfg = FlatConfig(page_size=4, num_pages=6, enable_prefix_caching=True, max_num_seqs=1)
    cfg_sched, cache = cfg.split()
    sched = Scheduler(cfg_sched, cache.replace(num_host_pages=3, num_host_cache_pages=8), clock)
    assert sched.host_cache.base == 3
    a, b = list(range(100, 117)), list(range(200, 217))  # 4 full pages each (the 17th token is always computed)
    for i, prompt in enumerate([a, b, a]):
        sched.add(Request(str(i), prompt, PARAMS, 0.0, seed=0, arrival_order=i))
        run(sched, clock)
    # b (5 of the 6 device pages) evicted a's cached pages tail first: its head page is still on the device, the
    # three after it were copied out. The second a hits 1 page on the device, then 3 on the host; their device
    # pages (and its last) evict 3 of b's, copied out in turn.
    assert sched.pool.hit_tokens == 16 and sched.host_cache.hit_tokens == 12
    assert sched.host_cache.num_pages_in == 3 and sched.host_cache.num_pages_out == 6


def test_host_hits_count_as_cached_prefix_for_policies():
    clock = VirtualClock()
    cfg = FlatConfig(page_size=4, num_pages=5, enable_prefix_caching=True, max_num_seqs=1, policy="lpm")
    cfg_sched, cache = cfg.split()
    sched = Scheduler(cfg_sched, cache.replace(num_host_cache_pages=8), clock)
    a, b = list(range(100, 117)), list(range(200, 217))
    for i, prompt in enumerate([a, b]):
        sched.add(Request(str(i), prompt, PARAMS, 0.0, seed=0, arrival_order=i))
        run(sched, clock)
    again = Request("again", a, PARAMS, 0.0, seed=0, arrival_order=2)
    assert sched.cached_prefix_tokens(again) == 16
    assert sched.pool.num_cached(again.page_hashes, 4) == 0  # all 16 from the host tier


def test_make_scheduler_without_a_tier_has_none():
    sched = make_scheduler(FlatConfig(enable_prefix_caching=True), VirtualClock())
    assert sched.host_cache is None and sched.pool.host_tier is None


class CopyingFakeRunner(FakeRunner):
    """The fake runner with the real runner's host semantics: a swap-in copies a host page, so the inclusive tier can
    bring a page back twice. A host page never written is a KeyError: a copy back of something the tier never
    received."""

    KEEPS_HOST_PAGES = True


VOCAB = 97


@pytest.mark.parametrize("seed", range(24))
def test_random_sessions_get_reference_tokens_with_the_tier(seed):
    """Random waves of requests over a few shared prefixes, a pool too small to keep them, a small tier (so it
    evicts too), random policy, preemption mode, blocks of decode steps (whose pages may evict cached ones) and
    asynchronous scheduling: every request's tokens equal the reference (a wrong copy, a lost page, a copy in the
    wrong order changes what the fake KV reads back), every pool stays consistent, and nothing is left held at the
    end."""
    rng = random.Random(seed)
    policy = rng.choice(["fcfs", "lpm", "priority", "sjf", "mlfq"])
    mode = rng.choice(["recompute", "swap"])
    asynchronous = rng.random() < 0.5
    G, num_pages = 4, rng.randint(10, 16)
    cfg = FlatConfig(page_size=G, num_pages=num_pages, enable_prefix_caching=True, max_num_seqs=rng.randint(1, 4),
                     max_num_batched_tokens=rng.choice([8, 16, 32]), policy=policy, preemption_mode=mode,
                     max_model_len=96, num_scheduler_steps=rng.choice([1, 4]))  # fmt: skip
    cfg_sched, cache = cfg.split()
    cache = cache.replace(num_host_pages=12 if mode == "swap" else 0, num_host_cache_pages=rng.randint(2, 12))
    clock = VirtualClock()
    s = Scheduler(cfg_sched, cache, clock)
    runner = CopyingFakeRunner(s, VOCAB)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 20))] for _ in range(3)]
    reqs, expected, n = {}, {}, 0
    for _wave in range(4):
        for _ in range(rng.randint(1, 4)):
            prompt = rng.choice(prefixes) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))]
            params = SamplingParams(max_tokens=rng.randint(1, 6), ignore_eos=True)
            req = Request(str(n), prompt, params, clock.now(), seed=0, arrival_order=n, priority=rng.randint(0, 2))
            reqs[req.request_id] = req
            expected[req.request_id] = reference(prompt, params.max_tokens, VOCAB, None, 96)
            s.add(req)
            n += 1
        in_flight, steps = None, 0
        while s.has_unfinished() or in_flight:
            out = s.schedule()
            tokens = runner.execute(out)
            clock.advance(0.001)
            if asynchronous:
                if in_flight is not None:
                    s.update(*in_flight, None, clock.now())
                in_flight = (out, tokens) if out.seqs else None
            else:
                s.update(out, tokens, None, clock.now())
            s.pool.check_consistent()  # (and the tier's)
            steps += 1
            assert steps < 2000, "requests did not finish"
    for rid, req in reqs.items():
        assert req.output_token_ids == expected[rid], (rid, policy, mode, asynchronous)
    assert s.pool.num_free == num_pages
    assert runner.pages_swapped_out == s.num_swapped_out_pages + s.host_cache.num_pages_out
    assert runner.pages_swapped_in == s.num_swapped_in_pages + s.host_cache.num_pages_in


def test_random_sessions_do_use_the_tier():
    """The random cases above are not vacuous: over them the tier serves hits (run a few again, counting)."""
    served = 0
    for seed in range(6):
        rng = random.Random(seed)
        cfg_sched, cache = FlatConfig(page_size=4, num_pages=10, enable_prefix_caching=True, max_num_seqs=2).split()
        s = Scheduler(cfg_sched, cache.replace(num_host_cache_pages=16), VirtualClock())
        prefix = [rng.randrange(3, VOCAB) for _ in range(16)]
        others = [[rng.randrange(3, VOCAB) for _ in range(17)] for _ in range(2)]
        for i, prompt in enumerate([prefix + [5], *others, prefix + [6]]):
            s.add(Request(str(i), prompt, PARAMS, 0.0, seed=0, arrival_order=i))
            run(s, VirtualClock())
        served += s.host_cache.hit_tokens
    assert served > 0


def test_a_page_a_block_of_decode_steps_evicts_is_copied_out_before_the_block():
    """A sequence decoding alone in blocks of 4 steps (core/multi_step.py) takes a page of a's cached prefix while
    planning its block: the copy out must go with that step (the block writes the page), or a's prefix comes back
    from the host holding the block's tokens. (Handed to the next step instead, a's second answer was wrong.)"""
    clock = VirtualClock()
    cfg = FlatConfig(page_size=4, num_pages=6, enable_prefix_caching=True, max_num_seqs=2, num_scheduler_steps=4)
    cfg_sched, cache = cfg.split()
    s = Scheduler(cfg_sched, cache.replace(num_host_cache_pages=8), clock)
    runner = CopyingFakeRunner(s, VOCAB)
    a = list(range(10, 19))
    blocks_copying = 0
    for i, (prompt, max_tokens) in enumerate([(a, 1), (list(range(40, 45)), 14), (a + [5], 2)]):
        req = Request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0, seed=0,
                      arrival_order=i)  # fmt: skip
        s.add(req)
        while s.has_unfinished():
            out = s.schedule()
            blocks_copying += out.num_steps > 1 and bool(out.swap_out)
            s.update(out, runner.execute(out), None, clock.now())
            s.pool.check_consistent()
        assert req.output_token_ids == reference(prompt, max_tokens, VOCAB, None, 2048), i
    assert blocks_copying == 1 and s.host_cache.hit_tokens == 4
