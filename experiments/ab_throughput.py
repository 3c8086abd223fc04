"""Two engine configurations on one workload in one process, alternating: the ratio of their offline throughput,
with the machine's drift shared by both.

  python -m experiments.ab_throughput --workload WL.json --model llama-tiny --a '{"num_scheduler_steps": 1}' \\
      --b '{}' --repeats 10

On this shared VM the same command run in two processes minutes apart moves by 5-10%, more than many levers give;
runs of two engines interleaved in one process see the same machine. Both engines are built first (every program
compiled), then each repeat runs the workload on both, in an order that alternates from repeat to repeat.
`--a` and `--b` are JSON dicts of engine options over the defaults of experiments.throughput, whose flags (workload,
model, engine sizes, --ignore_eos, ...) apply to both. Prints one JSON line: each side's options, median wall time
and output tok/s, and the per-repeat throughput ratios B / A with their median.
"""

import json
import statistics
import time

from absl import app, flags

from experiments import throughput

flags.DEFINE_string("a", "{}", "engine A's options over the defaults, as JSON")
flags.DEFINE_string("b", "{}", "engine B's options over the defaults, as JSON")
FLAGS = flags.FLAGS
FLAGS.set_default("repeats", 10)  # (throughput's flag: here, repeats of the pair)


def main(argv):
    del argv
    from cbjax import LLM
    from cbjax.bench.results import cpu_model

    wl, prompts, params = throughput.load_workload()
    sides = {"a": json.loads(FLAGS.a), "b": json.loads(FLAGS.b)}
    dp = FLAGS.data_parallel_size
    llms = {k: LLM(FLAGS.model, data_parallel_size=dp, **(throughput.engine_options(wl) | v)) for k, v in sides.items()}
    walls = {k: [] for k in sides}
    tokens = None
    for rep in range(FLAGS.repeats):
        for k in ("a", "b") if rep % 2 == 0 else ("b", "a"):
            t0 = time.perf_counter()
            outs = llms[k].generate(prompts, params)
            walls[k].append(time.perf_counter() - t0)
            got = [o.outputs[0].token_ids for o in outs]
            if tokens is None:
                tokens = got
            elif got != tokens:  # (greedy: two configurations that differ in speed only give the same tokens)
                print(json.dumps({"warning": f"side {k} generated other tokens than the first run"}), flush=True)
    n = sum(len(t) for t in tokens)
    ratios = [a / b for a, b in zip(walls["a"], walls["b"])]  # B's throughput over A's
    result = {"model": FLAGS.model, "workload": FLAGS.workload, "requests": len(wl), "output_tokens": n}
    for k, opts in sides.items():
        result[k] = {
            "options": opts,
            "wall_s": round(statistics.median(walls[k]), 3),
            "output_tok_per_s": round(n / statistics.median(walls[k]), 1),
            "wall_s_runs": [round(w, 3) for w in walls[k]],
        }
    result |= {"ratio_b_over_a": round(statistics.median(ratios), 4), "ratios": [round(r, 3) for r in ratios]}
    print(json.dumps(result | {"cpu": cpu_model()}), flush=True)


if __name__ == "__main__":
    app.run(main)
