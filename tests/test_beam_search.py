"""Beam search (cbjax/beam_search.py) against a plain beam search over the full-sequence forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLM, BeamSearchParams, SamplingParams
from cbjax.beam_search import BeamSearchSequence, beam_search_score


@pytest.fixture(scope="module")
def llm():
    return LLM("test-tiny", enable_prefix_caching=True, page_size=4, max_num_seqs=16, sampling_extras=True)


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


@pytest.mark.parametrize("width", [1, 3])
def test_greedy_beam_search_equals_the_reference(llm, width):
    engine = llm.engine
    prompts = [[5, 9, 2, 7, 1, 3], [11, 4, 8]]
    params = BeamSearchParams(beam_width=width, max_tokens=6, ignore_eos=True)
    outputs = llm.beam_search(prompts, params)
    eos = engine.model_config.eos_token_id
    for prompt, out in zip(prompts, outputs):
        ref = reference_beam_search(engine.model, prompt, width, 6, eos, ignore_eos=True)
        assert [b.tokens for b in out.sequences] == [t for t, _ in ref]
        np.testing.assert_allclose([b.cum_logprob for b in out.sequences], [c for _, c in ref], atol=2e-4)
    # Width 1 is greedy decoding.
    if width == 1:
        greedy = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert [o.sequences[0].output_token_ids for o in outputs] == [g.outputs[0].token_ids for g in greedy]


def test_beams_share_their_prefix_pages(llm):
    """With the prefix cache, a round's beams find their common prefix's pages computed."""
    pool = llm.engine.scheduler.pool
    hits = pool.hit_tokens
    llm.beam_search([[3, 1, 4, 1, 5, 9, 2, 6, 5]], BeamSearchParams(beam_width=4, max_tokens=4, ignore_eos=True))
    assert pool.hit_tokens - hits >= 3 * 4 * 8  # rounds 2..4: each of 4 beams found the prompt's 2 full pages


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
