"""ModelRunner's hooks: `timed(part)` wraps the host's parts of a step (pack, launch, fetch) and nothing when None;
`on_dispatch(handle)` sees every dispatched step with its packed input, which `run_input` runs again to the same
tokens (experiments/throughput.py's device-only replay)."""

import contextlib

import numpy as np

from cbjax.config.cache import CacheConfig
from cbjax.config.compilation import CompilationConfig
from cbjax.config.parallel import ParallelConfig
from cbjax.core.request import Request
from cbjax.core.sampling_params import SamplingParams
from cbjax.core.scheduler_output import ScheduledSeq, SchedulerOutput
from cbjax.model import get_model_config, init_model
from cbjax.runner.build import build_model_runner
from cbjax.runner.step_input import BucketTable


def _prefill(prompt, pages) -> SchedulerOutput:
    req = Request("r", prompt, SamplingParams(temperature=0.0), 0.0, seed=0, arrival_order=0)
    req.pages = list(pages)
    return SchedulerOutput([ScheduledSeq(req, 0, len(prompt), True)], len(prompt), [], 0.0)


def test_hooks_see_each_part_and_each_step_and_run_input_replays_it():
    model = init_model(get_model_config("test-tiny"), seed=0)
    buckets = BucketTable.build(max_num_batched_tokens=16, max_model_len=64, page_size=4, max_num_seqs=2)
    runner = build_model_runner(
        model,
        cache=CacheConfig(page_size=4, num_pages=8, num_host_pages=0),
        compilation=CompilationConfig(attention_backend="xla"),
        parallel=ParallelConfig(),
        speculative=None,
        num_scheduler_steps=1,
        buckets=buckets,
    )
    assert runner.timed is None and runner.on_dispatch is None  # off by default
    parts, handles = [], []

    @contextlib.contextmanager
    def timed(part):
        parts.append(part)
        yield

    runner.timed, runner.on_dispatch = timed, handles.append
    tokens = runner.execute(_prefill(list(range(3, 10)), [0, 1]))
    assert parts == ["pack", "launch", "fetch"]
    (handle,) = handles
    assert handle.inp is not None and handle.padded_tokens == handle.inp.layout.T == 16
    # The same input again writes the same K/V to the same pages and samples the same (greedy) token.
    again = np.asarray(runner.run_input(handle.inp, handle.verified))
    assert again[0] == tokens[0]
    runner.timed = runner.on_dispatch = None
    runner.execute(_prefill(list(range(3, 10)), [2, 3]))
    assert parts == ["pack", "launch", "fetch"] and len(handles) == 1
