"""Stop strings in the Python API (vLLM's semantics): the text ends before the first stop string (or after it with
include_stop_str_in_output), the tokens after the one that completed it are dropped, finish_reason "stop" and
stop_reason the string; the same as cutting a plain generation's text, with asynchronous scheduling and blocks of
decode steps (LLM's default) or without; streamed text never shows a stop string or a split character.
Also bad_words -> token sequences (vLLM's rule)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.bad_words import bad_word_token_ids
from cbjax.model.registry import packaged_model_path
from cbjax.model.text_stream import TextStream
from cbjax.model.tokenizer import Tokenizer

TOK = Tokenizer.from_dir(packaged_model_path())
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=16, num_pages=64, warmup="none")
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n"]
MAX = 40


# ---- TextStream, on its own -----------------------------------------------------------------------------------
def _feed(text: str, **kw):
    """Feed `text`'s tokens one at a time; returns (streamed text, the stream, index of the stopping token)."""
    ids = TOK.encode(text, add_special_tokens=False)
    s = TextStream(TOK, [], **kw)
    sent = ""
    for k, t in enumerate(ids):
        hit = s.add([t])
        sent += s.delta(False)
        assert "\ufffd" not in sent  # never half a character
        if hit is not None:
            return sent + s.delta(True), s, k
    s.finish()
    return sent + s.delta(True), s, None


def test_the_text_ends_before_the_earliest_stop_even_across_tokens():
    text = "def add(a, b):\n    return a + b\n"
    for stop in (("return",), ("b\n", "add"), ("urn a",), (":\n",), ("zzz", "a + b")):
        out, s, _ = _feed(text, stop=stop)
        first = min(text.find(x) for x in stop if x in text)
        assert s.stopped and out == text[:first] == s.text, (stop, out)
        assert s.stop_reason == min((x for x in stop if x in text), key=text.find)


def test_include_stop_str_in_output_keeps_the_stop_and_cuts_after_it():
    text = "def add(a, b):\n    return a + b\n"
    out, s, _ = _feed(text, stop=("retu",), include_stop_str_in_output=True)
    assert out == text[: text.find("retu") + 4] and s.stop_reason == "retu"


def test_the_token_that_completes_the_stop_is_the_last_taken():
    text = "x = 1\ny = 2\nz = 3\n"
    ids = TOK.encode(text, add_special_tokens=False)
    s = TextStream(TOK, [], stop=("y = 2",))
    k = s.add(ids)  # all at once: the stream still finds the token
    want = next(j for j in range(len(ids)) if "y = 2" in TOK.decode(ids[: j + 1]))
    assert k == want and s.num_tokens == want + 1 and s.text == "x = 1\n"


def test_multibyte_characters_are_never_split_and_stops_may_hold_them():
    text = "s = 'héllo → 世界'  # ünïcode\n"
    ids = TOK.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) / 3  # byte-level pieces: some character spans several tokens
    out, s, _ = _feed(text)
    assert out == text and not s.stopped
    out, s, _ = _feed(text, stop=("世界",))
    assert out == text[: text.find("世界")] and s.stop_reason == "世界"
    out, s, _ = _feed(text, stop=("→ 世",), include_stop_str_in_output=True)
    assert out == text[: text.find("→ 世") + 3]


def test_held_back_text_is_sent_at_the_end_when_no_stop_comes():
    out, s, _ = _feed("x = 1  # ret", stop=("return",))
    assert out == "x = 1  # ret" and not s.stopped


def test_no_stop_before_min_tokens():
    text = "a = 1\na = 2\na = 3\n"
    ids = TOK.encode(text, add_special_tokens=False)
    first = next(j for j in range(len(ids)) if "a =" in TOK.decode(ids[: j + 1]))
    s = TextStream(TOK, [], stop=("a =",), min_tokens=first + 1)
    k = s.add(ids)
    assert k is not None and s.num_tokens > first + 1 and s.text == text[: text.find("a =", 1)]


def test_a_stop_token_does_not_show_its_text_unless_asked():
    ids = TOK.encode("x = 1\n", add_special_tokens=False)
    shown = TextStream(TOK, [], include_stop_str_in_output=True)
    hidden = TextStream(TOK, [])
    shown.add(ids, ends_with_stop_token=True)
    hidden.add(ids, ends_with_stop_token=True)
    shown.finish()
    hidden.finish()
    assert shown.text == "x = 1\n" and hidden.text == TOK.decode(ids[:-1]) and hidden.num_tokens == len(ids)


