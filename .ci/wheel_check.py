"""Checks an install of cbjax as a user gets it (.ci/check_wheel runs it): the C++ CPU kernels build from the
installed files and `auto` chooses them, and a short greedy generate gives known tokens.

  python .ci/wheel_check.py --write tokens.json                   # the editable install: the reference tokens
  XDG_CACHE_HOME=$(mktemp -d) python wheel_check.py --expect tokens.json --outside SRC --fresh_cache
                                                                  # the wheel's venv, from a folder outside SRC

--outside SRC: cbjax and kernels_pallas must be imported from this interpreter's prefix, not from the source tree
SRC. --fresh_cache: $XDG_CACHE_HOME must hold no kernel library yet, so the one loaded is the one the wheel carries
(built at install time, setup.py) or built now, from the installed sources (a library cached from the source tree
has the same key and would hide a missing file).
Prints one line saying what it checked; exits non-zero, naming the failure, otherwise.
"""

import argparse
import json
import os
import pathlib
import sys
import time

PROMPT_LENS = (7, 20, 33)  # a mix of prefill chunks and decodes in the engine's steps
MAX_TOKENS = 12


def fail(message: str) -> None:
    sys.exit(f"wheel check FAILED: {message}")


def check_imported_from(outside: pathlib.Path) -> None:
    import cbjax
    import kernels_pallas

    for module in (cbjax, kernels_pallas):
        where = pathlib.Path(module.__file__).resolve()
        if where.is_relative_to(outside) or not where.is_relative_to(pathlib.Path(sys.prefix).resolve()):
            fail(f"{module.__name__} imported from {where}, not from the install in {sys.prefix}")


def kernel_libraries(cache: pathlib.Path) -> list[pathlib.Path]:
    return sorted((cache / "cbjax" / "kernels").glob("cpu_kernels-*.so"))


def check_kernels(fresh_cache: bool) -> dict:
    """The library built (now, from the installed files, with fresh_cache) and every kernel that the auto table
    takes for this build chosen by the engine's `auto` resolution: never a fallback."""
    from kernels_pallas.cpu import auto, library

    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    if fresh_cache and kernel_libraries(cache):
        fail(f"--fresh_cache, but {cache} already holds a kernel library")
    missing = [str(f) for f in library.SOURCES if not f.is_file()]
    if missing:
        fail(f"kernel sources missing from the install: {missing}")
    start = time.perf_counter()
    if library.attention_target() is None:
        fail(f"the CPU kernels are unavailable: {library.unavailable_reason()}")
    seconds = time.perf_counter() - start
    # Built at install time into the package (setup.py); with --outside, the package is the install's.
    prebuilt = library.library_path().parent == library.PREBUILT_DIR
    if fresh_cache and not prebuilt and not kernel_libraries(cache):
        fail(f"no kernel library was built into {cache}, and the install carries none")
    from cbjax.model import get_model_config, init_model
    from cbjax.model.linear_impl import resolve_cpu_matmul
    from kernels_pallas.xla_attention import resolve_decode_impl, resolve_prefill_impl

    chosen = {
        "decode_attention": resolve_decode_impl("auto") == "ffi",
        "prefill_attention": resolve_prefill_impl("auto") == "ffi",
        "matmul": resolve_cpu_matmul("auto", init_model(get_model_config("llama-tiny"), seed=0)) == "packed",
    }
    kind = auto.build_kind()
    for kernel, taken in chosen.items():
        if taken != (kernel in auto.AUTO_TAKES[kind]):
            fail(f"auto {'took' if taken else 'did not take'} the C++ {kernel} on the {kind} build")
    if not any(chosen.values()):
        fail("auto chose no C++ kernel")
    return dict(build=kind, build_s=round(seconds, 1), chosen=sorted(k for k, v in chosen.items() if v))


def greedy_tokens() -> list[list[int]]:
    import numpy as np

    from cbjax import LLM, SamplingParams
    from cbjax.model import get_model_config

    llm = LLM("llama-tiny", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, warmup="none")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, get_model_config("llama-tiny").vocab_size, n).tolist() for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=pathlib.Path, help="write the greedy tokens here (the reference)")
    parser.add_argument("--expect", type=pathlib.Path, help="the greedy tokens must equal this file's")
    parser.add_argument("--outside", type=pathlib.Path, help="the source tree the install must not import from")
    parser.add_argument("--fresh_cache", action="store_true", help="the kernel library must be built now")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for var in ("CBJAX_DECODE_ATTENTION", "CBJAX_PREFILL_ATTENTION", "CBJAX_MATMUL", "CBJAX_CPU_BUILD"):
        os.environ.pop(var, None)  # `auto` everywhere, the default build: what a user gets
    if args.outside:
        check_imported_from(args.outside.resolve())
    kernels = check_kernels(args.fresh_cache)
    tokens = greedy_tokens()
    if args.write:
        args.write.write_text(json.dumps(tokens))
    if args.expect:
        want = json.loads(args.expect.read_text())
        if tokens != want:
            fail(f"greedy tokens differ from {args.expect}: {tokens} != {want}")
    import cbjax

    print(
        f"wheel check: cbjax from {pathlib.Path(cbjax.__file__).parent}; C++ kernels ({kernels['build']} build, "
        f"{kernels['build_s']} s to build or load) chosen for {', '.join(kernels['chosen'])}; "
        f"{len(tokens)} greedy generations of {MAX_TOKENS} tokens"
        + (f" equal {args.expect.name}'s" if args.expect else f" written to {args.write}" if args.write else "")
    )


if __name__ == "__main__":
    main()
