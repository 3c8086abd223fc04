"""int8 KV cache on the packaged tinypy: held-out loss, greedy agreement, KV bytes and tokens/s against float32 KV.

  python -m experiments.kv_quantization                    # every held-out window; a few minutes on 2 CPU cores
  python -m experiments.kv_quantization --windows=16 --repeats=1
  python -m experiments.kv_quantization --doc_data=docs/data/kv_quantization_DATE.json   # also a data file

The same held-out windows and prompts as experiments/quantization.py (int8 weights). The loss is the full
forward's with K and V rounded through the cache (Llama.forward_full's kv_round_trip), which is what the engine
computes: tests/test_int8_kv_engine.py checks the engine's greedy tokens equal that oracle's. Two scale layouts:
- per token and kv head (kernels_pallas/kv_quant.py, what the engine stores);
- per page and kv head (one scale over a page's G tokens x H, computed with the whole page known: the best a
  per-page scheme could do, without the re-quantization it needs while a page fills during decode).
Agreement and throughput run the engine: float32-KV greedy continuations, teacher-forced through the int8 oracle;
tokens/s of LLM.generate with each cache, interleaved (A B, B A, ...), median of --repeats. --doc_data writes a data
file for the docs (cbjax/bench/doc_data.py): one run per KV variant with its one-shot figures (kind "quality") and
one per (variant, round) of throughput (kind "throughput"), as experiments/quantization.py does.
"""

import os
import statistics

import jax.numpy as jnp
from absl import app, flags

from experiments.quantization import (
    PROMPT_LEN,
    WINDOW,
    heldout_tokens,
    interleaved_rates,
    load_average,
    mean_loss,
    settings,
    teacher_forced_agreement,
    write_data,
)
from experiments.quantization import define_flags as define_quantization_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """--windows, --prompts, --max_tokens, --repeats, --doc_data (experiments.quantization's) and --page_size."""
    define_quantization_flags()
    flags.DEFINE_integer("page_size", 16, "tokens per page, for the per-page scale variant")


def per_page_round_trip(page_size: int):
    """int8 with one scale per (page of page_size positions, kv head): x [B, S, K, H]."""

    def round_trip(x):
        B, S, K, H = x.shape
        pad = -S % page_size
        xf = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
        pages = xf.reshape(B, -1, page_size, K, H)
        scale = jnp.max(jnp.abs(pages), axis=(2, 4), keepdims=True) / 127.0
        q = jnp.clip(jnp.round(pages / jnp.where(scale > 0, scale, 1.0)), -127, 127)
        return (q * scale).reshape(B, -1, K, H)[:, :S].astype(x.dtype)

    return round_trip


def main(argv):
    del argv
    from cbjax import LLM, SamplingParams
    from cbjax.model.llama import kv_cache_bytes_per_page
    from kernels_pallas import kv_quant

    load_before = load_average()
    opts = dict(warmup="full", num_pages=512)  # the same pool in pages: the comparison is of the cache's numbers
    f32 = LLM("tinypy", **opts)
    int8 = LLM("tinypy", kv_cache_dtype="int8", **opts)
    warm = {llm: llm.engine.num_compiles for llm in (f32, int8)}
    model = f32.engine.model
    tokens = heldout_tokens(f32.engine.tokenizer)
    windows = tokens[: len(tokens) // WINDOW * WINDOW].reshape(-1, WINDOW)
    if FLAGS.windows:
        windows = windows[: FLAGS.windows]
    loss = {
        "float32": mean_loss(model, windows),
        "int8 per token": mean_loss(model, windows, kv_round_trip=kv_quant.round_trip),
        "int8 per page": mean_loss(model, windows, kv_round_trip=per_page_round_trip(FLAGS.page_size)),
    }

    prompts = [w[:PROMPT_LEN].tolist() for w in windows[: FLAGS.prompts]]
    sp = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in f32.generate(prompts, sp)]
    got = [o.outputs[0].token_ids for o in int8.generate(prompts, sp)]
    agreement = teacher_forced_agreement(model, prompts, ref, kv_round_trip=kv_quant.round_trip)

    throughput = interleaved_rates({"float32": f32, "int8": int8}, prompts, sp, FLAGS.repeats)
    rates = {name: [r["output_tok_per_s"] for r in throughput if r["variant"] == name] for name in ("float32", "int8")}
    cfg = f32.engine.model_config
    page = {dt: kv_cache_bytes_per_page(cfg, f32.engine.config.cache.page_size, dt) for dt in ("auto", "int8")}

    print(f"held-out windows: {len(windows)} x {WINDOW} tokens; prompts: {len(prompts)} x {PROMPT_LEN} tokens")
    for name, value in loss.items():
        print(f"loss (nats/token), KV {name}: {value:.4f}  delta {value - loss['float32']:+.4f}")
    print(
        f"greedy agreement, int8-KV oracle teacher-forced on float32-KV engine tokens: {agreement:.1%}; "
        f"identical continuations (engines): {sum(a == b for a, b in zip(ref, got))} of {len(ref)}"
    )
    print(
        f"KV bytes per page of {f32.engine.config.cache.page_size} tokens (all layers): float32 {page['auto']:,}  "
        f"int8 {page['int8']:,} (scales included)  ratio {page['int8'] / page['auto']:.3f}"
    )
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"output tok/s (median of {FLAGS.repeats}): float32 KV {med['float32']:.0f}  int8 KV {med['int8']:.0f}  "
        f"ratio {med['int8'] / med['float32']:.2f}  (runs: {[round(r) for r in rates['float32']]}, "
        f"{[round(r) for r in rates['int8']]})"
    )
    after = [llm.engine.num_compiles - warm[llm] for llm in (f32, int8)]
    print(f"engine compiles after warmup: float32 KV {after[0]}, int8 KV {after[1]}")
    print("load average: " + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    if FLAGS.doc_data:
        identical = sum(a == b for a, b in zip(ref, got))
        quality = [
            dict(kind="quality", variant="float32", loss=loss["float32"], page_bytes=page["auto"],
                 compiles_after_warmup=after[0]),
            dict(kind="quality", variant="int8 per token", loss=loss["int8 per token"], agreement=agreement,
                 identical=identical, page_bytes=page["int8"], compiles_after_warmup=after[1]),
            dict(kind="quality", variant="int8 per page", loss=loss["int8 per page"]),
        ]  # fmt: skip
        for r in throughput:  # the engine's int8 cache is the per-token layout
            r["variant"] = "int8 per token" if r["variant"] == "int8" else r["variant"]
        write_data(
            FLAGS.doc_data, "kv_quantization", "int8 KV pages against float32 on tinypy: held-out loss, greedy "
            "agreement, KV bytes per page (one-shot, deterministic) and LLM.generate tokens/s (interleaved rounds)",
            quality + throughput, load_before,
            dict(settings(), continuations=len(ref), page_size=f32.engine.config.cache.page_size, num_pages=512),
        )  # fmt: skip


if __name__ == "__main__":
    define_flags()
    app.run(main)
