"""Beam search (cbjax/beam_search.py) against a plain beam search over the full-sequence forward, with the beams'
pages forked (core/kv_fork.py) and without; the forks share pages, copy the partly filled one on write, and leak
nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLM, BeamSearchParams, SamplingParams
from cbjax.beam_search import BeamSearchSequence, beam_search, beam_search_score


@pytest.fixture(scope="module")
def llm():
    # No prefix cache: whatever the beams share, they share by forking.
    return LLM("test-tiny", enable_prefix_caching=False, page_size=4, max_num_seqs=16, sampling_extras=True)


def reference_beam_search(model, prompt, width, max_tokens, eos, length_penalty=1.0, ignore_eos=False):
    """The algorithm written plainly: every beam's top 2W tokens of log_softmax(full forward) each round."""
    forward = jax.jit(model.forward_full)
    live, done = [(list(prompt), 0.0)], []
    score = lambda t, c: c / ((len(t) - (1 if t[-1] == eos else 0)) ** length_penalty)
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            lp = np.asarray(jax.nn.log_softmax(forward(jnp.asarray([tokens]))[0, -1].astype(jnp.float32)))
            top = np.argsort(-lp, kind="stable")[: 2 * width]
            for t in top:
                child = (tokens + [int(t)], cum + float(lp[t]))
                (done if int(t) == eos and not ignore_eos else candidates).append(child)
        live = sorted(candidates, key=lambda b: score(*b), reverse=True)[:width]
        if not live:
            break
    return sorted(done + live, key=lambda b: score(*b), reverse=True)[:width]


@pytest.mark.parametrize("width,share_pages", [(1, True), (3, True), (3, False)])
def test_greedy_beam_search_equals_the_reference(llm, width, share_pages):
    engine = llm.engine
    prompts = [[5, 9, 2, 7, 1, 3], [11, 4, 8]]
    params = BeamSearchParams(beam_width=width, max_tokens=6, ignore_eos=True)
    outputs = beam_search(llm, prompts, params, share_pages=share_pages)
    eos = engine.model_config.eos_token_id
    for prompt, out in zip(prompts, outputs):
        ref = reference_beam_search(engine.model, prompt, width, 6, eos, ignore_eos=True)
        assert [b.tokens for b in out.sequences] == [t for t, _ in ref]
        np.testing.assert_allclose([b.cum_logprob for b in out.sequences], [c for _, c in ref], atol=2e-4)
    # Width 1 is greedy decoding.
    if width == 1:
        greedy = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert [o.sequences[0].output_token_ids for o in outputs] == [g.outputs[0].token_ids for g in greedy]


def test_beams_fork_their_pages_and_free_them_as_they_die(llm):
    """A 9-token prompt in pages of 4, width 4, 4 rounds: with forking, the pages in use at each step's dispatch
    stay below those of beams that compute their own contexts; the partly filled last page is copied on write; the
    results are the same; nothing is left held or leaked."""
    engine = llm.engine
    pool, copier = engine.scheduler.pool, engine.runner.page_copier
    prompt, params = [3, 1, 4, 1, 5, 9, 2, 6, 5], BeamSearchParams(beam_width=4, max_tokens=4, ignore_eos=True)
    used, beams = {}, {}
    for share in (False, True):
        used[share], copied = [], copier.num_copied
        engine.runner.on_dispatch = lambda handle, share=share: used[share].append(pool.num_used)
        try:
            out = beam_search(llm, [prompt], params, share_pages=share)
        finally:
            engine.runner.on_dispatch = None
        copies = copier.num_copied - copied
        assert pool.num_free == pool.num_pages and engine.scheduler.kv_handoff is None
        pool.check_consistent()
        beams[share] = [b.tokens for b in out[0].sequences]
        if share:
            assert copies > 0, "children writing into their parent's partly filled page copy it"
        else:
            assert copies == 0
    assert beams[True] == beams[False]
    # Round 1 is the prompt alone (3 pages, one request). Rounds 2-4: 4 beams of 10-12 tokens (3 pages each) hold
    # 12 pages without sharing; forked, they share the prompt's 2 full pages.
    assert used[False][0] == used[True][0] == 3
    assert max(used[True]) < max(used[False]) == 12, used


def test_score_and_bad_params():
    b = BeamSearchSequence([1, 2, 3, 0], 2, cum_logprob=-6.0)
    assert beam_search_score(b, eos_token_id=0, length_penalty=1.0) == -2.0
    assert beam_search_score(b, eos_token_id=None, length_penalty=1.0) == -1.5
    for bad in (
        dict(beam_width=0, max_tokens=1),
        dict(beam_width=2, max_tokens=0),
        dict(beam_width=2, max_tokens=1, temperature=-1),
    ):
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)


def test_a_beam_width_over_max_logprobs_is_refused(llm):
    with pytest.raises(ValueError, match="logprobs"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=11, max_tokens=2))
