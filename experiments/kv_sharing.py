"""KV pages used with the prompt's pages shared by a request's samples against without, as the PagedAttention paper
measured for parallel sampling (its Figure on memory saving), for n = 2, 4 and 8.

  python -m experiments.kv_sharing                                           # prints the table's figures
  python -m experiments.kv_sharing --doc_data=docs/data/kv_sharing_DATE.json # also a data file (docs/memory.md)

A fixed workload on the simulator (runner="sim": the page accounting is the scheduler's, the same as the real
engine's; only the step times are the cost model's): --requests prompts of --prompt_min..--prompt_max tokens,
each generating --max_tokens tokens (the simulator's tokens never end a request early), all arriving at t = 0, in a
pool large enough that nothing is preempted, so the pages in use are what the sequences hold. With sharing: one
request with SamplingParams(n=n) per prompt (core/sequence_group.py: the prompt computed once, its pages shared,
the partly filled last one copied on write). Without: n requests of n = 1 per prompt with the prefix cache off,
each holding its own copy of the prompt. Recorded per run: the peak and the mean (over steps) of the pages in use,
the pages copied on write, and the steps. The view (experiments/doc_views.py, `kv_sharing`) computes the savings.

Beam search (--beam_widths): LLM.beam_search (cbjax/beam_search.py) on the real engine (test-tiny: it needs the
logprobs, which the simulator has not; the page counts do not depend on the model), --beam_requests of the prompts,
--beam_max_tokens rounds, EOS ignored, the prefix cache off. With sharing: the beams' pages forked (core/kv_fork.py:
a beam's children share its pages, the partly filled last one copied on write, a dead beam's pages freed); without
(`share_pages=False`): each round's requests compute and hold their whole contexts. Its pages in use are counted
as each step is dispatched (a round's one-token requests have left by the time the step's record is taken).
"""

import os

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("requests", 32, "prompts in the workload")
flags.DEFINE_integer("prompt_min", 64, "shortest prompt (tokens)")
flags.DEFINE_integer("prompt_max", 512, "longest prompt (tokens)")
flags.DEFINE_integer("max_tokens", 128, "tokens each sample generates")
flags.DEFINE_integer("page_size", 16, "tokens per KV page")
flags.DEFINE_integer("seed", 0, "workload seed")
flags.DEFINE_list("n", ["2", "4", "8"], "samples per prompt")
flags.DEFINE_list("beam_widths", ["2", "4", "8"], "beam widths (empty: no beam search rows)")
flags.DEFINE_integer("beam_requests", 8, "prompts of the beam search rows (the workload's first ones)")
flags.DEFINE_integer("beam_max_tokens", 32, "tokens each beam search generates")
flags.DEFINE_string("doc_data", None, "also write the runs to this data file (cbjax/bench/doc_data.py)")


def workload(requests: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, int(rng.integers(lo, hi + 1))).tolist() for _ in range(requests)]


def measure(prompts: list[list[int]], n: int, sharing: bool, max_tokens: int, page_size: int) -> dict:
    """One run: the workload with n samples per prompt, shared (one request of n) or not (n requests of 1)."""
    from cbjax import LLMEngine, SamplingParams

    seqs = len(prompts) * n
    longest = max(len(p) for p in prompts) + max_tokens
    engine = LLMEngine(
        "llama-tiny",
        runner="sim",
        sim_accelerator="h200",
        max_num_seqs=seqs,
        max_num_batched_tokens=8192,
        page_size=page_size,
        max_model_len=-(-longest // page_size) * page_size,
        num_pages=seqs * -(-longest // page_size),  # every sample's whole context at once: nothing is preempted
        enable_prefix_caching=False,
    )
    params = SamplingParams(n=n if sharing else 1, max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=1)
    for i, prompt in enumerate(prompts):
        for k in range(1 if sharing else n):
            engine.add_request(f"{i}.{k}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    used = [s["kv_pages_used"] for s in engine.step_records]
    sched = engine.scheduler
    assert sched.num_preemptions == 0 and sched.pool.num_free == sched.pool.num_pages
    return dict(
        workload="parallel sampling",
        n=n,
        sharing=sharing,
        peak_pages=max(used),
        mean_pages=float(np.mean(used)),
        page_copies=engine.runner.num_copied_pages,
        steps=len(used),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=seqs * max_tokens,
    )


def measure_beam(prompts: list[list[int]], width: int, sharing: bool, max_tokens: int, page_size: int) -> dict:
    """One beam search over the prompts on the real engine, with the beams' pages forked (sharing) or without."""
    from cbjax import LLM, BeamSearchParams
    from cbjax.beam_search import beam_search

    longest = max(len(p) for p in prompts) + max_tokens
    seqs = len(prompts) * 2 * width  # a round's requests: every live beam of every prompt
    llm = LLM(
        "test-tiny",
        max_num_seqs=seqs,
        max_num_batched_tokens=8192,
        page_size=page_size,
        max_model_len=-(-longest // page_size) * page_size,
        num_pages=seqs * -(-longest // page_size),
        enable_prefix_caching=False,
        sampling_extras=True,
        warmup="none",
    )
    # A round's requests finish in the step that computes them, so the step records (taken after the update) see
    # their pages freed: count the pages in use as each step is dispatched instead.
    pool, used = llm.engine.scheduler.pool, []
    llm.engine.runner.on_dispatch = lambda handle: used.append(pool.num_used)
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    beam_search(llm, prompts, params, share_pages=sharing)
    assert llm.engine.scheduler.num_preemptions == 0
    return dict(
        workload="beam search",
        n=width,
        sharing=sharing,
        peak_pages=max(used),
        mean_pages=float(np.mean(used)),
        page_copies=llm.engine.runner.page_copier.num_copied,
        steps=len(used),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=len(prompts) * width * max_tokens,
    )


def main(argv):
    del argv
    load_before = round(os.getloadavg()[0], 2)
    prompts = workload(FLAGS.requests, FLAGS.prompt_min, FLAGS.prompt_max, FLAGS.seed)
    runs = []
    for n in (int(x) for x in FLAGS.n):
        for sharing in (False, True):
            run = measure(prompts, n, sharing, FLAGS.max_tokens, FLAGS.page_size)
            runs.append(run)
            print(run)
    beam_prompts = prompts[: FLAGS.beam_requests]
    for width in (int(x) for x in FLAGS.beam_widths):
        for sharing in (False, True):
            run = measure_beam(beam_prompts, width, sharing, FLAGS.beam_max_tokens, FLAGS.page_size)
            runs.append(run)
            print(run)
    if FLAGS.doc_data:
        from experiments.quantization import write_data

        options = dict(
            requests=FLAGS.requests,
            prompt_tokens=[FLAGS.prompt_min, FLAGS.prompt_max],
            max_tokens=FLAGS.max_tokens,
            page_size=FLAGS.page_size,
            seed=FLAGS.seed,
            model="llama-tiny",
            runner="sim (h200 roofline)",
            beam_search=dict(
                requests=FLAGS.beam_requests, max_tokens=FLAGS.beam_max_tokens, model="test-tiny", runner="real (cpu)"
            ),
        )
        what = (
            "KV pages in use with the prompt's pages shared by a request's n samples, against n separate requests; "
            "and by beam search's beams forked, against beams that compute their own contexts"
        )
        write_data(FLAGS.doc_data, "kv_sharing", what, runs, load_before, options)


if __name__ == "__main__":
    app.run(main)
