"""The OpenAI-compatible server: `python -m cbjax.serve --model tinypy --policy fcfs [engine flags]`.

Every engine option (cbjax.engine_config.EngineConfig) is a flag of the same name (`--max_num_seqs=64`,
`--enable_prefix_caching`, `--policy_options='{"aging_s": 5}'`, ...); unset flags keep the engine's defaults.
Routes, options and measurements: docs/serve.md.
"""

import contextlib
import json
import logging
import types
import typing

from absl import app, flags

from cbjax.engine import EngineConfig

_MODEL = flags.DEFINE_string(
    "model", "tinypy", "packaged model name, Hugging Face checkpoint directory or named config"
)
_NAME = flags.DEFINE_string("served_model_name", None, "the `model` clients send (default: --model)")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "address to listen on")
_PORT = flags.DEFINE_integer("port", 8000, "port to listen on")
_MAX_WAITING = flags.DEFINE_integer(
    "max_waiting_requests", 1024, "accepted requests not yet running, at most; beyond: 429 with Retry-After"
)
_TIMEOUT = flags.DEFINE_float("request_timeout_s", 600.0, "a request still unfinished after this is aborted (0: never)")
_SHUTDOWN = flags.DEFINE_float(
    "shutdown_timeout_s", 30.0, "on SIGINT/SIGTERM, in-flight requests may finish for this long, then are aborted"
)
_LOG_LEVEL = flags.DEFINE_enum("log_level", "info", ["debug", "info", "warning", "error"], "server log level")


# Engine options that are dicts: their flags take JSON.
_JSON_OPTIONS = {"policy_options": "policy options", "speculative_config": "speculative decoding"}


def _define_engine_flags() -> dict[str, flags.FlagHolder]:
    """One flag per engine option, default None (= the engine's default, named in the help)."""
    holders = {}
    for name, kind, default in EngineConfig.option_fields():
        help = f"engine option (default {default!r}; cbjax/engine_config.py:EngineConfig)"
        args = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
        kinds = {a for a in args if a is not type(None)}
        if name in _JSON_OPTIONS:
            holders[name] = flags.DEFINE_string(name, None, f"{_JSON_OPTIONS[name]} as a JSON object; " + help)
        elif kinds == {bool}:
            holders[name] = flags.DEFINE_bool(name, None, help)
        elif kinds == {int}:
            holders[name] = flags.DEFINE_integer(name, None, help)
        elif kinds == {float}:
            holders[name] = flags.DEFINE_float(name, None, help)
        else:  # str, str | None, bool | str (warmup: its names)
            holders[name] = flags.DEFINE_string(name, None, help)
    return holders


_ENGINE_FLAGS = _define_engine_flags()


def engine_options() -> dict:
    """The engine flags that were set, as LLMEngine keywords."""
    opts = {name: h.value for name, h in _ENGINE_FLAGS.items() if h.value is not None}
    for name in _JSON_OPTIONS:
        if name in opts:
            opts[name] = json.loads(opts[name])
    return opts


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.basicConfig(level=_LOG_LEVEL.value.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from cbjax.engine import LLMEngine
    from cbjax.serve.server import checkpoint_of, make_server

    opts = engine_options()
    logging.getLogger("cbjax.serve").info("loading %s with %s", _MODEL.value, opts)
    engine = LLMEngine(_MODEL.value, **opts)
    uv, _ = make_server(
        engine,
        model_name=_NAME.value or _MODEL.value,
        checkpoint_dir=checkpoint_of(_MODEL.value),
        host=_HOST.value,
        port=_PORT.value,
        max_waiting=_MAX_WAITING.value,
        request_timeout_s=_TIMEOUT.value or None,
        shutdown_timeout_s=_SHUTDOWN.value,
        log_level=_LOG_LEVEL.value,
    )
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it handled, after its shutdown
        uv.run()


if __name__ == "__main__":
    app.run(main)
