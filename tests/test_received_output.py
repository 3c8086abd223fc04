"""A plain request's streamed output is a ReceivedOutput: its completion is built only when read, and its
`stream_delta()` (read without building it) is the completion's `new_token_ids`, whenever either is read."""

import pickle

import pytest

from cbjax import LLMEngine, SamplingParams
from cbjax.core.outputs import ReceivedOutput, RequestOutput
from cbjax.model import get_model_config, init_model
from tests.helpers import SMALL_ENGINE

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    model = init_model(get_model_config("test-tiny"), seed=0)
    return LLMEngine(model, **SMALL_ENGINE)


def test_deltas_read_late_equal_the_completions_read_late(engine):
    for i in range(3):
        engine.add_request(f"d{i}", [3 + i] * (2 + 4 * i), SamplingParams(max_tokens=5 + 2 * i, **GREEDY))
    engine.add_request("lp", [4, 4, 4], SamplingParams(max_tokens=4, logprobs=1, **GREEDY))
    kept, steps = [], 0
    while engine.has_unfinished_requests():
        kept += engine.step()
        steps += 1
        if steps == 3:
            engine.abort_request("d2")
    # Deltas first (no completion built), then the completions: both read after the run, both the step's.
    deltas = [out.stream_delta() for out in kept]
    plain = [out for out in kept if out.request_id != "lp"]
    assert plain and all(isinstance(out, ReceivedOutput) for out in plain)
    assert not any(isinstance(out, ReceivedOutput) for out in kept if out.request_id == "lp")  # (logprobs: built)
    streamed: dict[str, list[int]] = {}
    for out, delta in zip(kept, deltas):
        assert delta == out.outputs[0].new_token_ids
        streamed[out.request_id] = streamed.get(out.request_id, []) + delta
        assert out.outputs[0].token_ids == streamed[out.request_id]
    finals = {out.request_id: out for out in kept if out.finished}
    assert set(finals) == {"d0", "d1", "d2", "lp"}
    assert finals["d2"].finish_reason == finals["d2"].outputs[0].finish_reason == "abort"
    assert finals["d0"].outputs[0].finish_reason == "length" and len(streamed["d0"]) == 5
    assert all(not out.finished and out.finish_reason is None for out in plain if out not in finals.values())


def test_a_received_output_equals_its_plain_copy_and_pickles_as_one(engine):
    engine.add_request("p", [6, 7, 8], SamplingParams(max_tokens=3, **GREEDY))
    outs = [out for out in engine.stream()]
    last = outs[-1]
    assert isinstance(last, ReceivedOutput) and last.finished
    plain = last.materialize()
    assert type(plain) is RequestOutput and plain == last and last == plain
    assert plain.outputs[0].token_ids == [t for o in outs for t in o.stream_delta()]
    copy = pickle.loads(pickle.dumps(last))
    assert type(copy) is RequestOutput and copy == plain
    assert outs[0] != last  # (a different step's output of the same request)
