"""The per-step cost of structured output: decode steps with 1, 16 and 64 sequences under a JSON schema against the
same sequences unconstrained (issue 40), on the packaged tinypy model.

  python -m experiments.structured_overhead --rounds 5 --doc_data docs/data/structured_overhead_DATE.json

Each run adds N requests (the same prompts in every mode; greedy, ignore_eos, max_tokens decode steps each) to one
engine, steps until every request has its first token (the prefill, not timed), then times the steps until all
finish: `step_ms` is that time over the decode steps it took. Modes:
- "plain": no constraint;
- "json schema": every request under the schema below (a request whose object is complete keeps decoding with only
  end-of-sequence allowed, ignore_eos, so every mode runs the same number of steps);
- "mask, no grammar": a constraint that allows every token, so the engine's path for constrained requests (the
  masked sampler behind the step, and the engine receiving each step's tokens before it schedules the next) runs
  without any grammar work: the step time splits into that path's cost and the grammar's.
`grammar_ms` is the constraints' own host time per step (llguidance's masks and token advances, all N sequences),
measured by wrapping each request's constraint. Every round runs every (N, mode) once, in order, after one untimed
round that compiles every shape; `compiles` counts the programs compiled during the timed run (0 expected).
"""

import os
import time

from absl import app, flags

flags.DEFINE_integer("rounds", 3, "timed rounds; each runs every (sequences, mode) once")
flags.DEFINE_integer("max_tokens", 32, "decode steps per request")
flags.DEFINE_list("num_seqs", ["1", "16", "64"], "constrained sequences per run")
flags.DEFINE_string("doc_data", None, "the data file to write (docs/data/structured_overhead_DATE.json)")
FLAGS = flags.FLAGS

SCHEMA = {  # tests/structured/test_tinypy_json.py's: tinypy's greedy objects take 41 to 81 tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "active"],
    "additionalProperties": False,
}
PROMPTS = ["x = ", "config = ", 'person = {"name": ', "def load():\n    return ", "data = ", "user = ", "", "r = "]
MAX_NUM_SEQS = 64


class AllowAll:
    """A constraint that allows every token: the constrained path's cost without a grammar."""

    def fill_bitmask(self, row) -> None:
        row[:] = -1

    def accept(self, tokens) -> None:
        pass

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_finished(self) -> bool:
        return False


MODES = ("plain", "json schema", "mask, no grammar")


class TimedConstraint:
    """A request's constraint with the host time of its calls added to `spent[0]` (the TokenConstraint protocol)."""

    def __init__(self, inner, spent: list[float]):
        self.inner, self.spent = inner, spent

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        result = fn(*args)
        self.spent[0] += time.perf_counter() - t0
        return result

    def fill_bitmask(self, row) -> None:
        self._timed(self.inner.fill_bitmask, row)

    def accept(self, tokens) -> None:
        self._timed(self.inner.accept, tokens)

    def rollback(self, num_tokens: int) -> None:
        self._timed(self.inner.rollback, num_tokens)

    def is_finished(self) -> bool:
        return self.inner.is_finished()


def one_run(engine, num_seqs: int, mode: str, max_tokens: int, tag: str) -> dict:
    """N requests to the end; the timed decode steps' figures."""
    from cbjax import SamplingParams
    from cbjax.core.structured_outputs import StructuredOutputs

    constrained = mode != "plain"
    spec = StructuredOutputs(json=SCHEMA) if constrained else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured=spec)
    spent = [0.0]
    ids = [f"{tag}-{i}" for i in range(num_seqs)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, PROMPTS[i % len(PROMPTS)], params)
        if constrained:
            req = engine.requests[rid]
            inner = AllowAll() if mode == "mask, no grammar" else req.constraint
            req.constraint = TimedConstraint(inner, spent)
    received = dict.fromkeys(ids, 0)
    while min(received.values()) == 0:  # the prefill: every request's first token
        for out in engine.step():
            received[out.request_id] = len(out.outputs[0].token_ids)
    first, spent[0], compiles = min(received.values()), 0.0, engine.runner.num_compiles
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            received[out.request_id] = len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - t0
    steps = max_tokens - first
    assert set(received.values()) == {max_tokens}, received
    return dict(
        num_seqs=num_seqs,
        mode=mode,
        decode_steps=steps,
        step_ms=1e3 * elapsed / steps,
        grammar_ms=1e3 * spent[0] / steps,
        compiles=engine.runner.num_compiles - compiles,
    )


def main(argv):
    del argv
    from cbjax import LLMEngine
    from cbjax.bench.doc_data import write_doc_data

    sizes = [int(n) for n in FLAGS.num_seqs]
    if not FLAGS.doc_data:
        raise app.UsageError("--doc_data: the data file to write is required")
    if max(sizes) > MAX_NUM_SEQS:
        raise app.UsageError(f"--num_seqs: at most {MAX_NUM_SEQS}")
    engine = LLMEngine(
        "tinypy", max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=512, page_size=16, num_pages=320, warmup="none"
    )
    load_before = os.getloadavg()
    runs = []
    for rnd in range(FLAGS.rounds + 1):  # round 0 compiles every shape and is not kept
        for n in sizes:
            for m, mode in enumerate(MODES):
                run = one_run(engine, n, mode, FLAGS.max_tokens, f"r{rnd}-{n}-{m}")
                if rnd:
                    runs.append(run | {"round": rnd})
                    print(run | {"round": rnd}, flush=True)
    write_doc_data(
        FLAGS.doc_data,
        command=(
            f"python -m experiments.structured_overhead --rounds {FLAGS.rounds} --max_tokens {FLAGS.max_tokens} "
            f"--num_seqs {','.join(FLAGS.num_seqs)}"
        ),
        runs=runs,
        what="decode step time with N sequences under a JSON schema, with an allow-all mask, and unconstrained; tinypy",
        model="tinypy",
        dtype=engine.model_config.dtype,
        schema=SCHEMA,
        load_average=[*load_before, *os.getloadavg()],
    )


if __name__ == "__main__":
    app.run(main)
