"""Token-exact parity with transformers: tiny random Llama / Mistral / Qwen2 / Qwen3 checkpoints written by
`save_pretrained`, loaded by cbjax. Logits agree in float32, and the continuous-batching engine's greedy tokens
(several prompts of different lengths and output lengths sharing 4 slots and a small page pool) equal
transformers' greedy `generate`, token for token, with EOS ignored and with a list of EOS ids honoured.
"""

import json
import os
import pathlib
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the parity tests need torch (the project's test extra installs it)")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (test extra)")

import jax.numpy as jnp  # noqa: E402

from cbjax import LLM, SamplingParams  # noqa: E402
from cbjax.model.hf_loader import load_hf_model  # noqa: E402
from tests.model.hf_models import TINY, random_hf_model  # noqa: E402

ARCHS = {
    # Llama-3 rope scaling with a short original context, so every frequency band (scaled, smoothed, kept) is used.
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
            rope_theta=5000.0,
        ),
    ),
    # A window much shorter than the prompts, so the paged kernel's sliding-window masking is exercised.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # head_dim 32 != hidden / heads (16): the q/k norm and projections must use the explicit head_dim.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}
PROMPT_LENS = [1, 5, 13, 40, 22, 9]
MAX_TOKENS = [12, 20, 3, 16, 1, 9]
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=24, max_model_len=96)


def _hf_model(arch: str):
    cfg_cls, model_cls, extra = ARCHS[arch]
    return random_hf_model(cfg_cls, model_cls, **extra)


_SAVED = {}


def _saved(arch: str, tmp_path_factory):
    if arch not in _SAVED:
        model = _hf_model(arch)
        path = str(tmp_path_factory.mktemp(arch))
        model.save_pretrained(path)
        _SAVED[arch] = (arch, model, path)
    return _SAVED[arch]


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    return _saved(request.param, tmp_path_factory)


def _prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, TINY["vocab_size"], n).tolist() for n in PROMPT_LENS]


def _hf_greedy(model, prompt, max_tokens, eos=None):
    model.generation_config.eos_token_id = eos  # None: run the full length, as ignore_eos does
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


def test_logits_match_transformers(checkpoint):
    _arch, hf, path = checkpoint
    tokens = np.random.default_rng(1).integers(0, TINY["vocab_size"], (2, 48))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    model = load_hf_model(path, dtype="float32")
    got = np.asarray(model.forward_full(jnp.asarray(tokens)))
    assert np.abs(want).max() > 1.0  # logits of real magnitude, so the tolerance below is tight
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_engine_greedy_tokens_equal_transformers_generate(checkpoint):
    _arch, hf, path = checkpoint
    prompts = _prompts()
    want = [_hf_greedy(hf, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    llm = LLM(path, dtype="float32", **ENGINE)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS])
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want
    assert len({tuple(w) for w in want}) == len(want)  # not a degenerate model repeating one sequence
    assert llm.engine.scheduler.pool.num_free == ENGINE["num_pages"]


def test_eos_list_stops_like_transformers(tmp_path_factory, tmp_path):
    """generation_config.json with eos_token_id [a, b]: every request stops at the first of either, as HF does.
    (EOS handling does not depend on the architecture: the Llama checkpoint only.)"""
    _, hf, path = _saved("llama", tmp_path_factory)
    prompts = _prompts()
    free_run = [_hf_greedy(hf, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    # Two ids that greedy decoding does produce mid-sequence, so stopping early is really tested.
    eos = [free_run[1][4], free_run[3][6]]
    want = [_hf_greedy(hf, p, n, eos=eos) for p, n in zip(prompts, MAX_TOKENS)]
    want = [w[: next((i + 1 for i, t in enumerate(w) if t in eos), len(w))] for w in want]  # HF pads after EOS
    assert any(len(w) < n for w, n in zip(want, MAX_TOKENS))
    local = str(tmp_path / "ckpt")
    shutil.copytree(path, local)
    gen_file = os.path.join(local, "generation_config.json")
    gen = json.loads(pathlib.Path(gen_file).read_text())
    gen["eos_token_id"] = eos
    pathlib.Path(gen_file).write_text(json.dumps(gen))
    llm = LLM(local, dtype="float32", **ENGINE)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0) for n in MAX_TOKENS])
    assert [o.outputs[0].token_ids for o in outs] == want
    for o, w, _n in zip(outs, want, MAX_TOKENS):
        assert o.outputs[0].finish_reason == ("stop" if w[-1] in eos else "length")


def test_packaged_model_is_a_real_hf_checkpoint(monkeypatch):
    """transformers reads cbjax/assets/tinypy as it is (model and tokenizer), with the same logits and greedy text."""
    from cbjax.model.registry import packaged_model_path
    from cbjax.model.tokenizer import Tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = packaged_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    text = "def fibonacci(n):\n    if n < 2:\n        return n  # naïve\n"
    ids = Tokenizer.from_dir(path).encode(text)
    assert hf_tok(text)["input_ids"] == ids and hf_tok.decode(ids, skip_special_tokens=True) == text
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits.numpy()
    got = np.asarray(load_hf_model(path, dtype="float32").forward_full(jnp.asarray([ids])))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    prompt = hf_tok("class Stack:\n    def push(self, item):")["input_ids"]
    with torch.no_grad():  # EOS honoured on both sides (the model's own generation_config)
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    out = LLM(path, **ENGINE).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.outputs[0].token_ids == ref
