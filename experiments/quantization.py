"""int8 weights on the packaged tinypy: held-out loss, greedy agreement, weight bytes and tokens/s against float32.

  python -m experiments.quantization                    # every held-out window; ~2 minutes on 2 CPU cores
  python -m experiments.quantization --windows=16 --repeats=1
  python -m experiments.quantization --doc_data=docs/data/quantization_DATE.json   # also a data file for the docs

Held-out text: the standard-library files train_tiny.py held out (every 50th by sorted path), tokenized and cut into
non-overlapping 257-token windows (docs/models.md measures the float32 loss the same way). Agreement: the float32
engine's greedy continuations of 32-token prompts (the windows' starts), then the int8 model teacher-forced on
them: the share of positions where its argmax is the float32 token (one divergence does not count twice), and the
share of continuations identical end to end. Throughput: the same prompts through LLM.generate, float32 and int8
interleaved (each round starts with the side the round before ended with), median of --repeats.
--doc_data writes a data file (cbjax/bench/doc_data.py) that docs/memory.md's tables are generated from: one run
per variant with its one-shot figures (kind "quality": loss, agreement, bytes, compiles; deterministic) and one
per (variant, round) of throughput (kind "throughput").
"""

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
WINDOW = 257
PROMPT_LEN = 32


def define_flags() -> None:
    """The command's flags (kv_quantization's too), defined only when one runs as the program: a test imports this
    module beside others whose flags have the same names."""
    flags.DEFINE_integer("windows", 0, "held-out windows for the loss (0: all)")
    flags.DEFINE_integer("prompts", 32, "prompts for the greedy agreement and throughput")
    flags.DEFINE_integer("max_tokens", 64, "tokens generated per prompt")
    flags.DEFINE_integer("repeats", 3, "throughput runs per side (median)")
    flags.DEFINE_string("doc_data", None, "also write the runs to this data file for the docs (docs/data/NAME.json)")


def settings() -> dict:
    """The flags' values and the fixed shapes, for the data file."""
    return dict(windows=FLAGS.windows, prompts=FLAGS.prompts, max_tokens=FLAGS.max_tokens, repeats=FLAGS.repeats,
                window_tokens=WINDOW, prompt_tokens=PROMPT_LEN)  # fmt: skip


def heldout_tokens(tokenizer) -> np.ndarray:
    from experiments.train_tiny import stdlib_files

    ids: list[int] = []
    for i, path in enumerate(stdlib_files()):
        if i % 50 != 49:  # train_tiny's val_every = 50 (configs/train_tiny.py)
            continue
        try:
            with open(path, encoding="utf-8") as f:
                ids += tokenizer.encode(f.read())
        except (UnicodeDecodeError, OSError):
            continue
    return np.asarray(ids, np.int32)


def mean_loss(model, windows: np.ndarray, batch: int = 8, kv_round_trip=None) -> float:
    """Mean next-token cross-entropy (nats/token) over windows [n, WINDOW]; `kv_round_trip`: see
    Llama.forward_full (what a quantized KV cache does to K and V)."""
    fwd = jax.jit(lambda tokens: model.forward_full(tokens, kv_round_trip=kv_round_trip))
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = jnp.asarray(windows[i : i + batch])
        logp = jax.nn.log_softmax(fwd(w[:, :-1]), axis=-1)
        nll = -jnp.take_along_axis(logp, w[:, 1:, None], axis=-1)
        total += float(nll.sum())
        count += int(nll.size)
    return total / count


def teacher_forced_agreement(model, prompts, continuations, kv_round_trip=None) -> float:
    fwd = jax.jit(lambda tokens: model.forward_full(tokens, kv_round_trip=kv_round_trip))
    hits = total = 0
    for p, c in zip(prompts, continuations):
        seq = jnp.asarray([list(p) + list(c)])
        pred = np.asarray(jnp.argmax(fwd(seq)[0], axis=-1))
        hits += int(np.sum(pred[len(p) - 1 : len(p) + len(c) - 1] == np.asarray(c)))
        total += len(c)
    return hits / total


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def interleaved_rates(llms: dict, prompts, sp, repeats: int) -> list[dict]:
    """Output tokens/s of LLM.generate for each named engine, `repeats` rounds; each round runs every engine once,
    the order reversed every other round (A B, B A, ...) so that neither side always runs first. One record per
    (variant, round), with the 1-minute load average at its start."""
    runs = []
    for i in range(repeats):
        order = list(llms.items()) if i % 2 == 0 else list(llms.items())[::-1]
        for name, llm in order:
            load = load_average()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
            runs.append(dict(kind="throughput", variant=name, round=i + 1, output_tok_per_s=rate, load_average=load))
    return runs


