"""Structured output with speculative decoding (issue 40): acceptance and output tokens/s of JSON-schema requests on
the packaged tinypy model, without speculation, with n-gram drafts and with the packaged draft model.

  python -m experiments.structured_speculation --rounds 3

Each mode is one engine (full warmup, sampling_extras on: the masked verify variant is compiled before timing) that
runs the 8 prompts of tests/structured/test_tinypy_json.py under its schema, greedy, max_tokens 160, once untimed and
then `rounds` times timed; then the same prompts unconstrained (the drafts' acceptance without a grammar, for
comparison). Per round: output tokens / wall seconds (all 8 requests added at once, drained), the
drafts proposed and accepted (acceptance = accepted / proposed), and the compiles during the timed rounds (0
expected). Prints one JSON object, with the load averages before and after; --out also writes it to a file.
"""

import json
import os
import subprocess
import time

from absl import app, flags

flags.DEFINE_integer("rounds", 3, "timed rounds per mode")
flags.DEFINE_integer("k", 3, "num_speculative_tokens")
flags.DEFINE_string("out", None, "also write the JSON result here")
FLAGS = flags.FLAGS

MAX_TOKENS = 160
MODES = {
    "off": None,
    "ngram": lambda k: dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1),
    "draft": lambda k: dict(method="draft", draft_model="tinypy-draft", num_speculative_tokens=k),
}
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, page_size=16, num_pages=128)


def run_once(engine, prompts, schema) -> tuple[int, float]:
    """The prompts greedy under `schema` (None: unconstrained) -> (output tokens, seconds)."""
    from cbjax import SamplingParams
    from cbjax.core.structured_outputs import StructuredOutputs

    spec = None if schema is None else StructuredOutputs(json=schema)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured=spec)
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return tokens, time.perf_counter() - t0


def measure(mode: str, prompts, schema) -> list[dict]:
    from cbjax import LLMEngine

    spec = MODES[mode]
    engine = LLMEngine(
        "tinypy", speculative_config=None if spec is None else spec(FLAGS.k), sampling_extras=True, **ENGINE
    )
    engine.wait_until_warm()
    return [measure_requests(engine, mode, prompts, s) for s in (schema, None)]


def measure_requests(engine, mode: str, prompts, schema) -> dict:
    run_once(engine, prompts, schema)  # untimed: first runs, grammar caches
    compiles = engine.num_compiles
    speculator = engine.scheduler.speculator
    rounds = []
    for _ in range(FLAGS.rounds):
        before = (speculator.num_draft_tokens, speculator.num_accepted_tokens) if speculator else (0, 0)
        tokens, seconds = run_once(engine, prompts, schema)
        after = (speculator.num_draft_tokens, speculator.num_accepted_tokens) if speculator else (0, 0)
        drafted, accepted = after[0] - before[0], after[1] - before[1]
        rounds.append(
            dict(
                output_tokens=tokens,
                seconds=round(seconds, 3),
                tokens_per_s=round(tokens / seconds, 1),
                drafted=drafted,
                accepted=accepted,
                acceptance=round(accepted / drafted, 3) if drafted else None,
            )
        )
    requests = "json schema" if schema is not None else "unconstrained"
    return dict(mode=mode, requests=requests, rounds=rounds, compiles_after_warmup=engine.num_compiles - compiles)


def main(argv):
    del argv
    from tests.structured.test_tinypy_json import PROMPTS, SCHEMA

    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    load_before = os.getloadavg()
    results = [r for mode in MODES for r in measure(mode, PROMPTS, SCHEMA)]
    result = dict(
        command="python -m experiments.structured_speculation " + f"--rounds {FLAGS.rounds} --k {FLAGS.k}",
        commit=commit,
        machine=os.uname().nodename,
        cpus=os.cpu_count(),
        loadavg_before=load_before,
        loadavg_after=os.getloadavg(),
        results=results,
    )
    text = json.dumps(result, indent=1)
    print(text)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    app.run(main)
