"""`specstream-client`: talk to a specstream server from a terminal.

    specstream-client generate "Once upon a time" -n 32 --temperature 0
    specstream-client generate --chat "What is GGUF?" --json
    specstream-client info | tokenize "hello" | detokenize 1 2 3 | config | health
    specstream-client validate-config --cache-type-k q8_0 --cache-type-v q4_1 --verify-width 20

Exit status: 0 success, 1 a failed call (or an invalid config for validate-config), 2 usage,
130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

from clients.client import (
    Completion,
    SpecstreamClient,
    build_generate_request,
    default_target,
    error_details,
    tls_credentials,
)
from service.proto_build import stubs


def _dict(msg: Any) -> dict:
    return MessageToDict(msg, preserving_proto_field_name=True)


def _print_json(msg: Any) -> None:
    print(json.dumps(_dict(msg), ensure_ascii=False), flush=True)


# ------------------------------------------------------------------------- commands
def logit_bias_arg(text: str) -> tuple[int, float]:
    """'ID=BIAS' as (token id, bias)."""
    tok, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError(text)
        return int(tok), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS, got {text!r}") from None


def cmd_generate(c: SpecstreamClient, a: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if a.prompt == "-" else a.prompt
    kw: dict[str, Any] = {}
    if a.tokens:
        kw["tokens"] = [int(t) for t in prompt.replace(",", " ").split()]
    elif a.chat:
        kw["chat"] = ([("system", a.system)] if a.system else []) + [("user", prompt)]
    else:
        kw["prompt"] = prompt
    req = build_generate_request(
        **kw, request_id=a.request_id, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
        min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed,
        max_new_tokens=a.max_new_tokens, stop=a.stop, stop_token_ids=a.stop_token_id,
        ignore_eos=a.ignore_eos or None, top_logprobs=a.top_logprobs, speculative=a.speculative,
        speculative_mode=a.speculative_mode, speculative_width=a.speculative_width,
        speculative_tree_budget=a.speculative_tree_budget,
        frequency_penalty=a.frequency_penalty, presence_penalty=a.presence_penalty,
        logit_bias=dict(a.logit_bias) or None, min_tokens=a.min_tokens, n=a.samples,
        prompt_logprobs=True if a.prompt_logprobs is not None else None,
        prompt_top_logprobs=a.prompt_logprobs)
    if (a.samples or 1) > 1 and not a.json:
        raise ValueError("--samples above 1 needs --json (each line carries its index)")
    done = Completion()
    for r in c.generate(request=req):
        done.add(r)
        if a.json:
            _print_json(r)
        elif r.HasField("delta"):
            sys.stdout.write(r.delta.text)
            sys.stdout.flush()
    if not a.json:
        sys.stdout.write("\n")
        if not a.quiet:
            print(_stats(done), file=sys.stderr)
    return 0


def _stats(done: Completion) -> str:
    t, u = done.timings, done.usage
    rate = (1e3 / t.per_token_decode_ms) if t and t.per_token_decode_ms else 0.0
    stop = (f" stop={done.stop_sequence!r}" if done.stop_sequence is not None else
            f" stop_token={done.stop_token_id}" if done.stop_token_id is not None else "")
    spec = (f" draft={u.accepted_draft_tokens}/{u.draft_tokens}" if u and u.draft_tokens else "")
    return (f"[{done.request_id}] finish={done.finish_reason}{stop} prompt={done.prompt_tokens} "
            f"completion={len(done.token_ids)}{spec} seed={done.seed} "
            f"ttft={t.time_to_first_token_ms:.1f}ms decode={rate:.1f} tok/s")


def cmd_info(c: SpecstreamClient, a: argparse.Namespace) -> int:
    print(json.dumps(_dict(c.model_info()), indent=2, ensure_ascii=False))
    return 0


def cmd_config(c: SpecstreamClient, a: argparse.Namespace) -> int:
    print(json.dumps(_dict(c.get_config()), indent=2))
    return 0


def cmd_tokenize(c: SpecstreamClient, a: argparse.Namespace) -> int:
    text = sys.stdin.read() if a.text == "-" else a.text
    r = (c.tokenize(chat=[("user", text)]) if a.chat else
         c.tokenize(text, add_bos=a.add_bos, parse_special=a.parse_special or None))
    if a.json:
        print(json.dumps({"ids": list(r.ids),
                          "pieces": [p.decode("utf-8", "replace") for p in r.pieces]},
                         ensure_ascii=False))
    else:
        for tid, piece in zip(r.ids, r.pieces, strict=True):
            print(f"{tid}\t{piece!r}")
    return 0


def cmd_detokenize(c: SpecstreamClient, a: argparse.Namespace) -> int:
    ids = [int(t) for t in " ".join(a.ids).replace(",", " ").split()]
    print(c.detokenize(ids, skip_special=a.skip_special or None))
    return 0


def cmd_validate(c: SpecstreamClient, a: argparse.Namespace) -> int:
    given = {name: getattr(a, name) for name, _, _ in _engine_flags()}
    r = c.validate_config(**given)
    if a.json:
        _print_json(r)
    elif r.valid:
        print("valid")
    else:
        print(f"invalid ({len(r.problems)} problem{'s' * (len(r.problems) != 1)}):")
        for p in r.problems:
            first, *rest = p.message.split("\n")
            print(f"  {p.field}: {first}")
            for line in rest:
                print(f"    {line}")
    return 0 if r.valid else 1


def cmd_health(c: SpecstreamClient, a: argparse.Namespace) -> int:
    if a.wait:
        c.wait_ready(a.wait, a.service)
    status = c.health(a.service)
    print(status)
    return 0 if status == "SERVING" else 1


# ------------------------------------------------------------------------- parser
# The server's flag of an engine setting is its field name with dashes, except these
# (service/config/loader.py; tests/service/test_client_flags.py checks both sides agree).
_FLAG_NAMES = {"kv_cache_type_k": "--cache-type-k", "kv_cache_type_v": "--cache-type-v"}


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return t in ("1", "true", "yes", "on")


def _engine_flags() -> list[tuple[str, str, Any]]:
    """(field, flag, argparse type) of every field of the API's EngineConfig message."""
    kinds = {FieldDescriptor.TYPE_STRING: str, FieldDescriptor.TYPE_BOOL: _bool,
             FieldDescriptor.TYPE_FLOAT: float, FieldDescriptor.TYPE_DOUBLE: float}
    return [(f.name, _FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-")),
             kinds.get(f.type, int))
            for f in stubs().config_pb2.EngineConfig.DESCRIPTOR.fields]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specstream-client", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=default_target(),
                   help="server host:port (env SPECSTREAM_TARGET; default %(default)s)")
    p.add_argument("--timeout", type=float, default=None, help="deadline per call, seconds")
    p.add_argument("--tls", action="store_true",
                   help="connect with TLS, verifying the server against the system's CAs")
    p.add_argument("--ca-cert", metavar="PEM", help="connect with TLS, verifying the server "
                                                    "against this CA bundle")
    p.add_argument("--client-cert", metavar="PEM", help="mutual TLS: this client's certificate")
    p.add_argument("--client-key", metavar="PEM", help="mutual TLS: its private key")
    p.add_argument("--token-file", metavar="FILE", default=os.environ.get(TOKEN_FILE_ENV),
                   help="send the bearer token on this file's first line (env "
                        f"{TOKEN_FILE_ENV})")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a completion, printing tokens as they arrive")
    g.add_argument("prompt", help="prompt text ('-' reads stdin)")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    g.add_argument("--system", help="with --chat: a system message first")
    g.add_argument("--tokens", action="store_true", help="the prompt is token ids ('1,2,3')")
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--min-p", type=float)
    g.add_argument("--repetition-penalty", type=float)
    g.add_argument("--frequency-penalty", type=float, help="in [-2, 2], over generated tokens")
    g.add_argument("--presence-penalty", type=float, help="in [-2, 2], over generated tokens")
    g.add_argument("--logit-bias", action="append", type=logit_bias_arg, default=[],
                   metavar="ID=BIAS", help="add BIAS (-100..100) to token ID's logit "
                   "(repeatable)")
    g.add_argument("--min-tokens", type=int, help="no EOS / stop before this many tokens")
    g.add_argument("--samples", type=int, metavar="N",
                   help="N parallel samples of the prompt (1..16; needs --json)")
    g.add_argument("--prompt-logprobs", type=int, metavar="K",
                   help="the prompt's log-probabilities in started, K alternatives each")
    g.add_argument("--seed", type=int)
    g.add_argument("-n", "--max-new-tokens", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=[],
                   help="stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--top-logprobs", type=int)
    g.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--speculative-mode", choices=("chain", "tree", "off"))
    g.add_argument("--speculative-width", type=int, metavar="N",
                   help="chain verify rows, 2..the server's verify_width")
    g.add_argument("--speculative-tree-budget", type=int, metavar="N",
                   help="tree verify nodes, 2..the server's tree_budget")
    g.add_argument("--request-id", default="")
    g.add_argument("--json", action="store_true", help="print every response as a JSON line")
    g.add_argument("-q", "--quiet", action="store_true", help="no stats line on stderr")
    g.set_defaults(func=cmd_generate)

    sub.add_parser("info", help="model info (GetModelInfo)").set_defaults(func=cmd_info)
    sub.add_parser("config", help="effective engine config (GetConfig)").set_defaults(
        func=cmd_config)

    t = sub.add_parser("tokenize", help="text to token ids and pieces")
    t.add_argument("text", help="text ('-' reads stdin)")
    t.add_argument("--chat", action="store_true", help="render as a user chat message first")
    t.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=None)
    t.add_argument("--parse-special", action="store_true")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=cmd_tokenize)

    d = sub.add_parser("detokenize", help="token ids to text")
    d.add_argument("ids", nargs="+", help="token ids (spaces or commas)")
    d.add_argument("--skip-special", action="store_true")
    d.set_defaults(func=cmd_detokenize)

    v = sub.add_parser("validate-config", help="dry-run engine settings (ValidateConfig); "
                       "unset settings take the server's current values")
    for name, flag, kind in _engine_flags():
        v.add_argument(flag, dest=name, type=kind,
                       metavar="BOOL" if kind is _bool else kind.__name__.upper())
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_validate)

    h = sub.add_parser("health", help="grpc.health.v1 status")
    h.add_argument("--service", default="", help="service name ('' = the whole server)")
    h.add_argument("--wait", type=float, default=0.0, help="wait up to S seconds for SERVING")
    h.set_defaults(func=cmd_health)
    return p


