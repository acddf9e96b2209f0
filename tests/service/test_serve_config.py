"""One loader for flags, env and config file; bad settings stop startup with exit status 2 and
every problem listed; ValidateConfig reports the same problems and changes nothing."""

from __future__ import annotations

import pytest

from service.config import (
    MAX_VERIFY_WIDTH,
    MIN_VERIFY_WIDTH,
    SUPPORTED_KV_PAIRS,
    EngineConfig,
    ServerConfig,
    load_config,
    settings,
)
from service.errors import ConfigError
from tests.support.grpc_harness import run_serve

# Every named KV type is on both backends, so no named pair is unsupported; the pair check is
# exercised with the supported pairs cut down to the f16/q8_0/q4_0 ones (what the backends
# declare reaches the check through SUPPORTED_KV_PAIRS alone). Out-of-process tests name an
# unknown type instead.
FEWER_PAIRS = tuple((k, v) for k in ("f16", "q8_0", "q4_0") for v in ("f16", "q8_0", "q4_0"))


@pytest.fixture
def fewer_pairs(monkeypatch):
    monkeypatch.setattr("service.config.schema.SUPPORTED_KV_PAIRS", FEWER_PAIRS)
    return FEWER_PAIRS


def _problems(argv=(), env=None, config_file=None) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as ei:
        load_config(argv, env or {}, config_file)
    return ei.value.problems


# ------------------------------------------------------------------ the loader
def test_defaults():
    from service.gguf.fetch import DEFAULT_MODEL

    server, engine = load_config([], {})
    assert server == ServerConfig() and engine == EngineConfig()
    assert server.model == DEFAULT_MODEL


def test_precedence_defaults_file_env_flags(tmp_path):
    cfg = tmp_path / "specstream.toml"
    cfg.write_text('[server]\nport = 6000\nmetrics_port = 6001\ngrace_period_s = 3\n'
                   '[engine]\nverify_width = 2\nkv_cache_type_k = "q8_0"\nn_ctx = 1024\n')
    env = {"SPECSTREAM_PORT": "7000", "SPECSTREAM_VERIFY_WIDTH": "3"}
    server, engine = load_config(["--verify-width", "5", "my.gguf"], env, cfg)
    assert (server.port, server.metrics_port, server.grace_period_s) == (7000, 6001, 3.0)
    assert (engine.verify_width, engine.kv_cache_type_k, engine.n_ctx) == (5, "q8_0", 1024)
    assert server.model == "my.gguf"
    server, _ = load_config([], {"SPECSTREAM_CONFIG": str(cfg)})
    assert server.port == 6000


def test_every_setting_has_flag_env_and_key():
    flags = [s.flag for s in settings()]
    assert len(set(flags)) == len(flags)
    for s in settings():
        assert s.env == "SPECSTREAM_" + s.flag[2:].upper().replace("-", "_")
    names = {s.flag for s in settings()}
    assert {"--port", "--metrics-port", "--cache-type-k", "--cache-type-v", "--verify-width",
            "--backend"} <= names


def test_all_problems_reported_together(tmp_path, fewer_pairs):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[engine]\nthreads = "many"\nbogus = 1\n[extra]\n')
    problems = _problems(["--cache-type-k", "q4_1", "--verify-width", "0", "--port", "x",
                          "--frobnicate"], {"SPECSTREAM_N_SLOTS": "-3"}, cfg)
    fields = [f for f, _ in problems]
    for expected in ("argv", "port", "threads", "engine.bogus", "config", "n_slots",
                     "kv_cache_type_k,kv_cache_type_v", "verify_width"):
        assert expected in fields, (expected, problems)
    pair_msg = dict(problems)["kv_cache_type_k,kv_cache_type_v"]
    for k, v in fewer_pairs:
        assert f"  {k} {v}" in pair_msg
    assert "  q4_1 q4_1" not in pair_msg
    assert f"{MIN_VERIFY_WIDTH}..{MAX_VERIFY_WIDTH}" in dict(problems)["verify_width"]


