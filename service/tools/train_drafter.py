"""`specstream train-drafter TARGET OUT.gguf --kind eagle3`: fit an EAGLE-3 head to a GGUF target
from the target's own greedy generations, and write it in llama.cpp's eagle3 format (served by
`--drafter eagle3 --draft-model OUT.gguf`).

1. Data (eagle3_data.py): the prompts (the shipped corpus or a JSON-lines file; token-id lists
   from Python) are shuffled with the seed, `n_prompts` of them kept (0: all), and split into
   training and held-out prompts; the target generates `tokens` greedy tokens after each, its
   steps tapped at the head's three layers, every position's choice kept.
2. The head (eagle3_fit.py): the target's shapes (synth_eagle3.draft_spec), a draft vocabulary
   of the `draft_vocab` most frequent training labels, the output projection started from the
   target's rows; trained with Adam on the cross-entropy against the target's choices (or,
   with `soft_labels` N, against its top-N distribution on the draft vocabulary)
   (eagle3_head.py: numpy, hand-written backward passes), unrolled `unroll` chain steps.
3. The file (synth_eagle3.write_eagle3: written, re-read, checked against the target), then the
   report: losses and acceptance per depth before and after training on the held-out prompts
   (the trainer's forward and, independently, the reference forward on the written file), and
   optionally the engine's acceptance with the untrained and the trained head
   (eagle3_eval.py).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from service.backends.step_format import TOP_MAX
from service.errors import ConfigError
from service.gguf.reader import GGUFFile
from service.model.eagle3 import D2T, Eagle3Spec
from service.model.spec import ModelSpec
from service.tools import eagle3_fit as fitting
from service.tools.eagle3_data import (
    TargetRunner,
    TargetSequence,
    collect,
    load_sequences,
    prompt_ids,
    read_prompts,
    save_sequences,
    target_tokenizer,
)
from service.tools.eagle3_eval import EngineAcceptance, engine_acceptance, reference_acceptance
from service.tools.eagle3_head import Eagle3Head
from service.tools.synth_eagle3 import QUANTS, default_layers, draft_spec, write_eagle3
from service.tools.train_options import KINDS, TrainOptions

log = structlog.get_logger("specstream.train_drafter")


def option_problems(opts: TrainOptions, t: ModelSpec, n_prompts: int) -> list[tuple[str, str]]:
    """Every bad option for target t and n_prompts given prompts (0: read from a file)."""
    p = []
    if opts.kind not in KINDS:
        p.append(("kind", f"{opts.kind!r} is not one of " + ", ".join(KINDS)))
    if opts.quant not in QUANTS:
        p.append(("quant", f"{opts.quant!r} is not one of " + ", ".join(QUANTS)))
    for name, v, lo in (("tokens", opts.tokens, 2), ("unroll", opts.unroll, 1),
                        ("epochs", opts.epochs, 1), ("batch", opts.batch, 1),
                        ("depth", opts.depth, 1), ("slots", opts.slots, 1),
                        ("max-prompt", opts.max_prompt, 1)):
        if v < lo:
            p.append((name, f"{v} must be at least {lo}"))
    if not 0 <= opts.soft_labels <= TOP_MAX:
        p.append(("soft-labels", f"{opts.soft_labels} is out of range [0, {TOP_MAX}]"))
    if not 0 < opts.holdout < 1:
        p.append(("holdout", f"{opts.holdout} must be in (0, 1)"))
    elif n_prompts:
        n = min(n_prompts, opts.n_prompts or n_prompts)
        if not 1 <= round(n * opts.holdout) < n:
            p.append(("holdout", f"{opts.holdout} of {n} prompts leaves no training or no "
                                 "held-out prompt"))
    if not 0 <= opts.draft_vocab <= t.vocab_size:
        p.append(("draft-vocab", f"{opts.draft_vocab} is out of range [0, {t.vocab_size}]"))
    if not opts.lr > 0:
        p.append(("lr", f"{opts.lr} must be positive"))
    if not 0 <= opts.weight_decay < 1:
        p.append(("weight-decay", f"{opts.weight_decay} is out of range [0, 1)"))
    if opts.data and not Path(opts.data).parent.is_dir():
        p.append(("data", f"{Path(opts.data).parent} is not a directory"))
    layers = opts.target_layers
    if layers is not None and (len(layers) != 3 or len(set(layers)) != 3
                               or not all(0 <= k <= t.n_layer for k in layers)):
        p.append(("target-layers", f"{list(layers)}: three distinct layers in "
                                   f"[0, {t.n_layer}] wanted"))
    if t.n_ff < 1 or t.head_dim != t.head_dim_v:
        p.append(("target", "no dense FFN size or unequal key/value head sizes; an EAGLE-3 "
                            "block needs both"))
    return p


@dataclass(frozen=True)
class TrainReport:
    path: Path
    spec: Eagle3Spec
    n_bytes: int
    train: tuple[int, int]             # prompts, generated tokens
    held: tuple[int, int]
    gen_seconds: float
    fit: fitting.FitResult
    before: fitting.Measure            # held-out, untrained
    after_train: fitting.Measure
    after_held: fitting.Measure
    reference: np.ndarray              # (D,) held-out acceptance of the written file
    engine: list[EngineAcceptance]     # [untrained, trained], or none
    engine_width: int


def split(n: int, n_use: int, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt indices (training, held-out): the first n_use (0: n) of a seeded shuffle of the
    n prompts, round(n_use * holdout) of them held out."""
    order = np.random.default_rng(seed).permutation(n)[:n_use or n]
    k = round(len(order) * holdout)
    return np.sort(order[k:]), np.sort(order[:k])


