"""`specstream generate --chat` with and without a chat template (--chat-template NAME|FILE)."""

from __future__ import annotations

from service.cli import build_parser
from service.config import build_serve_parser
from service.model.chat import BUILTIN_TEMPLATES
from tests.support.cli import assert_generate_json_is_the_engines, run_cli
from tests.support.models import load_json

USER_CASE = next(c for c in load_json("llamacpp_smollm2_greedy.json")["cases"]
                 if c["prompt"].startswith("<|im_start|>user\n"))
QUESTION = "What is 12 times 7?"     # USER_CASE's one user message


def test_chat_without_a_template_is_a_clear_error(capsys):
    code, out, err = run_cli(capsys, "generate", "gemma3-270m", "--chat", "--prompt", QUESTION,
                             "--max-new-tokens", "2", "--backend", "cpu", "--n-ctx", "512")
    assert code == 2 and out == ""
    assert "specstream: --chat: this model has no chat template" in err
    assert "--chat-template NAME|FILE" in err
    assert all(name in err for name in BUILTIN_TEMPLATES)


def test_chat_with_a_builtin_template_gives_llamacpps_ids(capsys, smol):
    """The CLI's ids are the engine's (which also reports each row's top-1/top-2 gap), and
    those equal llama.cpp's up to the first near-tie of either side."""
    code, out, _ = run_cli(capsys, "generate", "smollm2-135m", "--chat", "--chat-template",
                           "chatml", "--prompt", QUESTION, "--max-new-tokens", "48",
                           "--temperature", "0", "--json", "--backend", "cpu")
    assert code == 0
    assert_generate_json_is_the_engines(out, smol, "smollm2", USER_CASE)


def test_unknown_chat_template_lists_the_names(capsys):
    code, _, err = run_cli(capsys, "generate", "smollm2-135m", "--chat", "--chat-template",
                           "no-such-template", "--prompt", QUESTION, "--backend", "cpu")
    assert code == 2
    assert "chat_template: 'no-such-template' is neither a built-in template (" in err
    assert all(name in err for name in BUILTIN_TEMPLATES)


def test_help_names_the_builtin_templates():
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    for text in (generate.format_help(), build_serve_parser().format_help()):
        assert "--chat-template" in text
        assert all(name in text for name in BUILTIN_TEMPLATES)
