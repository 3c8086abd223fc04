"""What bounds the draft model at batch 1 on this CPU, and what the roofline predicts on an accelerator
(issue 37; docs/speculative.md "The draft model at batch 1").

  python -m experiments.draft_bound [--rounds=3] [--prompts=6] --doc_data docs/data/draft_bound_DATE.json

Measures, at batch 1 (each held-out code prompt alone, 180 greedy tokens, EOS ignored; experiments/
spec_vs_defaults.py's prompts and harness), interleaved over --rounds:
  off            the offline LLM default (blocks of 8 decode steps): the baseline
  off_1step      the same, one decode step per dispatch (a plain target step)
  draft_alone    the draft model (tinypy-draft) as the only model, one step per dispatch (a plain draft step)
  draft_k1..k4   the offline default with the draft model, k = 1..4
Every method's tokens are checked against off's (the draft model alone makes other tokens: not checked).

The view `draft_bound` (experiments/doc_views.py; experiments/draft_bound_report.py) fits the standard model to the
runs (cbjax/sim/speculative_speedup.py): alpha from each k's mean acceptance length; the verifying step's cost in
plain target steps, 1 + k c + o, from a line fitted to the verifying steps' median cost over k (slope: c, a draft
iteration with its extra verify row; intercept: 1 + o); the predicted speedup over the default E(alpha, k) x
(default's time per token) / (verifying step) beside the measured one. It also gives the roofline's prediction for
tinypy / tinypy-draft and for a 7B / 1.1B-shaped pair (Llama-2-7B with a TinyLlama-1.1B-shaped draft, bf16) on an
H200 and a TPU v5e, at the fitted alpha and at 0.6 and 0.8 (a 7B pair's acceptance is not measured here): a pure
roofline (no overheads) and one with --step_overhead_ms per dispatch (shared by a block's 8 steps, paid whole by a
verifying step). The shapes are written into the data file.
"""

import os
import sys

from absl import app, flags

from experiments import draft_bound_report
from experiments import spec_vs_defaults as svd  # its flags: --prompts, --max_tokens, --prompt_len, --rounds, ...

svd.define_flags()
flags.DEFINE_list("ks", ["1", "2", "3", "4"], "the draft model's num_speculative_tokens to measure")
flags.DEFINE_float("step_overhead_ms", 1.0, "the roofline scenario's fixed cost per dispatch (roofline.py's default)")
FLAGS = flags.FLAGS

# A TinyLlama-1.1B-shaped draft for Llama-2-7B (same 32000-token vocabulary): shapes only, never built.
DRAFT_1B = dict(vocab_size=32000, hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4,
                intermediate_size=5632, dtype="bfloat16")  # fmt: skip


def build(method: str):
    from cbjax import LLM

    if method == "draft_alone":
        return LLM(FLAGS.draft_model, num_scheduler_steps=1, warmup="full")
    if method == "off_1step":
        return LLM(FLAGS.model, num_scheduler_steps=1, warmup="full")
    if method == "off":
        return LLM(FLAGS.model, warmup="full")
    k = int(method.removeprefix("draft_k"))
    spec = {"method": "draft", "draft_model": FLAGS.draft_model, "num_speculative_tokens": k}
    return LLM(FLAGS.model, speculative_config=spec, warmup="full")


def shapes() -> dict:
    from cbjax.model.config import ModelConfig, get_model_config
    from cbjax.model.registry import model_config_of
    from cbjax.sim.roofline import model_shape

    return {
        "tinypy": model_shape(model_config_of(FLAGS.model)),
        "tinypy-draft": model_shape(model_config_of(FLAGS.draft_model)),
        "llama-7b": model_shape(get_model_config("llama-7b")),
        "draft-1.1b": model_shape(ModelConfig(**DRAFT_1B)),
    }


def main(argv):
    del argv
    if not FLAGS.doc_data:
        raise app.UsageError("--doc_data: the data file to write is required")
    from cbjax.bench.doc_data import read_doc_data, write_doc_data
    from cbjax.model.registry import packaged_model_path
    from cbjax.model.tokenizer import Tokenizer
    from experiments.speculative import code_prompts

    tok = Tokenizer.from_dir(packaged_model_path(FLAGS.model))
    prompts = code_prompts(tok, FLAGS.prompts, FLAGS.prompt_len)
    methods = ["off", "off_1step", "draft_alone", *(f"draft_k{k}" for k in FLAGS.ks)]
    load_at_start = list(os.getloadavg())
    llms = {}
    for m in methods:
        llms[m] = build(m)
        llms[m].engine.wait_until_warm()
        svd.run_batch(llms[m], prompts, 1)  # untimed
        print(f"{m}: built and warm", flush=True)
    runs = []
    for rnd in range(1, FLAGS.rounds + 1):
        turn = (rnd - 1) % len(methods)
        for m in methods[turn:] + methods[:turn]:
            run = svd.run_batch(llms[m], prompts, 1)
            k = int(m.removeprefix("draft_k")) if m.startswith("draft_k") else 0
            runs.append(dict(method=m, k=k, round=rnd, **run))
            print(f"round {rnd} {m}: {run['output_throughput']:.0f} tok/s", flush=True)
    reference = next(r["digest"] for r in runs if r["method"] == "off")
    for r in runs:
        r["same_outputs"] = None if r["method"] == "draft_alone" else r["digest"] == reference
    command = "python -m experiments.draft_bound " + " ".join(
        [f"--rounds={FLAGS.rounds}", f"--prompts={FLAGS.prompts}", f"--max_tokens={FLAGS.max_tokens}",
         f"--prompt_len={FLAGS.prompt_len}", f"--ks={','.join(FLAGS.ks)}",
         f"--step_overhead_ms={FLAGS.step_overhead_ms}"]
    )  # fmt: skip
    write_doc_data(
        FLAGS.doc_data,
        command=command,
        runs=runs,
        what="the draft model (tinypy-draft) at batch 1 against the offline LLM default, k = 1..4, with plain target "
        "and draft steps: the inputs of the standard speculative-decoding model (docs/speculative.md)",
        settings=dict(
            model=FLAGS.model,
            draft_model=FLAGS.draft_model,
            prompt_len=FLAGS.prompt_len,
            max_tokens=FLAGS.max_tokens,
            step_overhead_ms=FLAGS.step_overhead_ms,
            context=FLAGS.prompt_len + FLAGS.max_tokens // 2,  # the roofline's context: a run's middle
        ),
        shapes=shapes(),
        argv=sys.argv,
        load_average_before=load_at_start,
        load_average_after=list(os.getloadavg()),
    )
    print(f"wrote {FLAGS.doc_data}")
    data = read_doc_data(FLAGS.doc_data)
    print(draft_bound_report.fit_table(data))
    print(draft_bound_report.roofline_table(data))


if __name__ == "__main__":
    app.run(main)
