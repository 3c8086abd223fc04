"""Chat templates: the plain one for a checkpoint without its own, and a checkpoint's own rendered.

(The text streams' stop-string tests are in tests/test_stop_strings.py, with the shared cbjax/model/text_stream.py.)"""

from cbjax.model.registry import packaged_model_path
from cbjax.serve.chat_template import load_chat_template, plain_template


def test_plain_chat_template_for_a_checkpoint_without_one():
    render, described = load_chat_template(packaged_model_path())
    assert render is plain_template and "plain" in described
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert render(msgs) == "system: be brief\nuser: hi\nassistant:"


def test_a_checkpoint_chat_template_is_rendered(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}'
        '{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}'
    )
    render, described = load_chat_template(str(tmp_path))
    assert "chat_template" in described
    assert render([{"role": "user", "content": "hi"}]) == "<s>[user]hi[assistant]"
