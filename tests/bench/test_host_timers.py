"""cbjax/bench/host_timers.py: the host's CPU per step, split by part, measured through the `timed` hooks of the
engine and its runner without changing what it computes."""

from cbjax import LLM, SamplingParams
from cbjax.bench.host_timers import PARTS, HostTimers


def test_every_part_is_timed_inside_the_step_and_tokens_are_unchanged():
    llm = LLM("test-tiny", max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=64, max_model_len=64)
    engine = llm.engine
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 2
    untimed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    timers = HostTimers(engine)
    first = len(engine.step_records)
    timed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert timed == untimed
    split = timers.per_step_ms(len(engine.step_records) - first)
    assert all(split[p] > 0 for p in PARTS), split
    assert split["total"] >= sum(split[p] for p in PARTS) and split["other"] >= 0
    timers.reset()
    assert timers.per_step_ms(1)["total"] == 0
