"""The engine loop hands a step's token events to the event loop together (one wake-up per step, not one per
streaming request), in order, and each request's stream still adds up to its greedy output."""

import asyncio
import threading

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from cbjax.serve.engine_loop import EngineLoop
from cbjax.serve.metrics import ServerMetrics
from tests.helpers import SMALL_ENGINE

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + i] * (3 + 4 * i) for i in range(4)]


def test_a_steps_token_events_arrive_in_one_call_per_event_loop():
    model = init_model(get_model_config("test-tiny"), seed=0)
    engine = LLMEngine(model, **SMALL_ENGINE)
    reference = LLM(model, **SMALL_ENGINE).generate(PROMPTS, SamplingParams(6, **GREEDY))
    expected = [o.outputs[0].token_ids for o in reference]
    gate, step = threading.Event(), engine.step_deltas  # (the engine loop's step: outputs read in bulk)
    engine.step_deltas = lambda: (gate.wait(), step())[1]  # the first step waits until every request is submitted
    loop = EngineLoop(engine, ServerMetrics("test"))
    loop.start()

    async def run():
        aloop = asyncio.get_running_loop()
        calls, plain = [], aloop.call_soon_threadsafe

        def counting(callback, *args):
            calls.append(args[0] if args and isinstance(args[0], list) else None)  # a batch of events, or one
            return plain(callback, *args)

        aloop.call_soon_threadsafe = counting
        handles = [loop.submit(p, SamplingParams(6, **GREEDY)) for p in PROMPTS]
        gate.set()
        streams = []
        for h in handles:
            events = [await asyncio.wait_for(h.events.get(), 30)]
            while events[-1][0] != "tokens" or events[-1][2] is None:
                events.append(await asyncio.wait_for(h.events.get(), 30))
            streams.append(events)
        return calls, streams

    try:
        calls, streams = asyncio.run(run())
    finally:
        loop.stop()
    for events, want in zip(streams, expected):
        assert events[0] == ("accepted", None)
        assert [t for e in events[1:] for d in e[1] for t in d.new_ids] == want
        assert [d.finish_reason for e in events[1:] for d in e[1]] == [None] * (len(events) - 2) + ["length"]
        assert [e[2] is None for e in events[1:]] == [True] * (len(events) - 2) + [False]  # the final outputs
    batches = [c for c in calls if c is not None]
    num_events = sum(len(events) - 1 for events in streams)
    assert sum(len(b) for b in batches) == num_events
    assert len(batches) < num_events and max(len(b) for b in batches) == len(PROMPTS)
