"""Streamed outputs are views (CompletionOutput.received) that copy a request's tokens only when read: read late,
after the request went on generating, an output still holds exactly what it held at its step."""

import pytest

from cbjax import LLMEngine, SamplingParams
from cbjax.core.outputs import CompletionOutput
from cbjax.model import get_model_config, init_model
from tests.helpers import SMALL_ENGINE

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


def _stream_unread(engine: LLMEngine, n: int, abort_after: int | None = None) -> list:
    """Every output of a streaming run, none of them read until the run is over (the last request aborted after
    `abort_after` steps, if given)."""
    for i in range(n):
        engine.add_request(f"v{i}", [5 + i] * (2 + 5 * i), SamplingParams(max_tokens=6 + 3 * i, **GREEDY))
    kept, steps = [], 0
    while engine.has_unfinished_requests():
        kept += engine.step()
        steps += 1
        if steps == abort_after:
            engine.abort_request(f"v{n - 1}")
    return kept


@pytest.mark.parametrize(
    "options",
    [dict(), dict(async_scheduling=False), dict(num_scheduler_steps=4)],
    ids=["async", "sync", "blocks"],
)
def test_outputs_read_late_hold_what_their_step_received(model, options):
    engine = LLMEngine(model, **SMALL_ENGINE, **options)
    kept = _stream_unread(engine, 3, abort_after=4)
    final = {o.request_id: o.outputs[0].token_ids for o in kept if o.finished}
    assert set(final) == {"v0", "v1", "v2"} and final["v2"] != [] and len(final["v1"]) == 9
    seen: dict[str, list[int]] = {}
    for out in kept:
        c = out.outputs[0]
        before = seen.get(out.request_id, [])
        # Each output: the tokens received so far (a prefix of the final ones), of which the delta is the new part.
        assert c.token_ids == before + c.new_token_ids
        assert c.token_ids == final[out.request_id][: len(c.token_ids)]
        assert c.finished == out.finished
        seen[out.request_id] = c.token_ids
    assert seen == final
    if options.get("num_scheduler_steps"):  # a block's rows stream one per step (runner/token_stream.py, on the
        # CPU), else it delivers several tokens in one output
        largest = max(len(o.outputs[0].new_token_ids) for o in kept)
        assert largest == 1 if engine.runner.token_stream is not None else largest > 1


def test_a_view_equals_the_eager_output_it_stands_for():
    outputs = [7, 8, 9, -1]  # the last one pending: not received yet
    view = CompletionOutput.received(0, outputs, 3, 2, None)
    eager = CompletionOutput(0, [7, 8, 9], [8, 9], None)
    outputs[3] = 10  # received later, and more generated: the view does not see it
    outputs.append(11)
    assert view == eager and repr(view) == repr(eager)
    assert view.token_ids == [7, 8, 9] and view.new_token_ids == [8, 9] and not view.finished
    assert CompletionOutput.received(0, outputs, 5, 0, "length").new_token_ids == []
    view.text = "abc"  # LLM.generate sets the decoded text on its outputs
    assert view != eager and view.text == "abc"
    view.token_ids = [1]
    assert view.token_ids == [1]
