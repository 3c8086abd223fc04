"""The OpenAI-compatible HTTP server around one engine loop (`python -m cbjax.serve`; docs/serve.md).

Needs the `[serve]` extra (Starlette, uvicorn, prometheus-client). Files: `protocol.py` (request bodies ->
GenerationRequest, OpenAI's error shape), `engine_loop.py` (the thread that owns the engine), `logprobs_format.py`
(logprobs in OpenAI's shapes), `chat_template.py`, `metrics.py` (Prometheus), `app.py` (routes), `server.py`
(uvicorn and the graceful shutdown), `__main__.py` (absl flags). Text is decoded with cbjax/model/text_stream.py,
which the engine's stop strings share.
"""
