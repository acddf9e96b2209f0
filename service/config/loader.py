"""Where configuration values come from: defaults < config file < SPECSTREAM_* env vars < flags.

The only reader of argv, env vars and config files. `load_config` merges the layers and checks
both configs, raising one ConfigError with every problem (each naming the env var, file key or
flag that set the value).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from service.config.schema import (
    BACKENDS,
    DRAFTERS,
    MAX_TREE_BUDGET,
    MAX_VERIFY_WIDTH,
    MIN_VERIFY_WIDTH,
    EngineConfig,
    ServerConfig,
    supported_pairs_listing,
)
from service.errors import ConfigError

# ---------------------------------------------------------------- the loader
# Precedence: defaults < config file < SPECSTREAM_* env vars < flags. Every setting has one flag;
# its env var is SPECSTREAM_ + the flag name in capitals (--cache-type-k: SPECSTREAM_CACHE_TYPE_K)
# and its config-file key is the field name inside a [server] or [engine] table.
ENV_PREFIX = "SPECSTREAM_"
CONFIG_FILE_ENV = "SPECSTREAM_CONFIG"
_FLAG_NAMES = {  # field -> flag, where the flag is not the field name with dashes
    "kv_cache_type_k": "--cache-type-k", "kv_cache_type_v": "--cache-type-v",
    "grace_period_s": "--grace-period",
    "drain_delay_s": "--drain-delay", "keepalive_time_s": "--keepalive-time",
    "keepalive_timeout_s": "--keepalive-timeout", "min_ping_interval_s": "--min-ping-interval",
    "max_connection_age_s": "--max-connection-age",
}
_HELP = {
    "model": "GGUF file or known model name, fetched on first use",
    "models_dir": "where fetched models live ('' = models/ in the repository)",
    "chat_template": "chat template for chat input: a built-in (chatml, gemma) or a Jinja file "
                     "('' = the model's own; chat input is refused without one)",
    "host": "gRPC listen address (0.0.0.0 / [::] = every interface, which needs TLS or "
            "--plaintext)",
    "port": "gRPC port (0 = any free port, logged)",
    "metrics_host": "Prometheus listen address",
    "metrics_port": "Prometheus /metrics port (0 = any free port, -1 = off)",
    "grace_period_s": "seconds in-flight streams get to finish after SIGTERM",
    "drain_delay_s": "seconds to report NOT_SERVING after SIGTERM before closing the port",
    "max_receive_message_bytes": "largest request accepted",
    "max_send_message_bytes": "largest response sent",
    "keepalive_time_s": "server pings a quiet connection after this many seconds",
    "keepalive_timeout_s": "drop a connection whose keepalive ping is unanswered this long",
    "min_ping_interval_s": "client pings closer than this count as abuse (GOAWAY)",
    "max_connection_age_s": "GOAWAY connections older than this, for rebalancing (0 = never)",
    "stream_buffer": "events held per stream before pending Deltas are merged",
    "vllm_engine": "also serve the vLLM engine protocol (vllm.grpc.engine.VllmEngine) on the "
                   "same port, for the SMG gateway (docs/scale-out.md)",
    "vllm_add_bos": "vLLM engine protocol: prepend BOS to a prompt that lacks it when the "
                    "vocabulary adds one, as the own text input does (the SMG gateway tokenizes "
                    "completion prompts without special tokens)",
    "log_level": "debug, info, warning or error",
    "log_format": "json or console",
    "tls_cert_file": "PEM certificate chain: serve TLS (with --tls-key-file); reloaded on SIGHUP",
    "tls_key_file": "PEM private key of --tls-cert-file",
    "tls_client_ca_file": "PEM CA bundle: require client certificates it signed (mutual TLS)",
    "plaintext": "serve without TLS on an address other than loopback (e.g. behind a "
                 "service-mesh sidecar doing mTLS)",
    "auth_token_file": "bearer tokens, one per line (optionally followed by the services or "
                       "methods each may call): every RPC but health needs "
                       "'authorization: Bearer TOKEN'; reloaded on SIGHUP",
    "reflection": "serve gRPC reflection (false: clients need the .proto files)",
    "config_rpcs": "serve GetConfig and ValidateConfig (false: UNIMPLEMENTED)",
    "chat_special_tokens": "turn special-token text inside chat message content into control "
                           "tokens (false: content is text, as a user typed it)",
    "kv_cache_type_k": "KV cache element type of keys (supported pairs below)",
    "kv_cache_type_v": "KV cache element type of values",
    "verify_width": f"tokens verified per speculative step, {MIN_VERIFY_WIDTH}..{MAX_VERIFY_WIDTH}"
                    " (1 = no speculation)",
    "drafter": "speculative drafter: " + ", ".join(DRAFTERS),
    "draft_model": "drafter 'model': the draft GGUF (path or known model name); it must share "
                   "the target's vocabulary. drafter 'eagle3' / 'dflash': an EAGLE-3 / DFlash "
                   "GGUF (llama.cpp's format) made for the target",
    "ngram_size": "n-gram length the lookup drafter matches, 1..8",
    "suffix_cache_tokens": "drafter 'suffix': tokens of recently finished requests' prompts and "
                           "outputs it drafts from, 0..16777216 (LRU by tokens; 0: none)",
    "draft_p_min": "drafter 'dflash' with a DSpark file's confidence head: drafts stop at the "
                   "first whose predicted acceptance is below this, 0..1 (llama.cpp's "
                   "--spec-draft-p-min; 0 = off)",
    "tree_budget": f"tree verify (DDTree) nodes per step, 2..{MAX_TREE_BUDGET}; 0 = chain verify",
    "backend": "compute backend: " + ", ".join(BACKENDS),
    "n_ctx": "context tokens per sequence (capped at the model's trained length)",
    "gemv_mma": "CUDA backend: every GEMV over Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K "
                "weights on int8 tensor cores "
                "(throughput mode: batched and verify steps cost much less, one stream a little "
                "more; results differ from the default kernels' in the last bits, and stay "
                "batch-invariant and exact for speculation within the mode)",
    "n_slots": "sequences running at once (each holds KV blocks; more wait in the queue)",
    "prefill_chunk": "prompt tokens per prefill chunk; also the padded rows of one wide step, "
                     "which holds several prompts' chunks of more than 64 tokens at once",
    "max_step_tokens": "tokens one engine iteration computes: a decode step of up to "
                       "min(64, N - 16) rows, then a wide step of min(prefill_chunk, N - "
                       "rows) rows (0 = prefill_chunk + 64)",
    "kv_cache_memory": "KV cache pool size: bytes (8GiB, 512MiB, 2000000000) or a fraction "
                       "(0.5) of the memory free after loading the model; '' = a full context "
                       "(n_ctx) for every slot, within 0.8 of that free memory on a GPU, 0.25 "
                       "on the CPU",
    "kv_block_size": "positions per KV cache block (a power of two, 8..256)",
    "prefix_cache": "reuse the KV blocks of identical prompt prefixes (false: compute every "
                    "prompt in full)",
    "prefix_cache_exact": "reuse only cached KV rows computed the way this prompt's own prefill "
                          "would compute them, so a request's tokens are the same with or "
                          "without a cache hit (a hit ending inside a prefill chunk of more "
                          "than 64 tokens recomputes that chunk: no hit at all for prompts of "
                          "65 to prefill_chunk tokens); false: reuse every matching block "
                          "(earlier first tokens; a near-tie may then resolve otherwise than "
                          "in a fresh run)",
    "max_queue": "requests that may wait for a slot before RESOURCE_EXHAUSTED",
    "threads": "CPU backend threads (0 = all cores)",
    "cuda_graphs": "CUDA backend: replay each step shape from a captured CUDA graph (false: "
                   "launch every kernel eagerly, for debugging)",
    "step_profile": "time every decode step's draft / heads / verify / other parts: logged per "
                    "step at debug level, summed per request into Finished timings",
    "overlap": "auto, on or off: submit each plain decode step before the last one is read "
               "back, so the host's work hides behind the device's (auto: on where the backend "
               "runs steps asynchronously, the CUDA backend; off: one step at a time)",
}


@dataclass(frozen=True)
class Setting:
    section: str                     # "server" | "engine": the config-file table
    name: str                        # dataclass field and config-file key
    kind: type                       # int | float | str | bool
    default: object

    @property
    def flag(self) -> str:
        return _FLAG_NAMES.get(self.name, "--" + self.name.replace("_", "-"))

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag[2:].upper().replace("-", "_")


def settings() -> list[Setting]:
    """Every configurable value of ServerConfig and EngineConfig, in declaration order."""
    out = []
    for section, cls in (("server", ServerConfig), ("engine", EngineConfig)):
        for f in fields(cls):
            out.append(Setting(section, f.name, type(f.default), f.default))
    return out


def _convert(setting: Setting, raw: object) -> tuple[object, str | None]:
    """(value, None) or (None, problem message). Strings come from env and flags; TOML is typed."""
    kind = setting.kind
    if isinstance(raw, str) and kind is not str:
        text = raw.strip().lower()
        try:
            if kind is bool:
                if text not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError
                return text in ("1", "true", "yes", "on"), None
            return kind(text), None
        except ValueError:
            return None, f"not {_KIND_WORDS[kind]}"
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw), None
    if type(raw) is not kind:
        return None, f"not {_KIND_WORDS[kind]}"
    return raw, None


_KIND_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def toml_value(value: object) -> str:
    """`value` as a config file spells it: true/false, "text", 1.5, [1, 2]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)    # a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def build_serve_parser() -> argparse.ArgumentParser:
    """`specstream serve` flags. Values stay strings here; the loader converts and checks them."""
    p = argparse.ArgumentParser(
        prog="specstream serve", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a GGUF model over gRPC (GenerationService, ConfigService, health, "
                    "reflection) with Prometheus metrics on their own port.",
        epilog="Every flag also reads SPECSTREAM_<FLAG> (e.g. SPECSTREAM_CACHE_TYPE_K) and the "
               "config file's [server]/[engine] tables (keys are the field names, e.g. "
               "kv_cache_type_k). Precedence: defaults < config file < env < flags.\n\n"
               + supported_pairs_listing()
               + f"\nverify width: {MIN_VERIFY_WIDTH}..{MAX_VERIFY_WIDTH}")
    p.add_argument("--config", help=f"TOML config file (env {CONFIG_FILE_ENV})")
    for s in settings():
        help_text = (_HELP.get(s.name, s.name.replace("_", " "))
                     + f" (default: {toml_value(s.default)})")
        help_text = help_text.replace("%", "%%")     # argparse %-formats every help string
        if s.name == "model":
            p.add_argument("model", nargs="?", metavar="MODEL", help=help_text)
        elif s.kind is bool:     # `--step-profile` alone means true
            p.add_argument(s.flag, dest=s.name, metavar="BOOL", nargs="?", const="true",
                           help=help_text)
        else:
            p.add_argument(s.flag, dest=s.name, metavar=s.kind.__name__.upper(), help=help_text)
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const="false",
                   help="the same as --cuda-graphs false")
    p.add_argument("--no-overlap", dest="overlap", action="store_const", const="off",
                   help="the same as --overlap off")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_const",
                   const="false", help="the same as --prefix-cache false")
    p.add_argument("--no-reflection", dest="reflection", action="store_const", const="false",
                   help="the same as --reflection false")
    p.add_argument("--no-config-rpcs", dest="config_rpcs", action="store_const",
                   const="false", help="the same as --config-rpcs false")
    p.add_argument("--no-vllm-engine", dest="vllm_engine", action="store_const",
                   const="false", help="the same as --vllm-engine false")
    return p