@pytest.mark.parametrize("k,v", [("foo", "bf16"), ("q5_1", "bar"), ("foo", "bar")])
def test_every_bad_kv_type_is_reported(k, v, fewer_pairs):
    problems = dict(_problems(["--cache-type-k", k, "--cache-type-v", v]))
    assert repr(k) in problems["kv_cache_type_k"]
    assert repr(v) in problems["kv_cache_type_v"]
    for message in problems.values():
        assert "f16" in message                   # each one says what is accepted instead


def test_problems_from_env_name_the_variable(fewer_pairs):
    problems = dict(_problems(env={"SPECSTREAM_VERIFY_WIDTH": "20", "SPECSTREAM_PORT": "x",
                                   "SPECSTREAM_CACHE_TYPE_K": "q4_1"}))
    width = EngineConfig(verify_width=20).problems()[0][1]
    assert problems["verify_width"] == f"SPECSTREAM_VERIFY_WIDTH=20: {width}"
    assert problems["port"].startswith("SPECSTREAM_PORT=x: ")
    assert problems["kv_cache_type_k,kv_cache_type_v"].startswith(
        "SPECSTREAM_CACHE_TYPE_K=q4_1: unsupported KV cache type pair (K=q4_1, V=f16)")


def test_problems_from_flags_match_validate_config_words():
    # ValidateConfig has no flags to name, so a flag's range problem keeps the bare message
    assert _problems(["--verify-width", "20"]) == EngineConfig(verify_width=20).problems()
    assert dict(_problems(["--port", "x"]))["port"].startswith("--port x: ")


def test_problems_from_the_config_file_name_file_and_key_in_toml(tmp_path):
    cfg = tmp_path / "specstream.toml"
    cfg.write_text('[server]\nport = true\nlog_level = "loud"\n[engine]\nverify_width = 20\n')
    problems = dict(_problems(config_file=cfg))
    assert problems["port"].startswith(f"{cfg} [server] port = true: ")
    assert "True" not in problems["port"]                 # TOML's spelling, not Python's
    assert problems["log_level"].startswith(f'{cfg} [server] log_level = "loud": ')
    assert problems["verify_width"].startswith(f"{cfg} [engine] verify_width = 20: ")


def test_later_layer_names_its_own_source(tmp_path):
    cfg = tmp_path / "specstream.toml"
    cfg.write_text("[engine]\nverify_width = 30\n")
    problems = dict(_problems(env={"SPECSTREAM_VERIFY_WIDTH": "20"}, config_file=cfg))
    assert problems["verify_width"].startswith("SPECSTREAM_VERIFY_WIDTH=20: 20 ")


def test_server_problems():
    problems = dict(_problems(["--port", "70000", "--metrics-port", "-5", "--log-level",
                               "loud", "--max-receive-message-bytes", "10"]))
    assert {"port", "metrics_port", "log_level", "max_receive_message_bytes"} <= set(problems)


def test_missing_or_broken_config_file(tmp_path):
    assert "cannot read" in dict(_problems(config_file=tmp_path / "nope.toml"))["config"]
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine\n")
    assert "not valid TOML" in dict(_problems(config_file=bad))["config"]


# ------------------------------------------------------------------ startup exits 2
def _assert_listing(stderr: str) -> None:
    for k, v in SUPPORTED_KV_PAIRS:
        assert f"{k} {v}" in stderr
    assert "supported KV cache type pairs" in stderr


def test_serve_unknown_kv_type_exits_2_with_the_known_types():
    r = run_serve(["--cache-type-k", "q4_k", "--cache-type-v", "q5_0"])
    assert r.returncode == 2, r.stderr
    assert "unknown KV cache type 'q4_k'; known types: f16, bf16, q8_0, q5_1, q5_0, q4_1, " \
           "q4_0" in r.stderr


