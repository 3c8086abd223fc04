"""The packaged default model: `LLM()` loads it offline and writes text; the streaming CLI; the package files."""

import io
import json
import os
import pathlib
import socket
import subprocess
import sys
import tomllib
from fnmatch import fnmatch

import pytest
from safetensors import safe_open

from cbjax import LLM, SamplingParams
from cbjax.generate import generate, parse_args
from cbjax.model.registry import ASSETS_DIR, DEFAULT_MODEL, DRAFT_MODEL, packaged_models
from tests.helpers import ROOT

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=16, num_pages=64)


@pytest.fixture(scope="module")
def llm():
    # Offline, and with sockets unusable: loading the default model must not touch the network.
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("network access while loading the packaged model")

    mp.setattr(socket.socket, "connect", no_network)
    try:
        yield LLM(**SMALL)  # no model argument: the packaged default
    finally:
        mp.undo()


def test_default_llm_writes_python_text_from_string_prompts(llm):
    assert llm.engine.tokenizer is not None
    assert llm.engine.model_config.vocab_size == llm.engine.tokenizer.vocab_size
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert out.prompt == prompt and out.error is None
        assert out.prompt_token_ids == llm.engine.tokenizer.encode(prompt)
        assert c.text == llm.engine.tokenizer.decode(c.token_ids) and c.text.strip()
    # A trained model, not noise: greedy text from a function header is indented Python.
    body = outs[0].outputs[0].text
    assert body.startswith("\n") and "    " in body, body


def test_text_and_token_prompts_mix_and_a_bad_prompt_is_refused_alone(llm):
    tok = llm.engine.tokenizer
    ids = tok.encode("def add(a, b):")
    outs = llm.generate(["def add(a, b):", ids, [5, 99999], ""], SamplingParams(max_tokens=6, temperature=0.0))
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].text == outs[1].outputs[0].text and outs[1].prompt is None
    assert outs[2].outputs[0].finish_reason == "abort" and "outside the vocabulary" in outs[2].error
    # "" is not empty once encoded: the tokenizer's start-of-text token, so the model writes a file from scratch.
    assert outs[3].prompt_token_ids == [0] and outs[3].error is None and len(outs[3].outputs[0].token_ids) == 6


def test_cli_streams_token_by_token_what_the_engine_generates(llm):
    class Recorder(io.StringIO):
        writes = 0

        def write(self, s):
            Recorder.writes += bool(s)
            return super().write(s)

    out, err = Recorder(), io.StringIO()
    text = generate(
        parse_args(["--prompt", "def fibonacci(n):", "--max_tokens", "16", "--temperature", "0", "--ignore_eos"]),
        out=out,
        err=err,
    )
    want = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert text == want.outputs[0].text
    assert out.getvalue() == "def fibonacci(n):" + text + "\n"
    assert Recorder.writes >= 8  # the prompt, then text as tokens arrive: not one write at the end
    assert "16 tokens" in err.getvalue()


def test_cli_runs_as_a_module_with_sampling_flags():
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    args = [
        "--prompt",
        "class Stack:",
        "--max_tokens",
        "8",
        "--temperature",
        "0.8",
        "--top_p",
        "0.9",
        "--top_k",
        "50",
        "--seed",
        "3",
        "--ignore_eos",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "cbjax.generate", *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("class Stack:") and len(r.stdout) > len("class Stack:\n")
    assert "8 tokens" in r.stderr


def test_packaged_models_are_complete_small_bf16_llamas_in_package_data():
    assert {DEFAULT_MODEL, DRAFT_MODEL} <= set(packaged_models())
    total = 0
    patterns = tomllib.loads(pathlib.Path(ROOT, "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "cbjax"
    ]
    for name in (DEFAULT_MODEL, DRAFT_MODEL):
        d = os.path.join(ASSETS_DIR, name)
        files = sorted(os.listdir(d))
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(files)
        for f in files:  # a non-editable install ships every file
            assert any(fnmatch(f"assets/{name}/{f}", p) for p in patterns), f
            total += os.path.getsize(os.path.join(d, f))
        assert json.loads(pathlib.Path(d, "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        with safe_open(os.path.join(d, "model.safetensors"), framework="np") as st:
            names = st.keys()  # safe_open has keys() but is not iterable
            assert {st.get_slice(k).get_dtype() for k in names} == {"BF16"}
    assert total < 20 * 2**20
    # Speculative decoding needs the draft to share the main model's vocabulary.
    same = [pathlib.Path(ASSETS_DIR, n, "tokenizer.json").read_text() for n in (DEFAULT_MODEL, DRAFT_MODEL)]
    assert same[0] == same[1]