ALPHABET = "ab \né世→"  # multi-byte characters, which the byte-level tokenizer splits over several tokens


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st.text(ALPHABET, max_size=24),
    st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3),
    st.lists(st.integers(1, 4), min_size=1, max_size=8),
    st.booleans(),
)
def test_text_stream_equals_the_text_cut_at_the_first_stop_whatever_the_chunks(text, stops, chunks, include):
    ids = TOK.encode(text, add_special_tokens=False)
    s = TextStream(TOK, [], stop=tuple(stops), include_stop_str_in_output=include)
    sent, pos, hit, i = "", 0, None, 0
    while pos < len(ids) and hit is None:  # tokens arrive in chunks of random sizes (blocks of decode steps)
        chunk = ids[pos : pos + chunks[i % len(chunks)]]
        hit = s.add(chunk)
        sent += s.delta(False)
        assert "\ufffd" not in sent and (include or not any(x in sent for x in stops))
        pos, i = pos + len(chunk), i + 1
    if hit is None:
        s.finish()
    sent += s.delta(True)
    assert sent == s.text
    if any(x in TOK.decode(ids) for x in stops):
        want_text, want_ids, want_stop = _cut(ids, text, list(stops), include)
        assert (s.text, s.num_tokens, s.stop_reason) == (want_text, len(want_ids), want_stop)
    else:
        assert s.text == text and not s.stopped and s.num_tokens == len(ids)


# ---- the engine ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM("tinypy", **SMALL)  # asynchronous scheduling and blocks of 8 decode steps


@pytest.fixture(scope="module")
def plain(llm):
    """Greedy outputs without stop strings: the reference every stopped output is cut from."""
    return llm.generate(PROMPTS, SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True))


def _stops_in(text: str) -> list[str]:
    """A few stop strings that occur in `text` after its start, some across token boundaries."""
    body = text.strip()
    return [body[:3], body[len(body) // 3 : len(body) // 3 + 4], body[-5:-1]]


def _expected(ref, stops, include: bool):
    """(text, token ids, stop string) of the plain output cut at its first stop: the first token whose text so far
    holds a stop string is the last one kept, and the text ends at the earliest stop string in it."""
    return _cut(ref.outputs[0].token_ids, ref.outputs[0].text, stops, include)


def _cut(ids, text, stops, include):
    k = next(j for j in range(len(ids)) if any(s in TOK.decode(ids[: j + 1]) for s in stops))
    so_far = TOK.decode(ids[: k + 1])
    where = {s: so_far.find(s) for s in stops if s in so_far}
    stop = min(where, key=lambda s: (where[s], stops.index(s)))
    end = where[stop] + (len(stop) if include else 0)
    assert text.startswith(so_far[:end])
    return so_far[:end], ids[: k + 1], stop


@pytest.mark.parametrize("include", [False, True])
def test_generate_with_stops_equals_the_plain_text_cut_at_the_first_stop(llm, plain, include):
    cases = [(i, (s,)) for i in range(len(PROMPTS)) for s in _stops_in(plain[i].outputs[0].text)]
    cases += [(i, tuple(_stops_in(plain[i].outputs[0].text)[::-1])) for i in range(len(PROMPTS))]  # several
    params = [
        SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, stop=s, include_stop_str_in_output=include)
        for _, s in cases
    ]
    # All at once: the stopped requests share mixed steps with plain ones, whose outputs must not change. Then in
    # groups of three: with the prompts done, the slots decode in blocks of 8 steps, and a stop mid-block drops
    # the block's later tokens.
    together = llm.generate([PROMPTS[i] for i, _ in cases] + PROMPTS, params + [plain_params()] * len(PROMPTS))
    for out, ref in zip(together[len(cases) :], plain):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.outputs[0].stop_reason is None
    groups = [range(g, min(g + 3, len(cases))) for g in range(0, len(cases), 3)]
    in_groups = [out for g in groups for out in llm.generate([PROMPTS[cases[j][0]] for j in g], [params[j] for j in g])]
    assert any(r["decode_steps"] > 1 for r in llm.engine.step_records)
    for outs in (together, in_groups):
        for (i, stops), out in zip(cases, outs):
            text, ids, stop = _expected(plain[i], stops, include)
            c = out.outputs[0]
            assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == (text, ids, "stop", stop), stops
            assert len(out.metrics.token_times) == len(ids)


def plain_params():
    return SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("options", [dict(num_scheduler_steps=1), dict(async_scheduling=False)])
def test_streamed_deltas_never_show_a_stop_and_add_up(plain, options):
    engine = LLMEngine("tinypy", **(SMALL | options))
    ref = plain[0]
    stops = tuple(_stops_in(ref.outputs[0].text)[1:])
    text, ids, stop = _expected(ref, stops, False)
    engine.add_request("s", PROMPTS[0], SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, stop=stops))
    engine.add_request("p", PROMPTS[1], plain_params())
    got_ids, texts, last = [], [], None
    for out in engine.stream():
        if out.request_id != "s":
            continue
        c = out.outputs[0]
        got_ids += c.new_token_ids
        assert not any(s in c.text for s in stops) and text.startswith(c.text)
        texts.append(c.text)
        last = c
    assert got_ids == ids and last.text == text and last.finish_reason == "stop" and last.stop_reason == stop
    assert len(set(texts)) > 2  # the text grew as tokens came, not only at the end
    assert engine.scheduler.pool.num_used == 0 and not engine.stop_strings