def _read_config_file(path: Path, problems: list[tuple[str, str]]) -> dict[str, dict]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        problems.append(("config", f"cannot read config file {str(path)!r}: {e.strerror}"))
        return {}
    except tomllib.TOMLDecodeError as e:
        problems.append(("config", f"config file {str(path)!r} is not valid TOML: {e}"))
        return {}
    known = {(s.section, s.name) for s in settings()}
    out: dict[str, dict] = {"server": {}, "engine": {}}
    for section, table in data.items():
        if section not in out or not isinstance(table, dict):
            problems.append(("config", f"unknown table [{section}] in {str(path)!r}; "
                                       "use [server] and [engine]"))
            continue
        for key, value in table.items():
            if (section, key) not in known:
                problems.append((f"{section}.{key}", f"unknown setting in {str(path)!r}"))
            else:
                out[section][key] = value
    return out


def load_config(argv: Sequence[str] = (), env: Mapping[str, str] | None = None,
                config_file: str | os.PathLike | None = None
                ) -> tuple[ServerConfig, EngineConfig]:
    """Merges defaults < config file < env < flags and checks both configs.

    Raises ConfigError listing every problem (unknown flags, unparsable values, out-of-range
    settings, unsupported KV pairs with the supported listing). argparse exits on --help only.
    """
    env = os.environ if env is None else env
    problems: list[tuple[str, str]] = []
    args, unknown = build_serve_parser().parse_known_args(list(argv))
    for arg in unknown:
        problems.append(("argv", f"unrecognized argument {arg!r}"))
    path = config_file or args.config or env.get(CONFIG_FILE_ENV, "").strip() or None
    from_file = _read_config_file(Path(path).expanduser(), problems) if path else {}

    values: dict[str, dict[str, object]] = {"server": {}, "engine": {}}
    origins: dict[str, str] = {}     # field -> where its value came from, unless a flag
    for s in settings():
        layers = [(from_file.get(s.section, {}).get(s.name), "file"),
                  (env.get(s.env), "env"), (getattr(args, s.name), "flag")]
        for raw, layer in layers:
            if raw is None:
                continue
            origin = _origin(s, layer, raw, path)
            value, problem = _convert(s, raw)
            if problem:
                problems.append((s.name, f"{origin}: {problem}"))
                continue
            values[s.section][s.name] = value
            if layer == "flag":
                origins.pop(s.name, None)
            else:
                origins[s.name] = origin
    server = ServerConfig(**values["server"])
    engine = EngineConfig(**values["engine"])
    problems += [_with_origin(name, message, origins)
                 for name, message in server.problems() + engine.problems()]
    if problems:
        raise ConfigError(problems)
    return server, engine


