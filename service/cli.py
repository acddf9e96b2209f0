"""`specstream` command line: models fetch/list, inspect, generate, synth, quantize,
fit-markov, train-drafter, serve."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from service.errors import ConfigError, SpecstreamError

EPILOG = """examples:
  specstream models fetch smollm2-135m
  specstream generate smollm2-135m --prompt "The capital of France is" --temperature 0
  specstream generate smollm2-135m --chat --prompt "What is 12 times 7?"
  specstream inspect gemma3-270m
  specstream synth --preset llama3-8b --quant Q4_K_M llama3-8b-synth.gguf
  specstream quantize smollm2-135m smollm2-4l.gguf --type q8_0 --layers 4   # a self-drafter
  specstream generate smollm2-135m --prompt "def fib(n):" --temperature 0 \
      --drafter model --draft-model smollm2-4l.gguf --verify-width 6
  specstream fit-markov smollm2-135m smollm2-4l.gguf smollm2-4l-m16.gguf --rank 16 \
      --corpus bench/corpus/markov_fit.txt          # the same drafter + a DSpark Markov head
  specstream train-drafter smollm2-135m smollm2-e3.gguf --kind eagle3 --draft-vocab 8192
  specstream generate smollm2-135m --prompt "def fib(n):" --temperature 0 \
      --drafter eagle3 --draft-model smollm2-e3.gguf --verify-width 5
  specstream serve                      # gRPC on :50051 with the default model
