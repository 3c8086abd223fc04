"""The server on an engine with blocks of decode steps (num_scheduler_steps=4): on the CPU each block's rows stream
(cbjax/runner/token_stream.py), so a streamed completion still gets one chunk per token, and concurrent requests
get the tokens LLM.generate gives."""

import asyncio

import openai
import pytest

from cbjax import LLM, SamplingParams
from cbjax.runner.token_stream import TokenStream
from tests.serve.helpers import ENGINE, serve_tinypy

BLOCKS = ENGINE | dict(num_scheduler_steps=4)
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n"]


@pytest.fixture(scope="module")
def server():
    s = serve_tinypy(BLOCKS)
    yield s
    s.shutdown()


@pytest.mark.skipif(TokenStream.create(8, 4) is None, reason="no CPU kernel library: blocks do not stream rows")
def test_streamed_completions_from_blocks_come_one_token_per_chunk_with_the_reference_tokens(server):
    async def one(c, prompt):
        chunks = []
        stream = await c.completions.create(
            model="tinypy", prompt=prompt, max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        async for chunk in stream:
            chunks.append(chunk)
        return chunks

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    got = asyncio.run(all_at_once())  # concurrent: they share the engine's blocks
    want = LLM("tinypy", **BLOCKS).generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for chunks, w in zip(got, want):
        text_chunks = [c for c in chunks if c.choices]
        assert len(text_chunks) == 24  # one chunk per token: a block's tokens did not come together
        assert "".join(c.choices[0].text for c in text_chunks) == w.outputs[0].text
    # Blocks ran: 24 tokens each took far fewer dispatches than 24 single steps would have.
    assert server.engine.num_steps <= 12
