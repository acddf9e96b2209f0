"""Frozen configuration dataclasses. The only module that reads argv, env vars or config files.

`EngineConfig.problems()` lists every invalid value at once as (field, message) pairs, so the
CLI, startup and the ValidateConfig RPC report the same problems with the same words.
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

from service.errors import ConfigError
from service.formats import KV_TYPES, supported_kv_pairs

# SUPPORTED_KV_PAIRS is what the backends' kernels do (service.formats.BACKEND_KV_TYPES; 'auto'
# may pick either backend, so the pairs both support).
SUPPORTED_KV_PAIRS: tuple[tuple[str, str], ...] = supported_kv_pairs("auto")
MIN_VERIFY_WIDTH = 1
MAX_VERIFY_WIDTH = 16            # one step processes 1..16 tokens (decode, verify, batching)
MAX_TREE_BUDGET = MAX_VERIFY_WIDTH   # tree verify: nodes per step (0 = chain verify)
BACKENDS = ("auto", "cpu", "cuda")
DRAFTERS = ("none", "ngram", "model")


def supported_pairs_listing() -> str:
    """A header line and one line per supported (K, V) pair, for errors and --help."""
    lines = [f"supported KV cache type pairs (K, V): {len(SUPPORTED_KV_PAIRS)}"]
    lines += [f"  {k} {v}" for k, v in SUPPORTED_KV_PAIRS]
    return "\n".join(lines)


@dataclass(frozen=True)
class EngineConfig:
    kv_cache_type_k: str = "f16"
    kv_cache_type_v: str = "f16"
    verify_width: int = 4            # tokens verified per speculative step (1 = no speculation)
    drafter: str = "ngram"           # "none" | "ngram" (prompt lookup) | "model" (draft GGUF)
    draft_model: str = ""            # drafter "model": the draft GGUF (path or known name)
    ngram_size: int = 3              # n-gram length the lookup drafter matches
    tree_budget: int = 0             # > 0: tree verify (DDTree) with this many nodes; 0: chain
    backend: str = "auto"
    n_ctx: int = 4096                # context per sequence; capped at the model's trained length
    n_slots: int = 64                # sequences running at once (each holds KV blocks)
    prefill_chunk: int = 256         # prompt tokens per prefill step
    max_step_tokens: int = 0         # tokens one engine iteration computes; 0 = chunk + 64
    kv_cache_memory: str = ""        # KV pool: bytes ("8GiB"), a fraction ("0.5"); see pool_blocks
    kv_block_size: int = 16          # positions per KV block (a power of two, 8..256)
    prefix_cache: bool = True        # reuse the KV blocks of identical prompt prefixes
    max_queue: int = 64              # requests waiting for a slot before RESOURCE_EXHAUSTED
    threads: int = 0                 # CPU backend threads; 0 = all cores
    cuda_graphs: bool = True         # CUDA backend: capture each step shape once and replay it
    step_profile: bool = False       # time each decode step's parts (log + Finished timings)
    gemv_mma: bool = False           # CUDA: Q4_K/Q6_K GEMVs on int8 tensor cores at every width

    def problems(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        pair = (self.kv_cache_type_k, self.kv_cache_type_v)
        known = all(p in KV_TYPES for p in pair)
        for side, (name, value) in enumerate(zip(("kv_cache_type_k", "kv_cache_type_v"), pair,
                                                 strict=True)):
            if value not in KV_TYPES:
                out.append((name, f"unknown KV cache type {value!r}; known types: "
                                  + ", ".join(KV_TYPES)))
            elif not known and all(p[side] != value for p in SUPPORTED_KV_PAIRS):
                # the pair cannot be judged, but this side is wrong whatever the other one is
                out.append((name, f"KV cache type {value!r} is in no supported pair as "
                                  f"{'KV'[side]}; " + supported_pairs_listing()))
        if known and pair not in SUPPORTED_KV_PAIRS:
            out.append(("kv_cache_type_k,kv_cache_type_v",
                        f"unsupported KV cache type pair (K={pair[0]}, V={pair[1]}); "
                        + supported_pairs_listing()))
        if not MIN_VERIFY_WIDTH <= self.verify_width <= MAX_VERIFY_WIDTH:
            out.append(("verify_width", f"{self.verify_width} is out of range; allowed range "
                                        f"is {MIN_VERIFY_WIDTH}..{MAX_VERIFY_WIDTH}"))
        if self.drafter not in DRAFTERS:
            out.append(("drafter", f"unknown drafter {self.drafter!r}; one of "
                                   + ", ".join(DRAFTERS)))
        if self.drafter == "model" and not self.draft_model.strip():
            out.append(("draft_model", "the model drafter needs a draft model: a .gguf path or "
                                       "a known model name sharing the target's vocabulary"))
        if self.tree_budget != 0 and not 2 <= self.tree_budget <= MAX_TREE_BUDGET:
            out.append(("tree_budget", f"{self.tree_budget} is out of range; allowed 0 (chain "
                                       f"verify) or 2..{MAX_TREE_BUDGET}"))
        if not 1 <= self.ngram_size <= 8:
            out.append(("ngram_size", f"{self.ngram_size} is out of range; allowed 1..8"))
        if self.backend not in BACKENDS:
            out.append(("backend", f"unknown backend {self.backend!r}; one of "
                                   + ", ".join(BACKENDS)))
        if not 16 <= self.n_ctx <= 1 << 20:
            out.append(("n_ctx", f"{self.n_ctx} is out of range; allowed 16..1048576"))
        if not 1 <= self.n_slots <= 256:
            out.append(("n_slots", f"{self.n_slots} is out of range; allowed 1..256"))
        if not 1 <= self.prefill_chunk <= 1024:
            out.append(("prefill_chunk", f"{self.prefill_chunk} is out of range; allowed 1..1024"))
        if self.max_step_tokens and not 32 <= self.max_step_tokens <= 4096:
            out.append(("max_step_tokens", f"{self.max_step_tokens} is out of range; allowed 0 "
                                           "(prefill_chunk + 64) or 32..4096"))
        try:
            parse_memory(self.kv_cache_memory)
        except ValueError as e:
            out.append(("kv_cache_memory", str(e)))
        bs = self.kv_block_size
        if not 8 <= bs <= 256 or bs & (bs - 1):
            out.append(("kv_block_size", f"{bs} is not a power of two in 8..256"))
        if not 0 <= self.max_queue <= 100_000:
            out.append(("max_queue", f"{self.max_queue} is out of range; allowed 0..100000"))
        if not 0 <= self.threads <= 1024:
            out.append(("threads", f"{self.threads} is out of range; allowed 0..1024"))
        return out


MAX_STEP_ROWS = 64               # rows of one decode step (all sequences' tokens together)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40,
          "tb": 10**12, "tib": 1 << 40}


def parse_memory(text: str) -> tuple[str, float]:
    """kv_cache_memory: ("default", 0) for "", ("bytes", n) for "8GiB" / "512MiB" / "1e9" /
    "4096", ("fraction", f) for a number in (0, 1] such as "0.5". ValueError with the rules."""
    t = text.strip().lower().replace(" ", "")
    if not t:
        return "default", 0.0
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0 or value != value:
        raise ValueError(f"{text!r} is neither a size (e.g. 8GiB, 512MiB, 2000000000) nor a "
                         "fraction in (0, 1] of the memory free after loading the model")
    if not unit and value <= 1:
        return "fraction", value
    return "bytes", value * _UNITS[unit]


def step_budget(config: EngineConfig) -> tuple[int, int]:
    """(decode rows per step, prefill chunk) under config.max_step_tokens B: the decode step
    holds at most min(64, B - 16) rows and the prefill chunk is min(prefill_chunk, B - rows),
    a fixed size so a prompt's KV rows never depend on the load. B = 0: 64 rows and
    prefill_chunk."""
    b = config.max_step_tokens
    if not b:
        return MAX_STEP_ROWS, config.prefill_chunk
    rows = min(MAX_STEP_ROWS, b - 16)
    return rows, min(config.prefill_chunk, b - rows)


# ---------------------------------------------------------------- model directory
MODELS_DIR_ENV = "SPECSTREAM_MODELS_DIR"


def models_dir_from_env() -> Path:
    """Where fetched models live: $SPECSTREAM_MODELS_DIR, else `models/` at the repository root."""
    value = os.environ.get(MODELS_DIR_ENV, "").strip()
    if value:
        return Path(value).expanduser()
    return Path(__file__).resolve().parent.parent / "models"


# ---------------------------------------------------------------- server configuration
DEFAULT_MODEL = "smollm2-135m"   # the embedded default model (service.gguf.fetch.MODELS)
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "console")
MIB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    model: str = DEFAULT_MODEL       # a .gguf path or a known model name (fetched on first use)
    models_dir: str = ""             # where fetched models live; "" = repository models/
    chat_template: str = ""          # built-in template name or Jinja file; "" = the model's own
    host: str = "[::]"               # gRPC listen address; [::] listens on IPv6 and IPv4
    port: int = 50051                # gRPC port; 0 picks a free one (logged)
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9464         # Prometheus /metrics; 0 picks a free one; -1 turns it off
    grace_period_s: float = 10.0     # SIGTERM: in-flight streams get this long to finish
    drain_delay_s: float = 0.0       # SIGTERM: report NOT_SERVING this long before closing
    max_receive_message_bytes: int = 32 * MIB  # long token-id prompts fit; not unlimited
    max_send_message_bytes: int = 32 * MIB
    keepalive_time_s: float = 60.0   # server pings a connection quiet for this long
    keepalive_timeout_s: float = 20.0  # ...and drops it if the ping is not answered in time
    min_ping_interval_s: float = 10.0  # client pings closer together than this count as abuse
    max_connection_age_s: float = 0.0  # > 0: GOAWAY after this long, so load balancers rebalance
    stream_buffer: int = 64          # events held per stream before pending deltas are merged
    log_level: str = "info"
    log_format: str = "json"

    def problems(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []

        def check(name: str, ok: bool, message: str) -> None:
            if not ok:
                out.append((name, f"{getattr(self, name)!r} is out of range; {message}"))

        if not self.model.strip():
            out.append(("model", "must name a .gguf file or a known model"))
        if self.chat_template:
            from service.model.chat import load_template

            try:
                load_template(self.chat_template)
            except ConfigError as e:
                out += e.problems
        check("port", 0 <= self.port <= 65535, "allowed 0..65535")
        check("metrics_port", -1 <= self.metrics_port <= 65535, "allowed -1..65535 (-1: off)")
        if self.port and self.port == self.metrics_port:
            out.append(("metrics_port", f"{self.metrics_port} is also the gRPC port"))
        check("grace_period_s", 0 <= self.grace_period_s <= 3600, "allowed 0..3600 s")
        check("drain_delay_s", 0 <= self.drain_delay_s <= 3600, "allowed 0..3600 s")
        for name in ("max_receive_message_bytes", "max_send_message_bytes"):
            check(name, 1024 <= getattr(self, name) <= 2**31 - 1, "allowed 1024..2147483647")
        check("keepalive_time_s", 1 <= self.keepalive_time_s <= 86400, "allowed 1..86400 s")
        check("keepalive_timeout_s", 1 <= self.keepalive_timeout_s <= 3600, "allowed 1..3600 s")
        check("min_ping_interval_s", 0 <= self.min_ping_interval_s <= 3600, "allowed 0..3600 s")
        check("max_connection_age_s", 0 <= self.max_connection_age_s <= 10**7,
              "allowed 0 (unlimited) .. 10000000 s")
        check("stream_buffer", 1 <= self.stream_buffer <= 100_000, "allowed 1..100000")
        if self.log_level not in LOG_LEVELS:
            out.append(("log_level", f"unknown log level {self.log_level!r}; one of "
                                     + ", ".join(LOG_LEVELS)))
        if self.log_format not in LOG_FORMATS:
            out.append(("log_format", f"unknown log format {self.log_format!r}; one of "
                                      + ", ".join(LOG_FORMATS)))
        return out

    def resolved_models_dir(self) -> Path:
        return Path(self.models_dir).expanduser() if self.models_dir else models_dir_from_env()


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
    "host": "gRPC listen address ([::] = every IPv6 and IPv4 interface)",
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
    "log_level": "debug, info, warning or error",
    "log_format": "json or console",
    "kv_cache_type_k": "KV cache element type of keys (supported pairs below)",
    "kv_cache_type_v": "KV cache element type of values",
    "verify_width": f"tokens verified per speculative step, {MIN_VERIFY_WIDTH}..{MAX_VERIFY_WIDTH}"
                    " (1 = no speculation)",
    "drafter": "speculative drafter: " + ", ".join(DRAFTERS),
    "draft_model": "drafter 'model': the draft GGUF (path or known model name); it must share "
                   "the target's vocabulary",
    "ngram_size": "n-gram length the lookup drafter matches, 1..8",
    "tree_budget": f"tree verify (DDTree) nodes per step, 2..{MAX_TREE_BUDGET}; 0 = chain verify",
    "backend": "compute backend: " + ", ".join(BACKENDS),
    "n_ctx": "context tokens per sequence (capped at the model's trained length)",
    "gemv_mma": "CUDA backend: every GEMV over Q4_K / Q6_K weights on int8 tensor cores "
                "(throughput mode: batched and verify steps cost much less, one stream a little "
                "more; results differ from the default kernels' in the last bits, and stay "
                "batch-invariant and exact for speculation within the mode)",
    "n_slots": "sequences running at once (each holds KV blocks; more wait in the queue)",
    "prefill_chunk": "prompt tokens per prefill step",
    "max_step_tokens": "tokens one engine iteration computes: a decode step of up to "
                       "min(64, N - 16) rows, then a prefill chunk of min(prefill_chunk, N - "
                       "rows) (0 = prefill_chunk + 64)",
    "kv_cache_memory": "KV cache pool size: bytes (8GiB, 512MiB, 2000000000) or a fraction "
                       "(0.5) of the memory free after loading the model; '' = room for "
                       "min(n_slots, 8) full contexts (n_ctx each)",
    "kv_block_size": "positions per KV cache block (a power of two, 8..256)",
    "prefix_cache": "reuse the KV blocks of identical prompt prefixes (false: compute every "
                    "prompt in full)",
    "max_queue": "requests that may wait for a slot before RESOURCE_EXHAUSTED",
    "threads": "CPU backend threads (0 = all cores)",
    "cuda_graphs": "CUDA backend: replay each step shape from a captured CUDA graph (false: "
                   "launch every kernel eagerly, for debugging)",
    "step_profile": "time every decode step's draft / heads / verify / other parts: logged per "
                    "step at debug level, summed per request into Finished timings",
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
        if s.name == "model":
            p.add_argument("model", nargs="?", metavar="MODEL", help=help_text)
        elif s.kind is bool:     # `--step-profile` alone means true
            p.add_argument(s.flag, dest=s.name, metavar="BOOL", nargs="?", const="true",
                           help=help_text)
        else:
            p.add_argument(s.flag, dest=s.name, metavar=s.kind.__name__.upper(), help=help_text)
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const="false",
                   help="the same as --cuda-graphs false")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_const",
                   const="false", help="the same as --prefix-cache false")
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
