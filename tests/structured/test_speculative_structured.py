"""Structured output with speculative decoding (n-gram drafts and a draft model): every verify row of a constrained
sequence samples under its grammar's mask, drafts the grammar refuses are cut (n-gram) or rejected (draft model),
and the constraint ends at the committed outputs. Greedy constrained outputs equal the masked full-forward reference
and the same engine without speculation; plain requests in the same batch keep their plain greedy tokens; nothing
compiles after warmup (the masked variant is warmed up with sampling_extras)."""

import json

import jsonschema  # comes with nbformat, in the test extra
import numpy as np
import pytest

from cbjax import LLMEngine, SamplingParams
from cbjax.core.speculation.speculator import grammar_prefix
from cbjax.core.structured_outputs import StructuredOutputs
from cbjax.model.hf_loader import load_hf_model
from cbjax.model.registry import packaged_model_path
from cbjax.model.tokenizer import Tokenizer
from cbjax.runner.speculation.constrained_verify import verify_masks
from cbjax.runner.speculation.verify_rows import pack_verify_rows
from cbjax.structured.compiler import compiler_for
from tests.helpers import drain, noisy_copy
from tests.structured.reference import allowed_tokens, constrained_greedy
from tests.structured.test_engine_structured import ENGINE, MAX_TOKENS, REQUESTS
from tests.structured.test_tinypy_json import EOS, SCHEMA

K = 3
PLAIN_TOKENS = 24


@pytest.fixture(scope="module")
def tinypy():
    return load_hf_model(packaged_model_path("tinypy"), dtype="float32")


@pytest.fixture(scope="module")
def reference(tinypy):
    """The masked greedy reference of REQUESTS, and the outputs of the engine without speculation."""
    engine = LLMEngine("tinypy", **ENGINE)
    tok = engine.tokenizer
    compiler = compiler_for(tok, tinypy.cfg.vocab_size, [EOS])
    prompts = [tok.encode(p) for p, _ in REQUESTS]
    constraints = [None if spec is None else compiler.constraint(spec) for _, spec in REQUESTS]
    want = constrained_greedy(tinypy, prompts, constraints, MAX_TOKENS, EOS)
    want = [w if spec is not None else w[:PLAIN_TOKENS] for w, (_, spec) in zip(want, REQUESTS)]
    return want, run_requests(engine), run_sampled(engine)


def run_requests(engine) -> list[list[int]]:
    for i, (prompt, spec) in enumerate(REQUESTS):
        tokens = MAX_TOKENS if spec is not None else PLAIN_TOKENS
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=tokens, temperature=0.0, structured=spec))
    done = drain(engine)
    assert all(done[str(i)].error is None for i in range(len(REQUESTS)))
    return [done[str(i)].outputs[0].token_ids for i in range(len(REQUESTS))]


SAMPLED_PROMPTS = ["config = ", 'person = {"name": ', "# a user record as JSON\nuser = ", "x = "]


def run_sampled(engine) -> list[list[int]]:
    """Seeded sampled requests under the JSON schema: each output parses and validates."""
    spec = StructuredOutputs(json=SCHEMA)
    for i, prompt in enumerate(SAMPLED_PROMPTS):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=100 + i, structured=spec)
        engine.add_request(f"s{i}", prompt, params)
    done = drain(engine)
    outs = [done[f"s{i}"].outputs[0] for i in range(len(SAMPLED_PROMPTS))]
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    return [out.token_ids for out in outs]


def speculative_engine(tinypy, method: str):
    if method == "ngram":
        spec = dict(method="ngram", num_speculative_tokens=K, prompt_lookup_min=1)
    else:  # a noisy copy of the target: drafts accepted often, rejected often, and refused by the grammar often
        spec = dict(method="draft", draft_model=noisy_copy(tinypy, 0.3, seed=1), num_speculative_tokens=K)
    return LLMEngine("tinypy", speculative_config=spec, sampling_extras=True, **dict(ENGINE, warmup="full"))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_constrained_outputs_with_drafts_equal_the_masked_reference(tinypy, reference, method):
    want, without, sampled_without = reference
    engine = speculative_engine(tinypy, method)
    engine.wait_until_warm()
    compiles = engine.num_compiles
    got = run_requests(engine)
    assert got == want == without  # constrained: the masked reference; plain: the plain greedy tokens
    sampled = run_sampled(engine)  # (sampled rows verify against the masked target distribution)
    if method == "ngram":  # sample-and-match draws each row's token as a step without drafts would: same tokens
        assert sampled == sampled_without
    tok = engine.tokenizer
    for i in (0, 2):
        jsonschema.validate(json.loads(tok.decode(got[i])), SCHEMA)
    spec = engine.scheduler.speculator
    assert engine.runner.constrained_verify.num_steps > 0  # the masked variant verified drafts
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # drafts both accepted and rejected
    assert engine.num_compiles == compiles, "compiled after warmup"
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_pages


