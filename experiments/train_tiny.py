"""Train a small Llama on the Python standard library's sources and package it in cbjax/assets/<name>/.

  nice -n 10 python -m experiments.train_tiny --config=configs/train_tiny.py          # tinypy
  nice -n 10 python -m experiments.train_tiny --config=configs/train_tiny.py:draft    # tinypy-draft

The corpus is every machine's offline copy of the stdlib (sysconfig's `stdlib` path, tests excluded); the
tokenizer a byte-level BPE trained with `tokenizers`; the optimiser optax AdamW with warmup + cosine decay.
Checkpoints go through orbax every `checkpoint_every` steps, and a rerun resumes from the latest (same data order:
batches are drawn from a per-step seed). At the end (or when `time_budget_s` runs out) the model is exported in
Hugging Face format (config.json, model.safetensors in bf16, tokenizer.json, generation_config.json), the loss
curve is drawn, and samples are generated through the engine from the exported files.
"""

import json
import os
import pathlib
import sys
import sysconfig
import time

import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined only when it runs as the program: experiments/model_card.py and the tests import
    this module's corpus functions beside modules whose flags have the same names (--config)."""
    config_flags.DEFINE_config_file("config", "configs/train_tiny.py", "training config")
    flags.DEFINE_bool("export_only", False, "skip training: export the latest checkpoint")


EOT = "<|endoftext|>"  # separates files in training, starts every prompt, ends generation


# ---- corpus -------------------------------------------------------------------------------------------------------
def stdlib_files() -> list[str]:
    """Sorted .py files of the running Python's standard library, without site-packages and test suites (the
    tests are mostly data and generated cases, not the code we want the model to write)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return sorted(out)


def read_corpus(cfg) -> tuple[list[str], list[str]]:
    """(train texts, validation texts); every `val_every`-th file is held out."""
    train, val, total = [], [], 0
    for i, path in enumerate(stdlib_files()):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        (val if i % cfg.val_every == cfg.val_every - 1 else train).append(text)
        total += len(text)
        if cfg.corpus_max_mb and total > cfg.corpus_max_mb * 2**20:
            break
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int, max_mb: float):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Every encoded prompt starts with EOT, as every training file does: the model sees "start of a file".
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    budget, subset = max_mb * 2**20, []
    for t in texts:
        subset.append(t)
        budget -= len(t)
        if budget <= 0:
            break
    tok.train_from_iterator(subset, trainer)
    assert tok.token_to_id(EOT) == 0
    return tok


def encode_corpus(tok, texts: list[str]) -> np.ndarray:
    """One stream of uint16 ids: EOT file EOT file ... (the post-processor adds the leading EOT)."""
    ids = [e.ids for e in tok.encode_batch(texts)]
    return np.concatenate([np.asarray(i, np.uint16) for i in ids])


# ---- model and training step --------------------------------------------------------------------------------------
def model_config(cfg, vocab_size: int):
    from cbjax.model.config import ModelConfig

    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=cfg.seq_len,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        dtype="float32",
    )


def learning_rate(cfg, step: int, elapsed_s: float) -> float:
    """Linear warmup, then cosine decay to 10% over the run's progress, which is the larger of the step and the
    wall-clock fractions: on a shared CPU the speed is unknown in advance, and the decay must still finish."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = min(1.0, max(step / cfg.num_steps, elapsed_s / cfg.time_budget_s))
    return cfg.learning_rate * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * progress)))


def make_optimizer(cfg):
    """AdamW (decoupled weight decay) without the learning rate, which the train step applies (see
    learning_rate); no decay on norm gains (1-D params): pulling them to 0 only fights the loss."""
    import jax
    import optax

    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim > 1, params)

    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.scale_by_adam(b1=0.9, b2=0.95),
        optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
    )


def make_steps(graphdef, optimizer):
    import jax
    import optax
    from flax import nnx

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params).forward_full(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def train_step(params, opt_state, batch, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: -lr * u, updates)
        return optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads)

    return train_step, jax.jit(loss_fn)