"""


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids: {exc}") from exc


def logit_bias_arg(text: str) -> tuple[int, float]:
    """'ID=BIAS' (--logit-bias) as (token id, bias)."""
    tok, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError(text)
        return int(tok), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specstream", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Stream tokens from GGUF models (CPU or CUDA).")
    sub = p.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="fetch or list the known models")
    msub = models.add_subparsers(dest="models_command", required=True)
    fetch = msub.add_parser("fetch", help="download a known model into the models directory")
    fetch.add_argument("name", nargs="?", default=None, help="model name (default: the default)")
    msub.add_parser("list", help="list the known models and whether they are fetched")

    kern = sub.add_parser("kernels", help="the CUDA backend's kernels")
    ksub = kern.add_subparsers(dest="kernels_command", required=True)
    warm = ksub.add_parser("warm", help="compile every CUDA kernel source into CuPy's kernel "
                                        "cache, side by side (a new GPU host's first start "
                                        "then compiles nothing; needs CuPy and a GPU)")
    warm.add_argument("--processes", type=int, default=0, metavar="N",
                      help="compiling processes (0: one per source, at most the CPU count; "
                           "1: in this process)")

    insp = sub.add_parser("inspect", help="print a GGUF file's metadata and tensor summary")
    insp.add_argument("model", help="a .gguf path or a known model name")

    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it")
    gen.add_argument("model", help="a .gguf path or a known model name")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (special tokens such as <|im_start|> parsed)")
    src.add_argument("--prompt-ids", type=_ids, help="comma-separated prompt token ids")
    gen.add_argument("--chat", action="store_true",
                     help="wrap --prompt as one user message in the chat template")
    gen.add_argument("--system", help="system message for --chat")
    gen.add_argument("--chat-template", metavar="NAME|FILE", default="",
                     help="chat template for --chat: a built-in (chatml, gemma) or a Jinja file "
                          "(default: the model's own; a model without one needs this)")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=40)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--min-p", type=float, default=0.05)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="in [-2, 2]: logit -= count * this over generated tokens")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="in [-2, 2]: logit -= this for tokens generated at least once")
    gen.add_argument("--logit-bias", action="append", type=logit_bias_arg, default=[],
                     metavar="ID=BIAS", help="add BIAS (-100..100) to token ID's logit "
                     "(repeatable)")
    gen.add_argument("--min-tokens", type=int, default=0,
                     help="generate at least this many tokens before EOS / stops")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--no-speculative", action="store_true",
                     help="decode one token per step even when greedy")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object at the end instead of streaming text")
    _engine_flags(gen)

    _synth_parser(sub)

    qnt = sub.add_parser("quantize", help="re-quantize a GGUF, optionally keeping only its "
                         "first N blocks (a layer-truncated drafter of the same vocabulary)")
    qnt.add_argument("model", help="input: a .gguf path or a known model name")
    qnt.add_argument("out", help="output .gguf path")
    qnt.add_argument("--type", required=True, help="q8_0 | q4_0 | q4-mix (q4_0, with "
                     "dflash.* tensors at q8_0); 1-D tensors are written as F32")
    qnt.add_argument("--layers", type=int, default=None, metavar="N",
                     help="keep blocks 0..N-1 (plus embeddings, output norm and head)")

    fit = sub.add_parser("fit-markov", help="fit a DSpark Markov head (a low-rank previous-token "
                         "correction of a drafter's logits) and write it into a copy of DRAFT")
    fit.add_argument("target", help="the target: a .gguf path or a known model name")
    fit.add_argument("draft", help="the drafter: a .gguf of the target's vocabulary")
    fit.add_argument("out", help="output .gguf path (DRAFT plus the head)")
    fit.add_argument("--rank", type=int, required=True, metavar="R")
    fit.add_argument("--corpus", required=True, metavar="FILE|-generate",
                     help="a UTF-8 text file, or -generate to sample the corpus from the target")
    fit.add_argument("--tokens", type=int, default=None, metavar="N",
                     help="corpus tokens used (default: the whole file; 2048 with -generate)")
    fit.add_argument("--dtype", default="f16", help="f16 | f32 (the head's tensors)")
    fit.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = all cores")
    fit.add_argument("--seed", type=int, default=0, help="-generate's sampling seed")

    _train_drafter_parser(sub)
    sub.add_parser("serve", help="run the gRPC server (see `specstream serve --help`)",
                   add_help=False)
    return p


def _synth_parser(sub) -> None:
    """`specstream synth`: a preset model, or an EAGLE-3 / DFlash drafter for a target."""
    syn = sub.add_parser("synth", help="write a seeded random-weight GGUF with a real "
                         "architecture's shapes (for benchmarks)")
    syn.add_argument("out", help="output .gguf path")
    syn.add_argument("--preset",
                     help="llama3-8b | llama3.2-1b | qwen3-30b-a3b | laguna-xs2 | tiny | tiny-moe "
                          "| tiny-qwen3moe-s | tiny-laguna | tiny-laguna-elem")
    syn.add_argument("--eagle3", metavar="TARGET",
                     help="instead of --preset: an EAGLE-3 drafter (llama.cpp's eagle3 format) "
                          "for TARGET (a .gguf path or known model name), docs/speculative.md")
    syn.add_argument("--dflash", metavar="TARGET",
                     help="instead of --preset: a DFlash drafter (llama.cpp's dflash format, "
                          "the plain block decoder) for TARGET")
    syn.add_argument("--quant", default=None,
                     help="Q4_K_M | Q5_K_M | Q6_K | Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q2_K "
                          "| Q3_K_M | IQ4_NL | IQ4_XS | F16 | BF16 | F32 (llama.cpp's per-tensor "
                          "mix for that file type; default Q4_K_M, with --eagle3 / --dflash "
                          "F16, F32 or Q8_0, default F16)")
    syn.add_argument("--target-layers", default=None,
                     help="--eagle3: the three target layers read, e.g. 2,15,27 (default: "
                          "2, n/2, n-3); --dflash: the target layers read (default: DFlash's "
                          "spread of five)")
    syn.add_argument("--draft-vocab", type=int, default=0,
                     help="--eagle3 / --dflash: a reduced draft vocabulary of N target ids "
                          "(d2t); 0: the target's")
    syn.add_argument("--own-embedding", action="store_true",
                     help="--eagle3 / --dflash: write the drafter's own token embeddings")
    syn.add_argument("--norm-before-fc", action="store_true",
                     help="--eagle3: an RMS norm on the three target rows before fc")
    syn.add_argument("--draft-layers", type=int, default=1,
                     help="--dflash: decoder layers of the drafter")
    syn.add_argument("--ff", type=int, default=0,
                     help="--dflash: the drafter's FFN width (0: the target's)")
    syn.add_argument("--block-size", type=int, default=16,
                     help="--dflash: the trained block (anchor + block-size - 1 masks)")
    syn.add_argument("--mask-token", type=int, default=-1,
                     help="--dflash: the mask token id (default: the last id)")
    syn.add_argument("--causal", action="store_true",
                     help="--dflash: causal attention within the block")
    syn.add_argument("--rope-dims", type=int, default=0,
                     help="--dflash: rotated dims per head (0: the target's)")
    syn.add_argument("--markov-rank", type=int, default=0,
                     help="--dflash: a DSpark drafter (llama.cpp's draft-dspark) with a Markov "
                          "head of this rank (0: plain DFlash)")
    syn.add_argument("--confidence-head", action="store_true",
                     help="--dflash --markov-rank R: DSpark's confidence head too")
    syn.add_argument("--bonus-anchor", action="store_true",
                     help="--dflash --markov-rank R: DFlash's block layout (drafts from row 1) "
                          "instead of DSpark's anchor-first one")
    syn.add_argument("--seed", type=int, default=0, help="same seed -> identical file")
    syn.add_argument("--layers", type=int, default=None,
                     help="number of layers (default: the preset's)")
    syn.add_argument("--threads", type=int, default=0, help="generator threads; 0 = all cores")
    syn.add_argument("--weight-std", type=float, default=0.02,
                     help="the weights' standard deviation (norm weights stay near 1)")


def _train_drafter_parser(sub) -> None:
    from service.tools.train_options import TrainOptions

    d = TrainOptions()
    tr = sub.add_parser("train-drafter", help="fit an EAGLE-3 head to a target from its own "
                        "greedy generations (numpy, on the CPU) and write it in llama.cpp's "
                        "eagle3 format")
    tr.add_argument("target", help="the target: a .gguf path or a known model name")
    tr.add_argument("out", help="output .gguf path")
    tr.add_argument("--kind", default=d.kind, help="eagle3 (the one kind)")
    tr.add_argument("--prompts", default=d.prompts, metavar="FILE",
                    help="a JSON-lines file of prompt strings (default: the shipped corpus)")
    tr.add_argument("--n-prompts", type=int, default=d.n_prompts, metavar="N",
                    help="use the first N prompts (0: all)")
    tr.add_argument("--tokens", type=int, default=d.tokens, metavar="N",
                    help="greedy tokens the target generates per prompt")
    tr.add_argument("--max-prompt", type=int, default=d.max_prompt, metavar="N",
                    help="prompt tokens kept")
    tr.add_argument("--holdout", type=float, default=d.holdout,
                    help="fraction of the prompts held out for the report")
    tr.add_argument("--draft-vocab", type=int, default=d.draft_vocab, metavar="N",
                    help="draft vocabulary: the N most frequent target tokens (d2t); 0: all")
    tr.add_argument("--unroll", type=int, default=d.unroll, metavar="K",
                    help="draft-chain steps trained (training-time test; 1: the extend only)")
    tr.add_argument("--epochs", type=int, default=d.epochs)
    tr.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    tr.add_argument("--lr", type=float, default=d.lr, help="Adam's peak learning rate")
    tr.add_argument("--max-seconds", type=float, default=d.max_seconds, metavar="S",
                    help="> 0: fewer steps so that training takes about S seconds")
    tr.add_argument("--target-layers", default=None,
                    help="the three target layers read, e.g. 2,15,27 (default: 2, n/2, n-3)")
    tr.add_argument("--norm-before-fc", action="store_true",
                    help="an RMS norm on the three target rows before fc")
    tr.add_argument("--quant", default=d.quant, help="F16 | F32 | Q8_0 (the 2-D weights)")
    tr.add_argument("--depth", type=int, default=d.depth,
                    help="draft-chain depth the acceptance is reported to")
    tr.add_argument("--seed", type=int, default=d.seed)
    tr.add_argument("--backend", default=d.backend,
                    help="the target's backend for generation and --engine-prompts: cpu | cuda")
    tr.add_argument("--threads", type=int, default=d.threads, help="0 = all cores")
    tr.add_argument("--slots", type=int, default=d.slots, help="sequences generated at once")
    tr.add_argument("--engine-prompts", type=int, default=d.engine_prompts, metavar="N",
                    help="also run N held-out prompts through the engine with the untrained "
                         "and the trained head (0: no)")
    tr.add_argument("--soft-labels", type=int, default=d.soft_labels, metavar="N",
                    help="train on the target's N most likely tokens' distribution (<= 20; "
                         "0: its choice alone)")
    tr.add_argument("--weight-decay", type=float, default=d.weight_decay, metavar="WD",
                    help="AdamW's decoupled weight decay of the head's matrices (0: none)")
    tr.add_argument("--data", default=d.data, metavar="FILE.npz",
                    help="keep the target's generation in this file: reused by a later run "
                         "with the same target, prompts, split, tokens, layers and backend, "
                         "else generated and written")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    from service.config import EngineConfig

    d = EngineConfig()
    p.add_argument("--backend", default=d.backend, help="auto | cpu | cuda")
    p.add_argument("--cache-type-k", default=d.kv_cache_type_k)
    p.add_argument("--cache-type-v", default=d.kv_cache_type_v)
    p.add_argument("--verify-width", type=int, default=d.verify_width)
    p.add_argument("--tree-budget", type=int, default=d.tree_budget, metavar="N",
                   help="tree verify (DDTree) with N nodes per step, 2..16; 0 = chain verify")
    p.add_argument("--drafter", default=d.drafter,
                   help="none | ngram | model | suffix | eagle3 | dflash")
    p.add_argument("--draft-model", default=d.draft_model, metavar="PATH|NAME",
                   help="--drafter model: the draft GGUF, sharing the target's vocabulary "
                        "(e.g. one made by `specstream quantize ... --layers N`); --drafter "
                        "eagle3 / dflash: an EAGLE-3 / DFlash GGUF made for the target")
    p.add_argument("--n-ctx", type=int, default=d.n_ctx)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--step-profile", action="store_true",
                   help="time every decode step's draft / heads / verify / other parts (per "
                        "step in the debug log; summed into the timings)")
    p.add_argument("--no-overlap", dest="overlap", action="store_const", const="off",
                   default="auto",
                   help="run plain decode steps one at a time instead of submitting each "
                        "before the last one is read back (for debugging)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="CUDA backend: launch every kernel eagerly instead of replaying a "
                        "captured graph per step shape (for debugging)")


def _models_dir():
    from service.config import models_dir_from_env

    return models_dir_from_env()


def _resolve(name_or_path: str):
    from service.gguf.fetch import resolve_model

    return resolve_model(name_or_path, _models_dir())


def cmd_models(args) -> int:
    from service.gguf import fetch

    if args.models_command == "fetch":
        name = args.name or fetch.DEFAULT_MODEL
        path = fetch.fetch_model(name, _models_dir())
        print(path)
        return 0
    directory = _models_dir()
    for name, src in fetch.MODELS.items():
        here = fetch.model_path(name, directory)
        mark = "fetched" if here.exists() else "not fetched"
        default = " (default)" if name == fetch.DEFAULT_MODEL else ""
        size = f", {fetch.format_size(src.size)}" if src.size else ""
        print(f"{name}{default}: {src.description}{size} [{mark}: {here}]")
    return 0


def cmd_kernels(args) -> int:
    """specstream kernels warm: one line per source (seconds), then the wall time."""
    from service.backends.cuda.warm import compile_sources

    t0 = time.perf_counter()
    for name, seconds in compile_sources(processes=args.processes):
        print(f"{name:<20} {seconds:7.1f} s")
    print(f"{'all':<20} {time.perf_counter() - t0:7.1f} s wall")
    return 0


def cmd_inspect(args) -> int:
    from service.gguf.reader import GGUFFile
    from service.tools.inspect import describe, serving_problem

    path = _resolve(args.model)
    print(describe(path))
    return 0 if serving_problem(GGUFFile(path)) is None else 1   # generate would refuse it


def cmd_generate(args) -> int:
    from service.config import EngineConfig
    from service.engine.engine import Engine
    from service.engine.types import (
        Delta,
        Finished,
        GenerationRequest,
        SamplingParams,
        Started,
        StoppingCriteria,
    )

    config = EngineConfig(kv_cache_type_k=args.cache_type_k, kv_cache_type_v=args.cache_type_v,
                          verify_width=args.verify_width, drafter=args.drafter,
                          tree_budget=args.tree_budget,
                          draft_model=str(_resolve(args.draft_model)) if args.draft_model else "",
                          backend=args.backend, n_ctx=args.n_ctx, threads=args.threads,
                          cuda_graphs=args.cuda_graphs, step_profile=args.step_profile,
                          overlap=args.overlap, n_slots=1)
    engine = Engine.load(_resolve(args.model), config, chat_template=args.chat_template)
    if args.chat and args.prompt is not None and engine.chat_template is None:
        from service.model.chat import missing_template

        raise missing_template("--chat")
    if args.prompt_ids is not None:
        ids = args.prompt_ids
    elif args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        ids = engine.chat_prompt_ids(messages)
    else:
        ids = engine.text_prompt_ids(args.prompt)
    request = GenerationRequest(
        request_id="cli", prompt_ids=tuple(ids),
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty, seed=args.seed,
                                frequency_penalty=args.frequency_penalty,
                                presence_penalty=args.presence_penalty,
                                logit_bias=tuple(sorted(dict(args.logit_bias).items()))),
        stopping=StoppingCriteria(max_new_tokens=args.max_new_tokens,
                                  stop_sequences=tuple(args.stop), ignore_eos=args.ignore_eos,
                                  min_tokens=args.min_tokens),
        speculative=False if args.no_speculative else None)
    engine.start()
    out_ids: list[int] = []
    text, started, finished = [], None, None
    try:
        for ev in engine.generate(request):
            if isinstance(ev, Started):
                started = ev
            elif isinstance(ev, Delta):
                out_ids.extend(ev.token_ids)
                text.append(ev.text)
                if not args.json:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
            elif isinstance(ev, Finished):
                finished = ev
    finally:
        engine.stop()
    if args.json:
        print(json.dumps({
            "prompt_ids": list(ids), "token_ids": out_ids, "text": "".join(text),
            "finish_reason": finished.reason.value, "seed": started.seed if started else None,
            "usage": vars(finished.usage), "timings": vars(finished.timings),
            "error": finished.error}, ensure_ascii=False))
    else:
        print(flush=True)          # the text ends with a newline; the summary goes to stderr
        u, t = finished.usage, finished.timings
        print(f"[{finished.reason.value}: {u.prompt_tokens} prompt + {u.completion_tokens} "
              f"generated tokens, {t.per_token_decode_ms:.1f} ms/token"
              + (f", {u.accepted_draft_tokens}/{u.draft_tokens} drafts accepted, "
                 f"{u.mean_tokens_per_step:.2f} tokens/step" if u.draft_tokens else "")
              + (f"; steps: draft {t.draft_ms:.1f} ms, heads {t.heads_ms:.1f} ms, verify "
                 f"{t.verify_ms:.1f} ms, other {t.other_ms:.1f} ms" if args.step_profile else "")
              + "]", file=sys.stderr)
    return 0 if finished.error is None else 1


def cmd_synth(args) -> int:
    from service.tools.synth import synthesize

    if sum(a is not None for a in (args.preset, args.eagle3, args.dflash)) != 1:
        raise ConfigError([("preset", "give exactly one of --preset, --eagle3 and --dflash")])
    if args.eagle3 is not None:
        return _synth_eagle3(args)
    if args.dflash is not None:
        return _synth_dflash(args)
    r = synthesize(args.out, args.preset, args.quant or "Q4_K_M", seed=args.seed,
                   n_layer=args.layers,
                   threads=args.threads, weight_std=args.weight_std)
    print(f"{r.path}: {r.n_bytes / 1e6:.1f} MB, {r.n_tensors} tensors, {r.seconds:.1f} s "
          f"({r.n_bytes / 1e6 / max(r.seconds, 1e-9):.0f} MB/s)")
    return 0


def _target_layers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(k) for k in text.split(","))
    except ValueError:
        raise ConfigError([("target-layers", f"{text!r}: integers separated by commas")]
                          ) from None


def _synth_eagle3(args) -> int:
    from service.tools.synth_eagle3 import synthesize_eagle3

    layers = _target_layers(args.target_layers)
    r = synthesize_eagle3(args.out, _resolve(args.eagle3), seed=args.seed, layers=layers,
                          draft_vocab=args.draft_vocab, own_embedding=args.own_embedding,
                          norm_before_fc=args.norm_before_fc, quant=args.quant or "F16",
                          weight_std=args.weight_std)
    s = r.spec
    print(f"{r.path}: EAGLE-3 drafter, target layers {list(s.target_layers)}, width {s.n_embd}, "
          f"draft vocabulary {s.draft_vocab}, {r.n_tensors} tensors, {r.n_bytes / 1e6:.1f} MB")
    return 0


def _synth_dflash(args) -> int:
    from service.tools.synth_dflash import DflashOptions, synthesize_dflash

    o = DflashOptions(seed=args.seed, layers=_target_layers(args.target_layers),
                      n_layer=args.draft_layers, n_ff=args.ff, block_size=args.block_size,
                      mask_token=args.mask_token, draft_vocab=args.draft_vocab,
                      own_embedding=args.own_embedding, causal=args.causal,
                      rope_dims=args.rope_dims, quant=args.quant or "F16",
                      weight_std=args.weight_std, markov_rank=args.markov_rank,
                      confidence_head=args.confidence_head, bonus_anchor=args.bonus_anchor)
    r = synthesize_dflash(args.out, _resolve(args.dflash), o)
    s = r.spec
    kind = "DFlash drafter"
    if s.dspark:
        kind = (f"DSpark drafter (Markov rank {s.markov_rank}"
                + (", confidence head" if s.confidence else "")
                + ("" if s.sample_from_anchor else ", bonus anchor") + ")")
    print(f"{r.path}: {kind}, target layers {list(s.target_layers)}, {s.n_layer} "
          f"layers of width {s.n_embd}, block {s.block_size}, mask token {s.mask_token}, draft "
          f"vocabulary {s.draft_vocab}, {r.n_tensors} tensors, {r.n_bytes / 1e6:.1f} MB")
    return 0


def cmd_quantize(args) -> int:
    from service.tools.quantize import requantize

    r = requantize(_resolve(args.model), args.out, args.type, args.layers)
    types = ", ".join(f"{n} {t}" for t, n in sorted(r.types.items()))
    print(f"{r.path}: {r.n_bytes / 1e6:.1f} MB, {r.n_tensors} tensors ({types}), "
          f"{r.seconds:.1f} s")
    for key in r.skipped_keys:
        print(f"warning: metadata key {key} is an empty array and was not copied",
              file=sys.stderr)
    return 0


def cmd_fit_markov(args) -> int:
    from service.tools.fit_markov import fit_markov

    r = fit_markov(_resolve(args.target), _resolve(args.draft), args.out, args.rank,
                   args.corpus, args.tokens, args.dtype, args.threads, args.seed)
    print(f"{r.path}: rank {r.rank} Markov head fitted on {r.n_tokens} positions "
          f"({r.n_prev} distinct previous tokens); mean squared residual per logit "
          f"{r.loss_before:.4f} -> {r.loss_after:.4f}, {r.seconds:.1f} s")
    return 0


def cmd_train_drafter(args) -> int:
    from service.tools.train_drafter import report_table, train_drafter
    from service.tools.train_options import TrainOptions

    opts = TrainOptions(
        kind=args.kind, prompts=args.prompts, n_prompts=args.n_prompts, tokens=args.tokens,
        max_prompt=args.max_prompt, holdout=args.holdout, draft_vocab=args.draft_vocab,
        unroll=args.unroll, epochs=args.epochs, batch=args.batch, lr=args.lr,
        max_seconds=args.max_seconds, target_layers=_target_layers(args.target_layers),
        norm_before_fc=args.norm_before_fc, quant=args.quant, depth=args.depth,
        seed=args.seed, backend=args.backend, threads=args.threads, slots=args.slots,
        engine_prompts=args.engine_prompts, soft_labels=args.soft_labels,
        weight_decay=args.weight_decay, data=args.data)
    r = train_drafter(_resolve(args.target), args.out, opts)
    print(report_table(r, args.target))
    return 0


def _joined_generate(argv: list[str]) -> list[str]:
    """`--corpus -generate` as `--corpus=-generate` (argparse reads a value starting with '-'
    as an option)."""
    out: list[str] = []
    for a in argv:
        if a == "-generate" and out[-1:] == ["--corpus"]:
            out[-1] = "--corpus=-generate"
        else:
            out.append(a)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from service.serve import serve_main

        return serve_main(argv[1:])
    argv = _joined_generate(argv)
    args = build_parser().parse_args(argv)
    from service.logging import configure_logging

    # Logs go to stderr: stdout carries the generated text or JSON. --step-profile shows the
    # per-step lines, which are debug lines.
    level = "warning" if getattr(args, "json", False) else "info"
    configure_logging("debug" if getattr(args, "step_profile", False) else level, fmt="console")
    handlers = {"models": cmd_models, "kernels": cmd_kernels, "inspect": cmd_inspect,
                "generate": cmd_generate,
                "synth": cmd_synth, "quantize": cmd_quantize,
                "fit-markov": cmd_fit_markov, "train-drafter": cmd_train_drafter}
    try:
        return handlers[args.command](args)
    except SpecstreamError as exc:
        from service.config import format_problems

        msg = format_problems(exc.problems) if isinstance(exc, ConfigError) else str(exc)
        print(f"specstream: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