def write_data(path: str, script: str, what: str, runs: list[dict], load_before: float, options: dict) -> None:
    """The data file for the docs (cbjax/bench/doc_data.py): the command as typed, every run, the load average
    before and after, and the options it ran with."""
    from cbjax.bench.doc_data import write_doc_data

    write_doc_data(
        path,
        command=f"python -m experiments.{script} {' '.join(sys.argv[1:])}".strip(),
        runs=runs,
        what=what,
        load_average_before=load_before,
        load_average_after=load_average(),
        settings=options,
    )
    print(f"wrote {path}")


def main(argv):
    del argv
    from cbjax import LLM, SamplingParams
    from cbjax.model.quantize import linear_weight_bytes

    load_before = load_average()

    f32 = LLM("tinypy", warmup="full")
    int8 = LLM("tinypy", quantization="int8", warmup="full")
    warm = {llm: llm.engine.num_compiles for llm in (f32, int8)}
    tokens = heldout_tokens(f32.engine.tokenizer)
    windows = tokens[: len(tokens) // WINDOW * WINDOW].reshape(-1, WINDOW)
    if FLAGS.windows:
        windows = windows[: FLAGS.windows]
    loss32, loss8 = mean_loss(f32.engine.model, windows), mean_loss(int8.engine.model, windows)

    prompts = [w[:PROMPT_LEN].tolist() for w in windows[: FLAGS.prompts]]
    sp = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in f32.generate(prompts, sp)]
    got = [o.outputs[0].token_ids for o in int8.generate(prompts, sp)]
    agreement = teacher_forced_agreement(int8.engine.model, prompts, ref)
    self_check = teacher_forced_agreement(f32.engine.model, prompts, ref)

    throughput = interleaved_rates({"float32": f32, "int8": int8}, prompts, sp, FLAGS.repeats)
    rates = {name: [r["output_tok_per_s"] for r in throughput if r["variant"] == name] for name in ("float32", "int8")}
    b32, b8 = linear_weight_bytes(f32.engine.model), linear_weight_bytes(int8.engine.model)

    print(f"held-out windows: {len(windows)} x {WINDOW} tokens; prompts: {len(prompts)} x {PROMPT_LEN} tokens")
    print(f"loss (nats/token): float32 {loss32:.4f}  int8 {loss8:.4f}  delta {loss8 - loss32:+.4f}")
    print(
        f"greedy agreement, teacher-forced on float32's tokens: {agreement:.1%} "
        f"(float32 on its own tokens: {self_check:.1%}); identical continuations: "
        f"{sum(a == b for a, b in zip(ref, got))} of {len(ref)}"
    )
    print(f"linear + LM-head weight bytes: float32 {b32:,}  int8 {b8:,}  ratio {b8 / b32:.3f}")
    print(
        "output tok/s (median of {}): float32 {:.0f}  int8 {:.0f}  ratio {:.2f}".format(
            FLAGS.repeats,
            statistics.median(rates["float32"]),
            statistics.median(rates["int8"]),
            statistics.median(rates["int8"]) / statistics.median(rates["float32"]),
        )
    )
    after = [llm.engine.num_compiles - warm[llm] for llm in (f32, int8)]
    print(f"engine compiles after warmup: float32 {after[0]}, int8 {after[1]}")
    if FLAGS.doc_data:
        identical = sum(a == b for a, b in zip(ref, got))
        quality = [
            dict(kind="quality", variant="float32", loss=loss32, agreement=self_check, identical=len(ref),
                 weight_bytes=b32, compiles_after_warmup=after[0]),
            dict(kind="quality", variant="int8", loss=loss8, agreement=agreement, identical=identical,
                 weight_bytes=b8, compiles_after_warmup=after[1]),
        ]  # fmt: skip
        write_data(
            FLAGS.doc_data, "quantization", "int8 weights against float32 on tinypy: held-out loss, greedy agreement, "
            "weight bytes (one-shot, deterministic) and LLM.generate tokens/s (interleaved rounds)",
            quality + throughput, load_before, dict(settings(), continuations=len(ref)),
        )  # fmt: skip


if __name__ == "__main__":
    define_flags()
    app.run(main)