def _check(opts: TrainOptions, t: ModelSpec, out: Path, n_prompts: int) -> None:
    problems = option_problems(opts, t, n_prompts)
    if not out.parent.is_dir():
        problems.append(("out", f"{out.parent} is not a directory"))
    if problems:
        raise ConfigError(problems)


def _generate(target: Path, t: ModelSpec, layers: tuple[int, ...], opts: TrainOptions,
              given: Sequence[Sequence[int]] | None
              ) -> tuple[list[TargetSequence], list[TargetSequence], float]:
    """The target's sequences for the training and the held-out prompts (read from
    opts.data when it holds this generation: no model is loaded), and the seconds generating
    or reading them took."""
    prompts = prompt_ids(read_prompts(opts.prompts or None) if given is None else given,
                         target_tokenizer(GGUFFile(target), t), t.vocab_size)
    if problems := option_problems(opts, t, len(prompts)):
        raise ConfigError(problems)
    tr, ho = split(len(prompts), opts.n_prompts, opts.holdout, opts.seed)
    ordered = [prompts[i] for i in (*tr, *ho)]
    key = _data_key(target, layers, opts, ordered, len(tr))
    t0 = time.perf_counter()
    seqs = load_sequences(opts.data, key) if opts.data else None
    if seqs is None:
        runner = TargetRunner(target, layers, backend=opts.backend, threads=opts.threads,
                              n_slots=opts.slots, n_ctx=opts.max_prompt + opts.tokens + 1,
                              max_tokens=max(64, opts.slots), n_top=opts.soft_labels)
        seqs = collect(runner, ordered, opts.tokens, opts.max_prompt)
        if opts.data:
            save_sequences(opts.data, seqs, key)
    return seqs[:len(tr)], seqs[len(tr):], time.perf_counter() - t0


def _data_key(target: Path, layers: tuple[int, ...], opts: TrainOptions,
              prompts: Sequence[Sequence[int]], n_train: int) -> dict:
    """What a generation depends on (a kept one is reused only for the same): the target file
    (its size and the hash of its first 4 MiB: header, metadata and the first tensors), the
    tapped layers, the prompts in order and the training / held-out split, the tokens and
    prompt cut, the top-N kept, the backend that generated it."""
    with open(target, "rb") as f:
        head = hashlib.sha256(f.read(4 << 20)).hexdigest()
    ids = hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest()
    return {"target_bytes": target.stat().st_size, "target_head": head, "layers": list(layers),
            "prompts": ids, "n_train": n_train, "tokens": opts.tokens,
            "max_prompt": opts.max_prompt, "n_top": opts.soft_labels, "backend": opts.backend}


def train_drafter(target: str | Path, out: str | Path, opts: TrainOptions,
                  prompts: Sequence[Sequence[int]] | None = None) -> TrainReport:
    """Fit and write a head (module doc) from `prompts` (token ids; None: opts.prompts' file,
    else the shipped corpus); ConfigError listing every bad option."""
    target, out = Path(target), Path(out)
    tf = GGUFFile(target)
    t = ModelSpec.from_gguf(tf)
    _check(opts, t, out, len(prompts) if prompts is not None else 0)
    layers = tuple(opts.target_layers or default_layers(t.n_layer))
    train, held, gen_seconds = _generate(target, t, layers, opts, prompts)
    spec = draft_spec(t, layers, opts.draft_vocab, False, opts.norm_before_fc)
    d2t = fitting.draft_vocab(train, t.vocab_size, opts.draft_vocab)
    t2d = fitting.target_to_draft(d2t, t.vocab_size)
    head = _initial_head(spec, tf, train, d2t,
                         max(len(s.ids) for s in (*train, *held)) + opts.depth, opts.seed)
    K, D = opts.unroll, opts.depth
    before = fitting.measure(head, held, t2d, K, D)
    with tempfile.TemporaryDirectory() as tmp:
        untrained = Path(tmp) / "untrained.gguf"
        if opts.engine_prompts:
            _write(untrained, tf, spec, head, d2t, opts.quant)
        result = fitting.fit(head, train, t2d, fitting.FitOptions(
            unroll=K, epochs=opts.epochs, batch=opts.batch, lr=opts.lr,
            max_seconds=opts.max_seconds, seed=opts.seed, soft=opts.soft_labels > 0,
            weight_decay=opts.weight_decay))
        written = _write(out, tf, spec, head, d2t, opts.quant)
        engine = []
        if opts.engine_prompts:
            engine = engine_acceptance(
                target, [untrained, out],
                [list(s.ids[:s.n_prompt]) for s in held[:opts.engine_prompts]],
                opts.tokens, D + 1, opts.backend, opts.threads)
    return TrainReport(out, written.spec, written.n_bytes, _size(train), _size(held),
                       gen_seconds, result, before, fitting.measure(head, train, t2d, K, D),
                       fitting.measure(head, held, t2d, K, D),
                       reference_acceptance(out, target, held, D)[0], engine, D + 1)