TOKEN_FILE_ENV = "SPECSTREAM_TOKEN_FILE"


def _security(a: argparse.Namespace) -> dict:
    """The client's TLS credentials and bearer token, as the flags ask."""
    out: dict = {}
    if a.tls or a.ca_cert or a.client_cert or a.client_key:
        out["credentials"] = tls_credentials(a.ca_cert, a.client_cert, a.client_key)
    if a.token_file:
        try:
            text = Path(a.token_file).expanduser().read_text()
        except OSError as e:
            raise ValueError(f"cannot read the token file {a.token_file!r}: {e}") from e
        # the first token of the file, written as a server's token file writes it
        words = [w for line in text.splitlines() for w in line.split("#", 1)[0].split()[:1]]
        if not words:
            raise ValueError(f"the token file {a.token_file!r} holds no token")
        out["token"] = words[0]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        with SpecstreamClient(a.target, timeout=a.timeout, **_security(a)) as c:
            return a.func(c, a)
    except grpc.RpcError as err:
        e = error_details(err)
        print(f"error: {e.code}: {e.message}", file=sys.stderr)
        for name, description in e.field_violations:
            print(f"  field {name}: {description}", file=sys.stderr)
        if e.retry_after_s is not None:
            print(f"  retry after {e.retry_after_s:g} s", file=sys.stderr)
        return 1
    except (ValueError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if isinstance(e, TimeoutError) else 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
