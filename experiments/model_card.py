"""The packaged models' figures, computed from the files shipped in cbjax/assets: parameters, file bytes, losses.

  python -m experiments.model_card
  python -m experiments.model_card --doc_data=docs/data/models_DATE.json   # also a data file for docs/models.md

Each packaged model is loaded as the engine loads it (registry.resolve_checkpoint, then hf_loader.load_hf_model in
the packaged dtype: the bf16 files run in float32). Its text is split and tokenized as experiments/train_tiny.py
split and tokenized it for training (read_corpus and encode_corpus, with the model's own configs/train_tiny.py
variant and its shipped tokenizer.json): the held-out files (every val_every-th stdlib file by sorted path) and the
training files, each one stream EOT file EOT file ... The measures, one run record per (model, measure):
  params, embedding_params   parameters of the loaded model, all and the (tied) embedding's
  file_bytes                 bytes of every file in the model's directory
  heldout_windows            non-overlapping (seq_len + 1)-token windows of the held-out stream: all of them
  heldout_loss               mean next-token cross-entropy over those windows (nats/token, seq_len targets each)
  heldout_bits_per_char      the same in bits per character: nats / ln 2 x the held-out stream's tokens per character
  train_loss                 the mean cross-entropy over --train_windows random (seq_len + 1)-token windows of the
                             training stream (train_tiny.batch_at, seed --train_seed: not the training run's batches)
Every figure is deterministic (the same files give the same figures), so each is measured once. The training
recipe and its history (steps, tokens, wall time) are the training run's record, not recomputed here.
"""

import importlib.util
import math
import os
import sys
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each packaged model and the configs/train_tiny.py variant that trained it (its split, context and seed).
MODELS = {"tinypy": "main", "tinypy-draft": "draft"}


def define_flags() -> None:
    """The command's flags, defined only when it runs as the program (tests import this module beside others)."""
    flags.DEFINE_list("models", list(MODELS), "packaged models to measure")
    flags.DEFINE_integer("train_windows", 128, "random training-stream windows for train_loss")
    flags.DEFINE_integer("train_seed", 2, "seed of those windows (training used 0 for its batches, 1 for validation)")
    flags.DEFINE_integer("batch", 8, "windows per forward pass")
    flags.DEFINE_string("doc_data", None, "also write the runs to this data file for the docs (docs/data/NAME.json)")


def training_config(which: str):
    """configs/train_tiny.py's get_config(which): the recipe a packaged model was trained with."""
    spec = importlib.util.spec_from_file_location("train_tiny_config", os.path.join(ROOT, "configs", "train_tiny.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(which)


def windows_of(tokens: np.ndarray, length: int) -> np.ndarray:
    """The stream cut into non-overlapping windows of `length` tokens, [n, length] (the tail that fills none is
    dropped)."""
    n = len(tokens) // length
    return np.asarray(tokens[: n * length], np.int32).reshape(n, length)


def nll_sum(forward, windows: np.ndarray, batch: int = 8) -> tuple[float, int]:
    """(sum of the next-token negative log-likelihoods in nats, number of predicted tokens) over windows [n, L]:
    `forward` maps tokens [b, L - 1] to logits [b, L - 1, V], and each window's tokens 1..L-1 are the targets."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def batch_nll(w):
        logp = jax.nn.log_softmax(forward(w[:, :-1]).astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, w[:, 1:, None], axis=-1).sum()

    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = np.asarray(windows[i : i + batch], np.int32)
        total += float(batch_nll(jnp.asarray(w)))
        count += w.shape[0] * (w.shape[1] - 1)
    return total, count


def mean_loss(forward, windows: np.ndarray, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) over windows [n, L] (see nll_sum)."""
    total, count = nll_sum(forward, windows, batch)
    return total / count


def parameter_counts(model) -> tuple[int, int]:
    """(all parameters, the embedding's) of a cbjax Llama."""
    import jax
    from flax import nnx

    def count(module) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))

    return count(model), count(model.embed)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path)))