def _origin(s: Setting, layer: str, raw: object, path: object) -> str:
    """How the user wrote a value: `SPECSTREAM_PORT=x`, `--port x`, `FILE [server] port = x`."""
    if layer == "file":
        return f"{path} [{s.section}] {s.name} = {toml_value(raw)}"
    if layer == "env":
        return f"{s.env}={shlex.quote(str(raw))}"
    return shlex.quote(str(raw)) if s.name == "model" else f"{s.flag} {shlex.quote(str(raw))}"


def _with_origin(name: str, message: str, origins: Mapping[str, str]) -> tuple[str, str]:
    """Prefixes a range problem with the env var or file key that set the value. A flag's value
    keeps the bare message, which is what ValidateConfig (no flags involved) also reports."""
    named = [origins[n] for n in name.split(",") if n in origins]
    return (name, ", ".join(named) + ": " + message) if named else (name, message)


def format_problems(problems: Sequence[tuple[str, str]]) -> str:
    """One block per problem, for a terminal: `field: message` with continuation lines indented."""
    lines = [f"invalid configuration ({len(problems)} problem{'s' * (len(problems) != 1)}):"]
    for name, message in problems:
        first, *rest = message.split("\n")
        lines.append(f"  {name}: {first}")
        lines += [f"    {r}" for r in rest]
    return "\n".join(lines)
