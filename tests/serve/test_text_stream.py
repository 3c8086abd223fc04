"""Stop strings: the text ends before the first one, and a stream never sends text a later token makes a stop."""

from cbjax.model.registry import packaged_model_path
from cbjax.model.tokenizer import Tokenizer
from cbjax.serve.chat_template import load_chat_template, plain_template
from cbjax.serve.text_stream import TextStream

TOK = Tokenizer.from_dir(packaged_model_path())


def _run(text: str, stop=()):
    ids = TOK.encode(text, add_special_tokens=False)
    s = TextStream(TOK, [], stop)
    sent = ""
    for t in ids:
        sent += s.add([t])
        if s.stopped:
            break
    return sent + s.finish(), s


def test_no_stop_gives_the_whole_text():
    text = "def add(a, b):\n    return a + b\n"
    out, s = _run(text)
    assert out == text and not s.stopped


def test_text_ends_before_the_first_stop_string_even_across_tokens():
    text = "def add(a, b):\n    return a + b\n"
    for stop in (["return"], ["b\n", "add"], ["urn a"], [":\n"]):
        out, s = _run(text, stop)
        first = min(text.find(x) for x in stop if x in text)
        assert s.stopped and out == text[:first], (stop, out)


def test_held_back_text_is_sent_at_the_end_when_no_stop_comes():
    out, s = _run("x = 1  # ret", ["return"])
    assert out == "x = 1  # ret" and not s.stopped


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