def test_stop_strings_with_speculative_decoding_drop_the_accepted_drafts_after_the_stop():
    # A repetitive prompt: n-gram drafts from it are accepted several at a time, so a stop may complete mid-run.
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = LLM("tinypy", **(SMALL | dict(num_scheduler_steps=1)), speculative_config=spec)
    prompt = "import os\nimport sys\nimport sys\nimport sys\n"
    ref = llm.generate(prompt, plain_params())[0]
    body = ref.outputs[0].text
    spec_stats = llm.engine.scheduler.speculator
    accepted = spec_stats.num_accepted_tokens
    for stops in ((body[10:22],), (body[15:19], body[9:25]), ("never", body[-12:])):
        text, ids, stop = _expected(ref, stops, False)
        sp = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, stop=stops)
        c = llm.generate(prompt, sp)[0].outputs[0]
        assert (c.text, c.token_ids, c.stop_reason) == (text, ids, stop)
    assert spec_stats.num_accepted_tokens > accepted  # the stopped requests did verify drafts


def test_each_sample_of_n_stops_on_its_own(llm, plain):
    stops = tuple(_stops_in(plain[0].outputs[0].text)[1:])
    text, ids, stop = _expected(plain[0], stops, False)
    sp = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, stop=stops, n=3)
    out = llm.generate(PROMPTS[0], sp)[0]
    assert [(c.index, c.text, c.token_ids, c.stop_reason) for c in out.outputs] == [
        (i, text, ids, stop) for i in range(3)
    ]
    assert llm.engine.scheduler.pool.num_used == 0 and not llm.engine.stop_strings


def test_a_stop_string_in_the_prompt_does_not_stop_and_stop_ids_give_their_stop_reason(llm, plain):
    ref = plain[0].outputs[0]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, stop="fibon"))
    assert out[0].outputs[0].token_ids == ref.token_ids and out[0].outputs[0].finish_reason == "length"
    t = ref.token_ids[5]
    k = ref.token_ids.index(t)
    for stop in ((), ("\x00never",)):  # the same with and without a stream of stop strings
        sp = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, stop_token_ids=[t], stop=stop)
        c = llm.generate(PROMPTS[0], sp)[0].outputs[0]
        assert c.token_ids == ref.token_ids[: k + 1] and c.stop_reason == t and c.finish_reason == "stop"
        assert c.text == TOK.decode(ref.token_ids[:k])  # the stop token's text is left out (vLLM)


def test_stop_strings_need_a_tokenizer():
    engine = LLMEngine("test-tiny", max_num_seqs=2, max_num_batched_tokens=16, page_size=8, num_pages=16)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("a", [1, 2, 3], SamplingParams(stop="x"))
    assert not engine.requests


# ---- bad_words -------------------------------------------------------------------------------------------------
def test_bad_words_become_their_token_sequences_with_and_without_a_leading_space():
    words = ("return", "  import os", "é")
    got = bad_word_token_ids(words, TOK, TOK.vocab_size)
    want = []
    for w in words:
        plain_ids = tuple(TOK.encode(w.lstrip(), add_special_tokens=False))
        spaced = tuple(TOK.encode(" " + w.lstrip(), add_special_tokens=False))
        want.append(plain_ids)
        if spaced[0] != plain_ids[0] and len(spaced) == len(plain_ids):
            want.append(spaced)
    assert got == tuple(want)
    # tinypy's byte-level BPE writes " return" as one token of its own: both forms are banned.
    assert (TOK.encode("return", add_special_tokens=False)[0],) in got
    assert tuple(TOK.encode(" return", add_special_tokens=False)) in got


def test_bad_words_refused_without_a_tokenizer_or_for_whitespace_or_outside_the_vocabulary():
    with pytest.raises(ValueError, match="need a tokenizer"):
        bad_word_token_ids(("x",), None, 100)
    with pytest.raises(ValueError, match="nothing but whitespace"):
        bad_word_token_ids(("  ",), TOK, TOK.vocab_size)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bad_word_token_ids(("zebra",), TOK, 3)
    assert bad_word_token_ids((), None, 100) == ()
