"""The sampling extras (cbjax/runner/extras_runner.py) against plain references over the full-sequence forward:
logprobs and prompt_logprobs equal its log-softmax; penalties, min_tokens, bad words, logit bias, logits
processors and a constraint's bitmask give the greedy tokens of a plain loop that applies the same rule to its
logits; all mixed with plain requests (whose tokens stay the oracle's), across chunked prefill and preemption, with
nothing compiled after warmup."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cbjax.engine as engine_module
from cbjax import LLMEngine, SamplingParams
from cbjax.core.structured_outputs import StructuredOutputs
from cbjax.model import get_model_config, init_model
from tests.helpers import greedy_reference

WIDTH = 160
OPTS = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=16, max_model_len=WIDTH, warmup="full")
TOL = 2e-4


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def forward(model):
    """tokens -> the full forward's logits [len, V] (float32, numpy), one sequence padded to WIDTH."""
    fwd = jax.jit(lambda t: model.forward_full(t)[0])

    def logits(tokens):
        padded = np.zeros((1, WIDTH), np.int32)
        padded[0, : len(tokens)] = tokens
        return np.asarray(fwd(jnp.asarray(padded)))[: len(tokens)]

    return logits


def log_softmax(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))


def rule_reference(forward, prompt, max_tokens, rule):
    """Greedy decoding where each step's logits (of the full forward) go through `rule(logits, outputs)` first."""
    out = []
    for _ in range(max_tokens):
        x = rule(forward(prompt + out)[-1].astype(np.float64), out)
        out.append(int(np.argmax(x)))
    return out


def prompts(n, seed, lo=20, hi=70):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def run(engine, requests):
    """Add (id, prompt, params) triples, run them to the end; {id: final RequestOutput}."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    return {o.request_id: o for o in engine.stream() if o.finished}


def rank_bounds(raw, t):
    """The rank of token t (1: the most likely) in raw logprobs, as an interval within float tolerance."""
    return 1 + int(np.sum(raw > raw[t] + TOL)), 1 + int(np.sum(raw > raw[t] - TOL))


def check_logprobs(forward, prompt, completion, k):
    """Each output's logprobs entry against the full forward over prompt + outputs (teacher forcing)."""
    tokens = completion.token_ids
    raw = log_softmax(forward(prompt + tokens)[len(prompt) - 1 : -1])
    assert len(completion.logprobs) == len(tokens)
    for i, (t, entry) in enumerate(zip(tokens, completion.logprobs)):
        assert next(iter(entry)) == t  # the chosen token first
        assert math.isclose(entry[t].logprob, raw[i, t], abs_tol=TOL)
        assert rank_bounds(raw[i], t)[0] <= entry[t].rank <= rank_bounds(raw[i], t)[1]
        top = np.argsort(-raw[i])[:k]
        assert len(entry) in (k, k + 1)
        for j, tid in enumerate(top):
            assert tid in entry and math.isclose(entry[tid].logprob, raw[i, tid], abs_tol=TOL)
            assert entry[tid].rank == j + 1 or tid == t
    assert math.isclose(completion.cumulative_logprob, sum(e[t].logprob for t, e in zip(tokens, completion.logprobs)))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_logprobs_and_prompt_logprobs_equal_the_full_forward(model, forward, mode):
    """Greedy and sampled requests with logprobs and prompt_logprobs mixed with plain ones, long prompts chunked, a
    pool small enough to preempt (by recompute or by swap); blocks of decode steps on for the plain rows."""
    ps = prompts(8, seed=3)
    ps[5] = ps[2]  # the same sampled request, with and without logprobs
    swap = dict(preemption_mode="swap", num_host_pages=64) if mode == "swap" else {}
    engine = LLMEngine(model, num_pages=14, sampling_extras=True, num_scheduler_steps=4, **OPTS, **swap)
    engine.wait_until_warm()
    compiles = engine.num_compiles
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    params = [
        SamplingParams(**greedy, logprobs=3, prompt_logprobs=2),
        SamplingParams(**greedy),
        SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True, logprobs=0),
        SamplingParams(**greedy, logprobs=20),
        SamplingParams(**greedy),
        SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True),  # #2 without logprobs
        SamplingParams(**greedy, prompt_logprobs=0),
        SamplingParams(**greedy),
    ]
    outs = run(engine, [(str(i), p, sp) for i, (p, sp) in enumerate(zip(ps, params))])
    assert engine.scheduler.num_preemptions > 0, "the small pool was meant to preempt"
    assert engine.runner.extras.num_extras_steps > 0
    assert engine.num_compiles == compiles, "compiled after warmup"
    greedy_ids = [i for i, sp in enumerate(params) if sp.temperature == 0]
    ref = greedy_reference(model, [ps[i] for i in greedy_ids], [12] * len(greedy_ids), width=WIDTH)
    for i, r in zip(greedy_ids, ref):
        assert outs[str(i)].outputs[0].token_ids == r, f"request {i} differs from the full forward"
    # A sampled request draws the same tokens with logprobs (extras sampler) as without (plain step).
    assert outs["2"].outputs[0].token_ids == outs["5"].outputs[0].token_ids
    for i, sp in enumerate(params):
        c = outs[str(i)].outputs[0]
        if sp.logprobs is None:
            assert c.logprobs is None and c.cumulative_logprob is None
        else:
            check_logprobs(forward, ps[i], c, sp.logprobs)
        got = outs[str(i)].prompt_logprobs
        if sp.prompt_logprobs is None:
            assert got is None
            continue
        raw = log_softmax(forward(ps[i]))
        assert got[0] is None and len(got) == len(ps[i])
        for j in range(1, len(ps[i])):
            t = ps[i][j]
            assert math.isclose(got[j][t].logprob, raw[j - 1, t], abs_tol=TOL)
            assert rank_bounds(raw[j - 1], t)[0] <= got[j][t].rank <= rank_bounds(raw[j - 1], t)[1]
            assert len(got[j]) in (sp.prompt_logprobs, sp.prompt_logprobs + 1)


