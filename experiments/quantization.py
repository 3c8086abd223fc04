"""int8 weights on the packaged tinypy: held-out loss, greedy agreement, weight bytes and tokens/s against float32.

  python -m experiments.quantization                    # every held-out window; ~2 minutes on 2 CPU cores
  python -m experiments.quantization --windows=16 --repeats=1

Held-out text: the standard-library files train_tiny.py held out (every 50th by sorted path), tokenized and cut into
non-overlapping 257-token windows (docs/models.md measures the float32 loss the same way). Agreement: the float32
engine's greedy continuations of 32-token prompts (the windows' starts), then the int8 model teacher-forced on
them: the share of positions where its argmax is the float32 token (one divergence does not count twice), and the
share of continuations identical end to end. Throughput: the same prompts through LLM.generate, float32 and int8
interleaved, median of --repeats.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("windows", 0, "held-out windows for the loss (0: all)")
flags.DEFINE_integer("prompts", 32, "prompts for the greedy agreement and throughput")
flags.DEFINE_integer("max_tokens", 64, "tokens generated per prompt")
flags.DEFINE_integer("repeats", 3, "throughput runs per side (median)")
WINDOW = 257
PROMPT_LEN = 32


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


def main(argv):
    del argv
    from cbjax import LLM, SamplingParams
    from cbjax.model.quantize import linear_weight_bytes

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

    rates = {"float32": [], "int8": []}
    for _ in range(FLAGS.repeats):
        for name, llm in (("float32", f32), ("int8", int8)):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
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


if __name__ == "__main__":
    app.run(main)