def test_serve_bad_width_exits_2_with_range():
    r = run_serve(["--verify-width", "17"])
    assert r.returncode == 2
    assert "verify_width" in r.stderr and f"{MIN_VERIFY_WIDTH}..{MAX_VERIFY_WIDTH}" in r.stderr


def test_serve_reports_every_problem_from_env_and_flags():
    r = run_serve(["--verify-width", "0"], env={"SPECSTREAM_CACHE_TYPE_V": "q4_k",
                                               "SPECSTREAM_CACHE_TYPE_K": "q8_0"})
    assert r.returncode == 2
    assert "verify_width" in r.stderr and "SPECSTREAM_CACHE_TYPE_V=q4_k" in r.stderr
    assert "2 problems" in r.stderr


def test_serve_help_lists_pairs():
    r = run_serve(["--help"])
    assert r.returncode == 0
    _assert_listing(r.stdout)
    assert "SPECSTREAM_" in r.stdout


# ------------------------------------------------------------------ ValidateConfig parity
@pytest.mark.parametrize("argv", [
    ["--cache-type-k", "q4_k", "--cache-type-v", "q5_0"],
    ["--cache-type-k", "q4_1", "--cache-type-v", "q5_0"],
    ["--verify-width", "17"],
    ["--verify-width", "0", "--cache-type-k", "bf16", "--drafter", "magic", "--n-slots", "0"],
    ["--cache-type-k", "q8_0", "--cache-type-v", "q4_0", "--verify-width", "8"],
])
def test_validate_config_reports_what_startup_reports(fake_client, argv):
    before = fake_client.get_config()
    try:
        load_config(argv, {})
        expected: list[tuple[str, str]] = []
    except ConfigError as e:
        expected = e.problems
    fields = {s.flag: s for s in settings()}
    given = {fields[f].name: fields[f].kind(v) for f, v in zip(argv[::2], argv[1::2],
                                                                strict=True)}
    r = fake_client.validate_config(**given)
    assert [(p.field, p.message) for p in r.problems] == expected
    assert r.valid == (not expected)
    for name, value in given.items():
        assert getattr(r.config, name) == value
    assert fake_client.get_config() == before              # a dry run: nothing changed


@pytest.mark.parametrize("size", ["1e400", "1e308GiB"])
def test_a_kv_cache_memory_past_the_float_range_is_a_problem(fake_client, size):
    # float("1e400") is inf: it passed as a size, then int(inf // block bytes) crashed startup
    # after the model was loaded
    r = fake_client.validate_config(kv_cache_memory=size)
    assert not r.valid and [p.field for p in r.problems] == ["kv_cache_memory"]
    assert [f for f, _ in _problems(["--kv-cache-memory", size])] == ["kv_cache_memory"]


# ------------------------------------------------------------------ generated stubs
def test_stale_stubs_are_regenerated():
    from service import proto_build

    assert proto_build.ensure_stubs() is False            # current: nothing to do
    proto_build.STAMP.write_text("stale\n")
    assert not proto_build.stubs_current()
    assert proto_build.ensure_stubs() is True
    assert proto_build.stubs_current()
    files = proto_build.documented_files()
    assert set(files) == {"specstream/v1/generation.proto", "specstream/v1/config.proto"}


def test_no_cuda_graphs_flag_turns_graphs_off():
    assert load_config([], {})[1].cuda_graphs is True
    assert load_config(["--no-cuda-graphs"], {})[1].cuda_graphs is False
    assert load_config(["--cuda-graphs", "false"], {})[1].cuda_graphs is False
    assert load_config([], {"SPECSTREAM_CUDA_GRAPHS": "off"})[1].cuda_graphs is False


def test_step_profile_flag():
    assert load_config([], {})[1].step_profile is False
    assert load_config(["--step-profile"], {})[1].step_profile is True
    assert load_config(["--step-profile", "--port", "0"], {})[1].step_profile is True
    assert load_config(["--step-profile", "false"], {})[1].step_profile is False
    assert load_config([], {"SPECSTREAM_STEP_PROFILE": "1"})[1].step_profile is True
