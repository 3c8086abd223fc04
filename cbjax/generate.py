"""Stream a completion from the command line, token by token, through the continuous-batching engine.

  python -m cbjax.generate --prompt "def fibonacci(n):"                       # the packaged model (tinypy)
  python -m cbjax.generate --model PATH --prompt "..." --temperature 0 --max_tokens 64

`--model` takes anything LLMEngine takes with a tokenizer: a packaged model's name or a Hugging Face checkpoint
directory. Nothing is downloaded.
"""

import argparse
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbjax.generate", description=__doc__.split("\n")[0])
    p.add_argument("--prompt", default="def fibonacci(n):", help="text to complete")
    p.add_argument("--model", default=None, help="packaged model name or checkpoint directory (default: tinypy)")
    p.add_argument("--max_tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top_p", type=float, default=0.95, help="nucleus sampling cut, in (0, 1]")
    p.add_argument("--top_k", type=int, default=-1, help="-1: no top-k cut")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--ignore_eos", action="store_true", help="keep generating after the end-of-text token")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the model's)")
    p.add_argument(
        "--max_model_len",
        type=int,
        default=None,
        help="prompt + output tokens (default: the model's context, at most 2048)",
    )
    return p.parse_args(argv)


def generate(args: argparse.Namespace, out=sys.stdout, err=sys.stderr) -> str:
    """Run one streamed request; writes the prompt and each text delta to `out` as it arrives. Returns the
    completion text."""
    from cbjax.core.sampling_params import SamplingParams
    from cbjax.engine import LLMEngine
    from cbjax.model.hf_loader import read_hf_config
    from cbjax.model.registry import resolve_checkpoint
    from cbjax.model.tokenizer import IncrementalDetokenizer

    t0 = time.perf_counter()
    checkpoint = resolve_checkpoint(args.model)
    if checkpoint is None:
        raise SystemExit(
            f"--model {args.model!r}: not a packaged model nor a checkpoint directory (a random "
            "named config has no tokenizer)"
        )
    max_len = args.max_model_len or min(read_hf_config(checkpoint[0]).max_position_embeddings, 2048)
    # One request: a single slot and KV pages for one sequence of max_len. Buckets compile on first use
    # (warmup=False): a prefill and a decode shape, not the whole table.
    page_size = 16
    engine = LLMEngine(
        args.model,
        dtype=args.dtype,
        max_num_seqs=1,
        max_num_batched_tokens=64,
        page_size=page_size,
        num_pages=-(-max_len // page_size),
        max_model_len=max_len,
        warmup=False,
    )
    tok = engine.tokenizer
    if tok is None:
        raise SystemExit(f"{checkpoint[0]}: this checkpoint has no tokenizer.json; text generation needs one")
    prompt_ids = tok.encode(args.prompt)
    max_tokens = min(args.max_tokens, max_len - len(prompt_ids))
    if max_tokens < args.max_tokens:
        print(f"[max_tokens cut to {max_tokens}: the model's context is {max_len} tokens]", file=err)
    params = SamplingParams(
        max_tokens=max(max_tokens, 1),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    try:
        engine.add_request("cli", prompt_ids, params)
    except ValueError as e:  # e.g. a prompt longer than the context: a message, not a traceback
        raise SystemExit(str(e)) from None
    detok = IncrementalDetokenizer(tok, prompt_ids)
    out.write(args.prompt)
    out.flush()
    t1 = time.perf_counter()
    n, reason = 0, None
    for o in engine.stream():
        c = o.outputs[0]
        n += len(c.new_token_ids)
        out.write(detok.add(c.new_token_ids))
        out.flush()
        reason = c.finish_reason or reason
    out.write(detok.flush() + "\n")
    dt = time.perf_counter() - t1
    print(
        f"[{n} tokens, finish_reason={reason}, {n / max(dt, 1e-9):.1f} tokens/s incl. compiles, load {t1 - t0:.1f}s]",
        file=err,
    )
    return detok.text


def main(argv=None) -> None:
    try:
        generate(parse_args(argv))
    except ValueError as e:  # a bad --model or option: the message, not a traceback
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
