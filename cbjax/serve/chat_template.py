"""Chat messages -> one prompt text.

A checkpoint whose tokenizer_config.json has a `chat_template` (Jinja, as transformers renders it) gets that
template, with `add_generation_prompt=True`. Models without one, like the packaged `tinypy` (a base model trained
on Python source), get the plain template documented in docs/serve.md: one `role: content` line per message, then
`assistant:` (no trailing space or newline), which the model continues.
"""

import json
import os
from collections.abc import Callable

ChatTemplate = Callable[[list[dict]], str]


def plain_template(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def load_chat_template(checkpoint_dir: str | None) -> tuple[ChatTemplate, str]:
    """(render function, a short description) for the checkpoint in `checkpoint_dir`."""
    cfg = {}
    path = os.path.join(checkpoint_dir, "tokenizer_config.json") if checkpoint_dir else None
    if path and os.path.isfile(path):
        with open(path) as f:
            cfg = json.load(f)
    source = cfg.get("chat_template")
    if isinstance(source, list):  # the named-templates form: take the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        return plain_template, "plain ('role: content' lines, then 'assistant:')"
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)
    special = {k: cfg.get(k) if isinstance(cfg.get(k), str) else "" for k in ("bos_token", "eos_token")}

    def render(messages: list[dict]) -> str:
        return template.render(messages=messages, add_generation_prompt=True, **special)

    return render, "the checkpoint's chat_template (tokenizer_config.json)"