class RefusedDrafts:
    """Proposes tokens the JSON grammar never allows at the start of an object ('#' and the like) after one
    plausible draft: n-gram drafts the grammar refuses."""

    def propose(self, context, k):
        return [int(context[-1])] + [3] * (k - 1)


def test_drafts_the_grammar_refuses_are_cut_and_the_output_is_unchanged(tinypy, reference):
    want = reference[0]
    engine = speculative_engine(tinypy, "ngram")
    engine.scheduler.speculator.proposer = RefusedDrafts()
    assert run_requests(engine) == want


@pytest.fixture(scope="module")
def json_constraint(tinypy):
    tok = Tokenizer.from_dir(packaged_model_path("tinypy"))
    compiler = compiler_for(tok, tinypy.cfg.vocab_size, [EOS])
    return tok, lambda: compiler.constraint(StructuredOutputs(json=SCHEMA))


def test_grammar_prefix_cuts_at_the_first_refused_draft_and_rolls_back(json_constraint, tinypy):
    tok, make = json_constraint
    V = tinypy.cfg.vocab_size
    c = make()
    good = tok.encode('{"name"', add_special_tokens=False)
    before = allowed_tokens(c, V)
    assert grammar_prefix(c, good + tok.encode("#", add_special_tokens=False) + good) == good
    assert c.num_accepted == 0 and (allowed_tokens(c, V) == before).all()  # rolled back to the committed state


class _Seq:
    def __init__(self, constraint):
        self.request = type("R", (), {"constraint": constraint})()
        self.samples_token = True


def test_verify_masks_follow_the_drafts_and_stop_at_a_refused_one(json_constraint, tinypy):
    """Row i's mask is the grammar's after drafts[:i]; a refused draft's row still gets its mask (it rejects the
    draft), the rows after it stay all-ones; an unconstrained slot's rows stay all-ones; nothing is left accepted."""
    tok, make = json_constraint
    V = tinypy.cfg.vocab_size
    c = make()
    drafts = tok.encode('{"n#', add_special_tokens=False)  # '{' and '"' pass; the grammar refuses 'n' or '#'
    d = len(drafts)
    tokens = np.asarray([7] + drafts + [7], np.int32)  # slot 0: its own token and drafts; slot 1: one token
    v = pack_verify_rows(8, 2, np.asarray([d + 1, d + 2], np.int32), [d, 0], np.zeros(2, np.int32), tokens)
    masks = verify_masks([_Seq(c), _Seq(None)], [0, 1], v, v.row_draft, -(-V // 32))
    unpack = lambda row: np.unpackbits(row.view(np.uint8), bitorder="little")[:V].astype(bool)
    probe, refused = make(), None
    for i in range(d):
        expected = allowed_tokens(probe, V)
        assert (unpack(masks[i]) == expected).all(), i
        if not expected[drafts[i]]:
            refused = i
            break
        probe.accept([drafts[i]])
    assert refused is not None and refused >= 2  # the refused draft's row masks it out
    assert (masks[refused + 1 :] == -1).all()  # its slot's later rows (never reached), the unconstrained slot's
    assert c.num_accepted == 0


def test_speculation_still_refuses_the_other_extras_by_name(tinypy):
    engine = LLMEngine("tinypy", speculative_config=dict(method="ngram", num_speculative_tokens=2), **ENGINE)
    with pytest.raises(ValueError, match="logprobs, min_tokens are not supported with speculative decoding"):
        engine.add_request("a", [5, 6, 7], SamplingParams(logprobs=1, min_tokens=2))
    spec = StructuredOutputs(regex="[0-9]+")
    engine.add_request("b", "x = ", SamplingParams(max_tokens=4, temperature=0.0, structured=spec))
    assert drain(engine)["b"].outputs[0].text.isdigit()
