"""experiments/throughput.py's --replay_device: every dispatched step's input is recorded and can be run again."""

from cbjax import LLM, SamplingParams
from experiments.throughput import record_steps, replay_steps


def test_replay_runs_every_recorded_step_again():
    llm = LLM("test-tiny", max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=64, max_model_len=64)
    engine = llm.engine
    steps_run = record_steps(engine.runner)
    first = len(engine.step_records)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], [params, params])
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    steps = engine.step_records[first:]
    assert len(steps_run) == sum(s["num_scheduled_seqs"] > 0 for s in steps) > 0
    assert all(handle.verified is False for handle in steps_run)
    compiles = engine.num_compiles
    assert replay_steps(engine.runner, steps_run) > 0
    assert engine.num_compiles == compiles  # the same programs, nothing rebuilt