def card(name: str, train_windows: int, train_seed: int, batch: int) -> tuple[list[dict], dict]:
    """The run records of one packaged model, and what its corpus was (files, tokens, characters)."""
    from tokenizers import Tokenizer

    from cbjax.model.hf_loader import load_hf_model
    from cbjax.model.registry import resolve_checkpoint
    from experiments.train_tiny import batch_at, encode_corpus, read_corpus

    cfg = training_config(MODELS[name])
    path, dtype = resolve_checkpoint(name)
    model = load_hf_model(path, dtype)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    train_texts, val_texts = read_corpus(cfg)
    val_tokens, train_tokens = encode_corpus(tok, val_texts), encode_corpus(tok, train_texts)
    val_chars = sum(map(len, val_texts))
    corpus = dict(
        train_files=len(train_texts),
        heldout_files=len(val_texts),
        train_tokens=len(train_tokens),
        heldout_tokens=len(val_tokens),
        heldout_chars=val_chars,
    )
    length = cfg.seq_len + 1
    total, embedding = parameter_counts(model)
    forward = model.forward_full

    t0 = time.perf_counter()
    held = windows_of(val_tokens, length)
    nats, scored = nll_sum(forward, held, batch)
    held_s = time.perf_counter() - t0
    heldout_loss = nats / scored
    tokens_per_char = len(val_tokens) / val_chars

    t0 = time.perf_counter()
    steps = math.ceil(train_windows / cfg.batch_size)
    train = np.concatenate([batch_at(train_tokens, i, cfg.batch_size, cfg.seq_len, train_seed) for i in range(steps)])[
        :train_windows
    ]
    train_loss = mean_loss(forward, train, batch)
    train_s = time.perf_counter() - t0

    base = dict(model=name, dtype=dtype)
    loss_detail = dict(window_tokens=length, eval_s=round(held_s, 2))
    runs = [
        dict(base, measure="params", value=total),
        dict(base, measure="embedding_params", value=embedding),
        dict(base, measure="file_bytes", value=dir_bytes(path), files=sorted(os.listdir(path))),
        dict(base, measure="heldout_windows", value=len(held), tokens_scored=scored, window_tokens=length),
        dict(base, measure="heldout_loss", value=heldout_loss, windows=len(held), tokens_scored=scored, **loss_detail),
        dict(base, measure="heldout_bits_per_char", value=heldout_loss / math.log(2) * tokens_per_char,
             chars_per_token=1 / tokens_per_char),
        dict(base, measure="train_loss", value=train_loss, windows=len(train), seed=train_seed,
             window_tokens=length, eval_s=round(train_s, 2)),
    ]  # fmt: skip
    return runs, corpus


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def main(argv):
    del argv
    load_before, t0 = load_average(), time.perf_counter()
    runs, corpora = [], {}
    for name in FLAGS.models:
        model_runs, corpora[name] = card(name, FLAGS.train_windows, FLAGS.train_seed, FLAGS.batch)
        runs += model_runs
    for r in runs:
        print(f"{r['model']:14s} {r['measure']:22s} {r['value']:.4f}" if isinstance(r["value"], float) else
              f"{r['model']:14s} {r['measure']:22s} {r['value']:,}")  # fmt: skip
    print(f"wall time {time.perf_counter() - t0:.1f} s")
    if FLAGS.doc_data:
        from cbjax.bench.doc_data import write_doc_data

        write_doc_data(
            FLAGS.doc_data,
            command=f"python -m experiments.model_card {' '.join(sys.argv[1:])}".strip(),
            runs=runs,
            what="the packaged models' parameters, file bytes and losses, computed from the shipped files "
            "(deterministic: one run per (model, measure))",
            load_average_before=load_before,
            load_average_after=load_average(),
            wall_s=round(time.perf_counter() - t0, 1),
            python=sys.version.split()[0],
            corpus=corpora,
            settings=dict(train_windows=FLAGS.train_windows, train_seed=FLAGS.train_seed, batch=FLAGS.batch),
        )
        print(f"wrote {FLAGS.doc_data}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
