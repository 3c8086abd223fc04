"""KV swap (preemption by swap, runner side): pages round-trip device -> host -> device bitwise, nothing else moves,
no compiles after warmup, exact byte counts, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.core.request import Request
from cbjax.core.sampling_params import SamplingParams
from cbjax.core.scheduler_output import ScheduledSeq, SchedulerOutput
from cbjax.model import get_model_config, init_model
from cbjax.model.llama import kv_cache_bytes_per_page
from cbjax.runner import kv_swap
from cbjax.runner.compilation.program_family import clear_shared_programs
from cbjax.runner.kv_cache import allocate_kv_cache
from cbjax.runner.model_runner import ModelRunner
from cbjax.runner.placement import Placement, place_params
from cbjax.runner.step_input import BucketTable

NUM_PAGES = 16
PAGE_SIZE = 4
HOST_PAGES = 24
CAP = 8  # pages per swap call: small, so a 10-page swap takes two calls


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


def make_runner(model, num_host_pages=HOST_PAGES, cap=CAP, kv_cache_dtype="auto"):
    """A runner assembled from the builders (build_model_runner's parts), with a small swap cap."""
    buckets = BucketTable.build(max_num_batched_tokens=16, max_model_len=64, page_size=PAGE_SIZE, max_num_seqs=2)
    placement = Placement()
    geometry = dict(num_pages=NUM_PAGES, page_size=PAGE_SIZE, kv_cache_dtype=kv_cache_dtype)
    return ModelRunner(
        model,
        weights=place_params(model, placement),
        kv_caches=allocate_kv_cache(model.cfg, **geometry, placement=placement),
        placement=placement,
        buckets=buckets,
        backend="xla",
        host_pool=kv_swap.build_host_pool(
            model.cfg,
            num_host_pages,
            num_device_pages=NUM_PAGES,
            page_size=PAGE_SIZE,
            kv_cache_dtype=kv_cache_dtype,
            max_pages_per_call=cap,
        ),
    )


def fill_random(runner, seed):
    """Random (nonzero) contents in every page, so a copy that moved nothing cannot pass for one that did."""
    rng = np.random.default_rng(seed)
    runner.kv_caches = [
        tuple(jnp.asarray((50 * rng.standard_normal(k.shape)).astype(k.dtype)) for k in layer)
        for layer in runner.kv_caches
    ]


def snapshot(runner) -> np.ndarray:
    """[L, 2, K, P+1, G, H] on host."""
    return np.stack([np.stack([np.asarray(k), np.asarray(v)]) for k, v in runner.kv_caches])


def pages_of(snap: np.ndarray, pages) -> np.ndarray:
    return snap[:, :, :, list(pages)]


def test_buckets():
    assert kv_swap.page_buckets(16, cap=8) == (4, 8)
    assert kv_swap.page_buckets(16, cap=64) == (4, 8, 16)
    assert kv_swap.page_buckets(1000) == (4, 8, 16, 32, 64)
    assert kv_swap.page_buckets(2) == (2,)


@pytest.mark.parametrize(
    "src", [[3], [0, 5, 9], [2, 4, 6, 8, 10], [1, 2, 3, 4, 5, 6, 7, 8, 9, 11]], ids=["1", "3", "5", "10-two-calls"]
)
def test_round_trip_to_different_pages(model, src):
    runner = make_runner(model)
    fill_random(runner, 0)
    before = snapshot(runner)
    host = [HOST_PAGES - 1 - 2 * i for i in range(len(src))]  # scattered host pages, reversed order
    runner.swap([(d, h) for d, h in zip(src, host)], [])
    after_out = snapshot(runner)
    assert np.array_equal(after_out[:, :, :, :NUM_PAGES], before[:, :, :, :NUM_PAGES]), "swap-out changed the cache"

    fill_random(runner, 1)  # overwrite every device page: the data now lives only on host
    overwritten = snapshot(runner)
    dst = [(p + 5) % NUM_PAGES for p in src]  # every page lands somewhere else (some on another's source)
    runner.swap([], list(zip(host, dst)))
    after = snapshot(runner)
    assert np.array_equal(pages_of(after, dst), pages_of(before, src)), "swapped-in data differs bitwise"
    untouched = [p for p in range(NUM_PAGES) if p not in dst]  # every live page but the targets (spare excluded)
    assert np.array_equal(pages_of(after, untouched), pages_of(overwritten, untouched)), "a non-target page changed"


def test_swap_in_into_page_just_swapped_out(model):
    runner = make_runner(model)
    fill_random(runner, 2)
    before = snapshot(runner)
    runner.swap([(10, 5), (11, 6), (12, 7)], [])  # an earlier preemption: host 5..7 hold device 10..12
    # Now in one call: pages 1 and 2 go out, and host 5..7 come in to device 5, 1, 2 (1 and 2 just freed).
    runner.swap([(1, 0), (2, 1)], [(5, 5), (6, 1), (7, 2)])
    after = snapshot(runner)
    assert np.array_equal(pages_of(after, [5, 1, 2]), pages_of(before, [10, 11, 12]))
    # The swapped-out pages reached host before being overwritten: bring them back to check.
    runner.swap([], [(0, 13), (1, 14)])
    assert np.array_equal(pages_of(snapshot(runner), [13, 14]), pages_of(before, [1, 2]))


def test_no_compiles_after_warmup_and_exact_bytes(model):
    # Earlier tests built the same shapes; start cold so warmup's count is exact.
    jax.clear_caches()
    clear_shared_programs()
    runner = make_runner(model)
    runner.warmup()
    assert runner.host_pool.buckets == (4, 8)
    # one step program per token bucket, plus a gather and a scatter per swap bucket
    assert runner.num_compiles == len(runner.buckets.token_buckets) + 2 * len(runner.host_pool.buckets)
    fill_random(runner, 3)
    compiles = runner.num_compiles
    per_page = kv_cache_bytes_per_page(model.cfg, PAGE_SIZE)
    assert runner.host_pool.bytes_per_page == per_page
    total_out = total_in = 0
    for n_out, n_in in [(1, 0), (0, 1), (3, 2), (4, 4), (5, 7), (8, 8), (11, 3), (16, 13), (2, 16)]:
        out = [(d, h) for d, h in zip(range(n_out), range(n_out))]
        inn = [(h, d) for h, d in zip(range(HOST_PAGES - n_in, HOST_PAGES), range(NUM_PAGES - n_in, NUM_PAGES))]
        swap_s, out_bytes, in_bytes = runner.swap(out, inn)
        assert (out_bytes, in_bytes) == (n_out * per_page, n_in * per_page)
        assert swap_s > 0
        total_out += n_out * per_page
        total_in += n_in * per_page
    assert (runner.swap_out_bytes_total, runner.swap_in_bytes_total) == (total_out, total_in)
    assert runner.num_compiles == compiles, "a swap compiled after warmup"


def test_warmup_without_host_pool_adds_no_swap_programs(model, monkeypatch):
    with_pool, without = make_runner(model), make_runner(model, num_host_pages=0)

    def no_swap_program(*args):
        raise AssertionError("a runner without a host pool ran a swap program")

    monkeypatch.setattr(kv_swap, "_gather", no_swap_program)
    monkeypatch.setattr(kv_swap, "_scatter", no_swap_program)
    without.warmup()
    assert without.host_pool is None and with_pool.host_pool.host.shape[0] == HOST_PAGES


def test_execute_swap_only_step_and_reset(model):
    runner = make_runner(model)
    fill_random(runner, 4)
    before = snapshot(runner)
    out = SchedulerOutput([], 0, [], 0.0, swap_out=[(3, 0), (4, 1)], swap_in=[])
    assert runner.execute(out).shape == (0,)
    step = runner.last_step
    assert step.swap_out_bytes == 2 * runner.host_pool.bytes_per_page
    assert step.wait_s == 0.0 and step.padded_tokens == 0 and step.tokens is None
    runner.execute(SchedulerOutput([], 0, [], 0.0, swap_out=[], swap_in=[(0, 8), (1, 9)]))
    assert (
        runner.last_step.swap_out_bytes == 0 and runner.last_step.swap_in_bytes == 2 * runner.host_pool.bytes_per_page
    )
    assert np.array_equal(pages_of(snapshot(runner), [8, 9]), pages_of(before, [3, 4]))
    runner.execute(SchedulerOutput([], 0, [], 0.0))  # no swaps: the last_* fields go back to 0
    step = runner.last_step
    assert (step.swap_s, step.swap_out_bytes, step.swap_in_bytes) == (0.0, 0, 0)
    assert runner.swap_in_bytes_total == 2 * runner.host_pool.bytes_per_page


def _seq(prompt, pages, num_computed, num_new, samples_token):
    req = Request("r", prompt, SamplingParams(temperature=0.0), 0.0, seed=0, arrival_order=0)
    req.pages = list(pages)
    return ScheduledSeq(req, num_computed, num_new, samples_token)


def test_forward_after_swap_in_to_other_pages_matches(model):
    """A sequence prefilled into pages 1..3, swapped out and back into 9, 6, 12 in the same step as its decode,
    samples the same token as one that never moved."""
    prompt = list(range(5, 15))  # 10 tokens: 3 pages of 4
    ref = make_runner(model)
    ref.execute(SchedulerOutput([_seq(prompt, [1, 2, 3], 0, 9, False)], 9, [], 0.0))
    want = ref.execute(SchedulerOutput([_seq(prompt, [1, 2, 3], 9, 1, True)], 1, [], 0.0))

    runner = make_runner(model)
    runner.execute(SchedulerOutput([_seq(prompt, [1, 2, 3], 0, 9, False)], 9, [], 0.0))
    runner.execute(SchedulerOutput([], 0, [], 0.0, swap_out=[(1, 4), (2, 0), (3, 7)]))
    fill_random(runner, 5)  # the device copy is gone
    got = runner.execute(
        SchedulerOutput([_seq(prompt, [9, 6, 12], 9, 1, True)], 1, [], 0.0, swap_in=[(4, 9), (0, 6), (7, 12)])
    )
    assert got.tolist() == want.tolist()
    assert runner.last_step.swap_in_bytes == 3 * runner.host_pool.bytes_per_page


def test_bfloat16_round_trip(model):
    bf = init_model(get_model_config("test-tiny").replace(dtype="bfloat16"), seed=0)
    runner = make_runner(bf)
    fill_random(runner, 6)
    before = snapshot(runner)
    assert before.dtype == jnp.bfloat16
    runner.swap([(0, 0), (1, 1), (2, 2)], [])
    runner.swap([], [(0, 10), (1, 11), (2, 12)])
    assert np.array_equal(
        pages_of(snapshot(runner), [10, 11, 12]).view(np.uint16), pages_of(before, [0, 1, 2]).view(np.uint16)
    )


@pytest.mark.parametrize(
    "swap_out, swap_in, match",
    [
        ([(NUM_PAGES, 0)], [], r"swap_out: device page indices outside \[0, 16\): \[16\]"),  # the spare page
        ([(-1, 0)], [], r"swap_out: device page indices outside"),
        ([(0, HOST_PAGES)], [], r"swap_out: host page indices outside \[0, 24\)"),
        ([], [(HOST_PAGES + 3, 0)], r"swap_in: host page indices outside"),
        ([], [(0, 99)], r"swap_in: device page indices outside"),
        ([(0, 1), (2, 1)], [], r"swap_out: host pages written more than once: \[1\]"),
        ([], [(0, 3), (1, 3)], r"swap_in: device pages written more than once: \[3\]"),
        ([(0, "x")], [], r"integer pairs"),
    ],
)
def test_bad_indices_raise_and_copy_nothing(model, swap_out, swap_in, match):
    runner = make_runner(model)
    fill_random(runner, 7)
    before = snapshot(runner)
    with pytest.raises(ValueError, match=match):
        runner.swap(swap_out, swap_in)
    assert np.array_equal(snapshot(runner), before)
    assert runner.swap_out_bytes_total == runner.swap_in_bytes_total == 0


def test_swap_without_host_pool_raises(model):
    runner = make_runner(model, num_host_pages=0)
    with pytest.raises(ValueError, match="num_host_pages=0"):
        runner.swap([(0, 0)], [])
    with pytest.raises(ValueError, match="num_host_pages=0"):
        runner.execute(SchedulerOutput([], 0, [], 0.0, swap_in=[(0, 0)]))
    with pytest.raises(ValueError, match="num_host_pages must be >= 0"):
        make_runner(model, num_host_pages=-1)


def test_int8_pages_travel_with_their_scales(model):
    """An int8 cache's per-token scales ([K, P, G, 1] next to each layer's K and V) swap out and back in with their
    pages, bitwise; a host page's bytes count them."""
    runner = make_runner(model, kv_cache_dtype="int8")
    assert [a.dtype for a in runner.kv_caches[0]] == [jnp.int8, jnp.int8, jnp.float32, jnp.float32]
    assert runner.host_pool.bytes_per_page == kv_cache_bytes_per_page(model.cfg, PAGE_SIZE, "int8")
    arrays = lambda: [[np.asarray(a) for a in layer] for layer in runner.kv_caches]
    fill_random(runner, 4)
    before = arrays()
    src, host, dst = [1, 6, 9], [20, 3, 11], [7, 2, 14]
    runner.swap(list(zip(src, host)), [])
    fill_random(runner, 5)
    runner.swap([], list(zip(host, dst)))
    for layer_before, layer_after in zip(before, arrays()):
        for a_before, a_after in zip(layer_before, layer_after):
            assert np.array_equal(a_after[:, dst], a_before[:, src])