def _size(seqs: Sequence[TargetSequence]) -> tuple[int, int]:
    return len(seqs), sum(s.n_generated for s in seqs)


def _initial_head(spec: Eagle3Spec, tf: GGUFFile, train: Sequence[TargetSequence],
                  d2t: np.ndarray | None, max_len: int, seed: int) -> Eagle3Head:
    feats = np.concatenate([s.feats for s in train])                   # (N, 3 Et) f32
    feat_rms = float(np.sqrt((feats.astype(np.float64) ** 2).mean()))
    params = fitting.initial_params(spec, tf, d2t, feat_rms, seed)
    return Eagle3Head(spec, params, fitting.target_tensor(tf, "token_embd.weight"), max_len)


def _write(out: Path, tf: GGUFFile, spec: Eagle3Spec, head: Eagle3Head, d2t, quant: str):
    tensors = {name: (d2t if name == D2T else head.p[name].astype(np.float32))
               for name in spec.tensor_shapes()}
    return write_eagle3(out, tf, spec, tensors, quant)


# ---------------------------------------------------------------- the report
def report_table(r: TrainReport, target: str) -> str:
    """The printed summary: data, timings, and a table untrained vs trained."""
    s = r.spec
    lines = [
        f"train-drafter eagle3: {target} -> {r.path} ({r.n_bytes / 1e6:.1f} MB)",
        f"  target layers {list(s.target_layers)}, width {s.n_embd}, draft vocabulary "
        f"{s.draft_vocab} of {s.vocab_size}, unroll {len(r.after_held.loss)}",
        f"  data: {r.train[0]} training / {r.held[0]} held-out prompts, {r.train[1]} / "
        f"{r.held[1]} generated tokens, generation {r.gen_seconds:.1f} s",
        f"  training: {r.fit.steps} steps, {r.fit.seconds:.1f} s",
        "", f"  {'':<44}{'untrained':>10}{'trained':>10}",
        f"  {'training loss (unroll step 0)':<44}{'-':>10}{r.after_train.loss[0]:>10.3f}",
        f"  {'held-out loss (unroll step 0)':<44}{r.before.loss[0]:>10.3f}"
        f"{r.after_held.loss[0]:>10.3f}"]
    for k in range(1, len(r.after_held.loss)):
        lines.append(f"  {f'held-out loss (unroll step {k})':<44}{r.before.loss[k]:>10.3f}"
                     f"{r.after_held.loss[k]:>10.3f}")
    for d, (a, b) in enumerate(zip(r.before.acceptance, r.after_held.acceptance,
                                   strict=True), 1):
        lines.append(f"  {f'held-out acceptance, depth {d}':<44}{a:>10.3f}{b:>10.3f}")
    for d, a in enumerate(r.reference, 1):
        lines.append(f"  {f'  reference forward on the file, depth {d}':<44}{'':>10}{a:>10.3f}")
    D = len(r.reference)
    lines.append(f"  {f'tokens per verify step, chain of {D}':<44}"
                 f"{1 + r.before.acceptance.sum():>10.2f}"
                 f"{1 + r.after_held.acceptance.sum():>10.2f}")
    lines.append(f"  ({r.after_held.starts} held-out start positions)")
    if r.engine:
        a, b = r.engine
        lines += [f"  {f'engine, width {r.engine_width}: accepted / drafted':<44}"
                  f"{f'{a.accepted}/{a.drafted}':>10}{f'{b.accepted}/{b.drafted}':>10}",
                  f"  {'engine tokens per verify step':<44}{a.tokens_per_step:>10.2f}"
                  f"{b.tokens_per_step:>10.2f}",
                  f"  {'engine output equals plain greedy':<44}{str(a.identical):>10}"
                  f"{str(b.identical):>10}"]
    return "\n".join(lines)