def batch_at(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """Random windows of seq_len + 1 tokens, drawn from a per-step seed: a resumed run sees the same batches."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, batch_size)
    return np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)


# ---- export -------------------------------------------------------------------------------------------------------
def export(model, tok, out_dir: str, dtype: str) -> None:
    from cbjax.model.hf_loader import save_hf_model

    save_hf_model(model, out_dir, dtype=dtype)
    os.chmod(os.path.join(out_dir, "model.safetensors"), 0o644)  # safetensors writes 0600; it is package data
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    # For transformers' AutoTokenizer (cbjax itself reads tokenizer.json only).
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": EOT,
                "eos_token": EOT,
                "pad_token": EOT,
                "model_max_length": model.cfg.max_position_embeddings,
            },
            f,
            indent=2,
        )


def plot_loss(log: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(r["step"], r["loss"]) for r in log if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in log if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    ax.plot(*zip(*tr), lw=1, label="train")
    if va:
        ax.plot(*zip(*va), "o-", lw=1.5, ms=3, label="validation (held-out files)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def samples(out_dir: str, prompts, max_tokens: int) -> list[dict]:
    from cbjax import LLM, SamplingParams

    llm = LLM(out_dir, max_num_seqs=8, max_num_batched_tokens=64, page_size=16, num_pages=128)
    res = []
    for name, sp in [
        ("greedy", SamplingParams(max_tokens=max_tokens, temperature=0.0)),
        ("t=0.8 top_p=0.95 seed=0", SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=0)),
    ]:
        for prompt, out in zip(prompts, llm.generate(list(prompts), sp)):
            res.append(
                dict(
                    sampling=name,
                    prompt=prompt,
                    completion=out.outputs[0].text,
                    finish_reason=out.outputs[0].finish_reason,
                )
            )
    return res


# ---- main ---------------------------------------------------------------------------------------------------------
def main(argv):
    del argv
    cfg = FLAGS.config
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tokenizers import Tokenizer

    from cbjax.model.checkpoint import TrainCheckpointer, params_of, set_params
    from cbjax.model.llama import Llama

    work = os.path.join(cfg.work_dir, cfg.name)
    out_dir = cfg.out_dir or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cbjax", "assets", cfg.name
    )
    os.makedirs(work, exist_ok=True)
    t_setup = time.time()

    # Tokenizer and token cache: made once per work dir, so a resumed run trains on identical data.
    tok_file, cache = os.path.join(work, "tokenizer.json"), os.path.join(work, "tokens.npz")
    if not os.path.exists(cache):
        train_texts, val_texts = read_corpus(cfg)
        if cfg.tokenizer_from:
            tok = Tokenizer.from_file(cfg.tokenizer_from)
        else:
            tok = train_tokenizer(train_texts, cfg.vocab_size, cfg.tokenizer_train_mb)
        tok.save(tok_file)
        np.savez(
            cache,
            train=encode_corpus(tok, train_texts),
            val=encode_corpus(tok, val_texts),
            files=np.int64(len(train_texts) + len(val_texts)),
            chars=np.int64(sum(map(len, train_texts))),
        )
    tok = Tokenizer.from_file(tok_file)
    data = np.load(cache)
    train_tokens, val_tokens = data["train"], data["val"]
    logging.info(
        "corpus: %d files, %.1f M train tokens, %.2f M val tokens (%.2f chars/token); setup %.0fs",
        int(data["files"]),
        len(train_tokens) / 1e6,
        len(val_tokens) / 1e6,
        int(data["chars"]) / len(train_tokens),
        time.time() - t_setup,
    )

    mcfg = model_config(cfg, tok.get_vocab_size())
    model = Llama(mcfg, nnx.Rngs(cfg.seed))
    graphdef, _ = nnx.split(model)
    params = params_of(model)
    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(params)
    train_step, eval_loss = make_steps(graphdef, optimizer)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    logging.info("model: %s, %.2f M params", mcfg, n_params / 1e6)

    log_file = os.path.join(work, "log.jsonl")
    ckpt = TrainCheckpointer(os.path.join(work, "ckpt"), max_to_keep=2)
    step, elapsed = 0, 0.0
    if ckpt.latest_step() is not None:
        params, opt_state, step, extra = ckpt.restore(params, opt_state, {"elapsed_s": np.float64(0)})
        elapsed = float(extra["elapsed_s"])
        logging.info("resumed at step %d (%.0fs of training done)", step, elapsed)
    log = []
    if os.path.exists(log_file):
        log = [json.loads(line) for line in pathlib.Path(log_file).read_text().splitlines()]
    log = [r for r in log if r["step"] <= step]  # drop what was logged after the checkpoint we resume from

    val_batches = [
        jnp.asarray(batch_at(val_tokens, i, cfg.batch_size, cfg.seq_len, cfg.seed + 1)) for i in range(cfg.eval_batches)
    ]

    def validate():
        return float(np.mean([float(eval_loss(params, b)) for b in val_batches]))

    t_start = time.time() - elapsed
    while not FLAGS.export_only and step < cfg.num_steps and time.time() - t_start < cfg.time_budget_s:
        batch = jnp.asarray(batch_at(train_tokens, step, cfg.batch_size, cfg.seq_len, cfg.seed))
        lr = learning_rate(cfg, step, time.time() - t_start)
        params, opt_state, loss, gnorm = train_step(params, opt_state, batch, jnp.float32(lr))
        step += 1
        if step % cfg.log_every == 0 or step == 1:
            rec = dict(
                step=step,
                loss=float(loss),
                grad_norm=float(gnorm),
                lr=float(lr),
                time_s=round(time.time() - t_start, 1),
            )
            if step % cfg.eval_every == 0:
                rec["val_loss"] = validate()
            log.append(rec)
            logging.info("%s", rec)
        if step % cfg.checkpoint_every == 0:
            ckpt.save(step, params, opt_state, {"elapsed_s": np.float64(time.time() - t_start)})
            with open(log_file, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in log)
    train_s = time.time() - t_start
    if not FLAGS.export_only:
        if not log or log[-1]["step"] != step:
            log.append(dict(step=step, loss=float(loss), time_s=round(train_s, 1)))
        if "val_loss" not in log[-1]:  # the curve ends on a validation point
            log[-1]["val_loss"] = validate()
        ckpt.save(step, params, opt_state, {"elapsed_s": np.float64(train_s)})
        with open(log_file, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in log)
    ckpt.wait()
    ckpt.close()

    set_params(model, params)
    export(model, tok, out_dir, cfg.export_dtype)
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    title = (
        f"{cfg.name}: {n_params / 1e6:.2f}M params, {cfg.num_layers}x{cfg.hidden_size}, vocab "
        f"{mcfg.vocab_size}, ctx {cfg.seq_len}, {step} steps x {cfg.batch_size} seqs, {train_s / 60:.1f} min"
    )
    plot_loss(log, os.path.join(cfg.figure_dir, f"{cfg.name}_loss.png"), title)
    summary = dict(
        name=cfg.name,
        params=int(n_params),
        steps=step,
        train_s=round(train_s, 1),
        tokens_seen=step * cfg.batch_size * cfg.seq_len,
        train_tokens=len(train_tokens),
        val_tokens=len(val_tokens),
        first=log[0],
        last=log[-1],
        best_val=min((r["val_loss"] for r in log if "val_loss" in r), default=None),
        packaged_bytes=size,
        python=sys.version.split()[0],
        config=cfg.to_dict(),
    )
    summary["samples"] = samples(out_dir, list(cfg.sample_prompts), cfg.sample_tokens)
    with open(os.path.join(work, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for s in summary["samples"]:
        print(f"--- {s['sampling']} | {s['prompt']!r}\n{s['prompt']}{s['completion']}\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("samples", "config")}))


if __name__ == "__main__":
    define_flags()
    app.run(main)