def penalty_rule(prompt, p):
    """vLLM's penalties, plainly: repetition on tokens of the prompt or the output, then frequency and presence."""

    def rule(x, out):
        x = x.copy()
        for t in set(prompt) | set(out):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t in set(out):
            x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
        return x

    return rule


class LetterTokenizer:
    """Each character is the token of its code point (enough for bad_words in a model without a tokenizer)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


class EvenOnly:
    """A TokenConstraint allowing only even token ids; records what it accepted."""

    def __init__(self):
        self.accepted = []

    def fill_bitmask(self, row):
        row[:] = np.int32(0x55555555)

    def accept(self, tokens):
        assert all(t % 2 == 0 for t in tokens), tokens
        self.accepted += list(tokens)

    def rollback(self, n):
        del self.accepted[len(self.accepted) - n :]

    def is_finished(self):
        return False


@pytest.fixture(scope="module")
def rules_engine(model):
    engine = LLMEngine(model, num_pages=64, sampling_extras=True, max_logprobs=5, enable_prefix_caching=True, **OPTS)
    engine.wait_until_warm()
    return engine


def test_penalties_bans_biases_and_masks_equal_a_plain_reference(rules_engine, model, forward, monkeypatch):
    engine = rules_engine
    compiles = engine.num_compiles
    ps = prompts(9, seed=5)
    g = dict(max_tokens=10, temperature=0.0)
    plain = greedy_reference(model, ps, [10] * len(ps), width=WIDTH)
    eos = model.cfg.eos_token_id
    # Words of the plain outputs, so that banning them changes something.
    single, pair = chr(plain[2][3]), chr(plain[3][4]) + chr(plain[3][5])
    assert not single.isspace() and not pair[0].isspace()
    engine.tokenizer = LetterTokenizer()  # (bad_words are encoded with the engine's tokenizer)
    constraints = []

    def even_only(*args):  # the engine builds this instead of a grammar for params.structured
        constraints.append(EvenOnly())
        return constraints[-1]

    monkeypatch.setattr(engine_module, "request_constraint", even_only)
    processor = lambda out: {(7 * len(out) + 3) % 512: 4.0, plain[6][len(out)]: -math.inf}
    params = [
        SamplingParams(**g, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(**g, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7),
        SamplingParams(**g, ignore_eos=True, bad_words=(single,)),
        SamplingParams(**g, ignore_eos=True, bad_words=(pair,)),
        SamplingParams(**g, ignore_eos=True, logit_bias={plain[4][1]: -100, 17: 6.5}),
        SamplingParams(**g, min_tokens=6, stop_token_ids=(plain[5][2],)),
        SamplingParams(**g, ignore_eos=True, logits_processors=(processor,)),
        SamplingParams(**g, ignore_eos=True, structured=StructuredOutputs(regex="x")),
        SamplingParams(**g, ignore_eos=True),
    ]

    def bans(ids):
        def rule(x, out):
            x = x.copy()
            x[list(ids(out))] = -np.inf
            return x

        return rule

    def bias(x, out):
        x = x.copy()
        x[plain[4][1]] -= 100
        x[17] += 6.5
        return x

    def processed(x, out):
        x = x.copy()
        for t, b in processor(out).items():
            x[t] += b
        return x

    rules = [
        penalty_rule(ps[0], params[0]),
        penalty_rule(ps[1], params[1]),
        bans(lambda out: [ord(single)]),
        bans(lambda out: [ord(pair[1])] if out and out[-1] == ord(pair[0]) else []),
        bias,
        bans(lambda out: [eos, plain[5][2]] if len(out) < 6 else []),
        processed,
        lambda x, out: np.where(np.arange(x.shape[0]) % 2 == 0, x, -np.inf),
        lambda x, out: x,
    ]
    outs = run(engine, [(str(i), p, sp) for i, (p, sp) in enumerate(zip(ps, params))])
    assert engine.num_compiles == compiles, "compiled after warmup"
    for i, (p, rule) in enumerate(zip(ps, rules)):
        want = rule_reference(forward, p, 10, rule)
        got = outs[str(i)].outputs[0].token_ids
        if i == 5:  # stops at the stop id once min_tokens allow it
            cut = [j for j, t in enumerate(want) if t in (eos, plain[5][2])]
            want = want[: cut[0] + 1] if cut else want
            assert len(got) >= 6
        assert got == want, f"request {i}"
        assert i == 8 or i == 5 or got != plain[i], f"request {i}: the rule changed nothing, a weak test"
    assert constraints[0].accepted == outs["7"].outputs[0].token_ids


def test_prompt_logprobs_after_a_prefix_cache_hit(rules_engine, forward):
    """The prompt is scored whole (a forward of its own), so the pages the prefix cache served change nothing."""
    engine = rules_engine
    prompt = prompts(1, seed=11, lo=60, hi=61)[0]
    run(engine, [("first", prompt, SamplingParams(max_tokens=2))])
    hits = engine.scheduler.pool.hit_tokens
    outs = run(engine, [("again", prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))])
    assert engine.scheduler.pool.hit_tokens > hits, "meant to hit the prefix cache"
    raw = log_softmax(forward(prompt))
    got = outs["again"].prompt_logprobs
    assert got[0] is None
    assert all(math.isclose(got[j][prompt[j]].logprob, raw[j - 1, prompt[j]], abs_tol=TOL) for j in range(1, 60))


def test_bad_values_are_refused_and_the_engine_serves_on(rules_engine):
    engine = rules_engine
    bad = [
        (SamplingParams(logprobs=6), "max_logprobs"),
        (SamplingParams(prompt_logprobs=9), "max_logprobs"),
        (SamplingParams(logit_bias={512: 1.0}), "outside the vocabulary"),
        (SamplingParams(logit_bias={i: 1.0 for i in range(200)}), "more than"),
    ]
    for i, (sp, match) in enumerate(bad):
        with pytest.raises(ValueError, match=match):
            engine.add_request(f"bad{i}", [5, 6, 7], sp)
    outs = run(engine, [("ok", [5, 6, 7], SamplingParams(max_tokens=3, logprobs=5, presence_penalty=0.5))])
    assert len(outs["ok"].outputs[0].logprobs) == 3


def test_a_failing_logits_processor_aborts_only_its_request(rules_engine, model):
    engine = rules_engine
    compiles = engine.num_compiles
    g = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = run(
        engine,
        [
            ("bad-id", [5, 6, 7], SamplingParams(**g, logits_processors=(lambda out: {9999: 1.0},))),
            ("raises", [5, 6, 8], SamplingParams(**g, logits_processors=(lambda out: 1 / 0,))),
            ("plain", [5, 6, 9], SamplingParams(**g)),
            ("penalty", [5, 6, 9], SamplingParams(**g, presence_penalty=0.0001)),
        ],
    )
    assert outs["bad-id"].outputs[0].finish_reason == "abort" and "outside the vocabulary" in outs["bad-id"].error
    assert outs["raises"].outputs[0].finish_reason == "abort" and "ZeroDivisionError" in outs["raises"].error
    ref = greedy_reference(model, [[5, 6, 9]], [6], width=WIDTH)[0]
    assert outs["plain"].outputs[0].token_ids == ref == outs["penalty"].outputs[0].token_ids
    assert engine.num_compiles == compiles
    assert not engine.has_unfinished_requests()
    engine.scheduler.pool.check_consistent()


def test_speculation_refuses_extras(model):
    engine = LLMEngine(
        model, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, warmup="none", max_model_len=64
    )
    with pytest.raises(ValueError, match="speculative decoding"):
        engine.add_request("a", [5, 6, 7], SamplingParams(presence_penalty=1.0))


def test_the_simulator_refuses_logprobs_and_serves_penalties():
    engine = LLMEngine("llama-tiny", runner="sim", sim_accelerator="h200", max_model_len=256)
    for sp in (SamplingParams(logprobs=1), SamplingParams(prompt_logprobs=1)):
        with pytest.raises(ValueError, match="simulator"):
            engine.add_request("x", [5, 6, 7], sp)
    outs = run(engine, [("pen", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True, repetition_penalty=1.3))])
    assert len(outs["pen"].outputs[0].token_ids) == 4


class OnlyToken(EvenOnly):
    """A TokenConstraint allowing one token id (a grammar that is complete and allows only its end)."""

    def __init__(self, token):
        super().__init__()
        self.token = token

    def fill_bitmask(self, row):
        row[:] = 0
        row[self.token >> 5] = np.int32(np.uint32(1 << (self.token & 31)).view(np.int32))

    def accept(self, tokens):
        assert all(t == self.token for t in tokens), tokens
        self.accepted += list(tokens)


def test_a_constraint_that_allows_only_a_banned_token_wins_over_min_tokens(rules_engine, monkeypatch):
    """min_tokens bans the stop id, the constraint allows nothing else: the row samples what the constraint allows
    (the stop id, ending the output) instead of a token nothing allows."""
    stop = 5
    monkeypatch.setattr(engine_module, "request_constraint", lambda *args: OnlyToken(stop))
    only = StructuredOutputs(regex="x")  # (any spec: the patched engine builds OnlyToken for it)
    sp = SamplingParams(max_tokens=8, min_tokens=6, temperature=0.0, stop_token_ids=(stop,), structured=only)
    out = run(rules_engine, [("c", prompts(1, seed=3)[0], sp)])["c"]
    assert out.error is None and out.outputs[0].token_ids == [stop] and out.outputs[0].finish_reason == "stop"
