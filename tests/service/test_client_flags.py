"""`specstream-client validate-config` takes the server's engine flags: its flags come from the
API's EngineConfig message (clients import only the protos), the server's from
service.config; both name and type every engine setting alike."""

from __future__ import annotations

import pytest

from clients.cli import build_parser
from service.config import settings


def _validate_actions() -> dict[str, object]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {a.option_strings[0]: a for a in sub.choices["validate-config"]._actions
            if a.option_strings and a.dest not in ("help", "json")}


def test_client_flags_are_the_servers_engine_flags():
    client = _validate_actions()
    engine = [s for s in settings() if s.section == "engine"]
    assert set(client) == {s.flag for s in engine}
    for s in engine:
        assert client[s.flag].dest == s.name, s.flag


@pytest.mark.parametrize("flag, raw, dest, want", [
    ("--cache-type-k", "q8_0", "kv_cache_type_k", "q8_0"),
    ("--n-ctx", "7", "n_ctx", 7),
    ("--cuda-graphs", "false", "cuda_graphs", False),
    ("--prefix-cache", "on", "prefix_cache", True),
    ("--kv-cache-memory", "0.5", "kv_cache_memory", "0.5")])
def test_client_flag_values_parse_as_the_server_reads_them(flag, raw, dest, want):
    assert getattr(build_parser().parse_args(["validate-config", flag, raw]), dest) == want


def test_client_rejects_a_bool_that_is_not_one(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["validate-config", "--cuda-graphs", "maybe"])
    assert "is not true or false" in capsys.readouterr().err


def test_generate_flags_of_the_sampling_controls_build_the_request():
    from clients.cli import cmd_generate

    a = build_parser().parse_args(["generate", "1,2", "--tokens", "--frequency-penalty", "0.5",
                                   "--presence-penalty", "-1", "--logit-bias", "7=-100",
                                   "--logit-bias", "9=2.5", "--min-tokens", "3", "--samples",
                                   "2", "--json", "--prompt-logprobs", "4"])
    sent = []

    class Sent(Exception):
        pass

    class Client:
        def generate(self, request):
            sent.append(request)
            raise Sent

    with pytest.raises(Sent):
        cmd_generate(Client(), a)
    s, st = sent[0].sampling, sent[0].stopping
    assert (s.frequency_penalty, s.presence_penalty, dict(s.logit_bias), st.min_tokens) == (
        0.5, -1.0, {7: -100.0, 9: 2.5}, 3)
    assert (sent[0].n, sent[0].output.prompt_logprobs, sent[0].output.prompt_top_logprobs) == (
        2, True, 4)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--logit-bias", "7"])
