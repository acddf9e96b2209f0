"""train-drafter's data: a target's own greedy generations on a set of prompts, with the rows an
EAGLE-3 head reads (the hidden-state tap at its three layers) and the target's choice (its
argmax: the token a verify step would accept) at every position fed.

Generation runs n_slots prompts at a time through the model runner: each prompt's prefill in its
own steps (chunks of max_tokens rows), then one decode step of one row per unfinished sequence
until each has `tokens` new tokens or ended with an end-of-generation token. Every step is
tapped and every row is a logits row, so the generation is also the teacher-forced pass: the
prefill rows give the prompt positions' features and choices, each decode row its position's
(the last token is never fed: a sequence of T tokens has T - 1 rows). Prompts are cut to their
first `max_prompt` tokens. The prompts shipped with the tool (drafter_prompts.jsonl, one JSON
string per line: code, prose, chat turns, lists, questions) are the default corpus; a prompts
file may also hold lists of token ids (a target without a tokenizer).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import structlog

from service.backends import create_backend
from service.config import MAX_STEP_ROWS
from service.engine.runner import GREEDY, ModelRunner, StepInput
from service.errors import ConfigError
from service.gguf.reader import GGUFFile
from service.model.hidden import HiddenRows, HiddenTap
from service.model.spec import ModelSpec
from service.model.tokenizer import Tokenizer
from service.model.transformer import Transformer

log = structlog.get_logger("specstream.train_drafter")

PROMPTS = Path(__file__).with_name("drafter_prompts.jsonl")


def read_prompts(path: str | Path | None = None) -> list[str | list[int]]:
    """The prompts of a JSON-lines file, one a line: a string, or a list of token ids (blank
    lines skipped); the shipped corpus without a path. ConfigError for a missing file, a bad
    line or no prompt."""
    path = Path(path) if path else PROMPTS
    if not path.is_file():
        raise ConfigError([("prompts", f"{path} is not a file")])
    out: list[str | list[int]] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError([("prompts", f"{path}:{n}: not JSON ({exc.msg})")]) from None
        ids = isinstance(item, list) and all(type(t) is int and t >= 0 for t in item)
        if not (isinstance(item, str) or ids) or not item:
            raise ConfigError([("prompts", f"{path}:{n}: a non-empty string or list of token "
                                           "ids expected")])
        out.append(item)
    if not out:
        raise ConfigError([("prompts", f"{path} holds no prompt")])
    return out


def prompt_ids(prompts: Sequence[str | Sequence[int]], tokenizer: Tokenizer,
               vocab: int) -> list[list[int]]:
    """Each prompt as token ids: strings encoded as the engine encodes text prompts (BOS per
    the vocabulary, special tokens parsed); ConfigError for text without a tokenizer or ids
    outside the vocabulary."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not tokenizer.can_encode:
                raise ConfigError([("prompts", "the target has no tokenizer to encode text "
                                               "prompts; give lists of token ids")])
            out.append(tokenizer.encode(p, parse_special=True))
        elif any(not 0 <= t < vocab for t in p):
            raise ConfigError([("prompts", f"token ids outside [0, {vocab}) in {list(p)[:8]}")])
        else:
            out.append(list(p))
    return out


@dataclass(frozen=True)
class TargetSequence:
    """A prompt and the target's greedy continuation, with what its steps tapped and chose."""

    ids: np.ndarray           # (T,) i64 prompt + generated tokens
    n_prompt: int
    feats: np.ndarray         # (T - 1, 3 Et) f32 the tapped rows of positions 0..T-2
    choice: np.ndarray        # (T - 1,) i64 the target's argmax there (its next token)
    # with n_top > 0: the target's n_top most likely next tokens there and their
    # log-probabilities, most likely first (id -1, -inf where the step reported fewer)
    top_ids: np.ndarray | None = None     # (T - 1, n_top) i64
    top_logp: np.ndarray | None = None    # (T - 1, n_top) f32

    @property
    def n_generated(self) -> int:
        return len(self.ids) - self.n_prompt


def target_tokenizer(f: GGUFFile, spec: ModelSpec) -> Tokenizer:
    """The target's tokenizer, or ids only for a file without vocabulary texts."""
    return (Tokenizer.from_metadata(f.metadata) if f.get("tokenizer.ggml.tokens")
            else Tokenizer.ids_only(spec.vocab_size))


class TargetRunner:
    """A target model on a backend with a hidden-state tap at `points`, n_slots sequences at a
    time, max_tokens rows per step (every row may be a logits row); n_top > 0 (at most the
    step's TOP_MAX) also keeps each row's n_top most likely tokens."""

    def __init__(self, path: str | Path, points: Sequence[int], *, backend: str = "cpu",
                 threads: int = 0, n_slots: int = 8, n_ctx: int = 512, max_tokens: int = 128,
                 n_top: int = 0):
        f = GGUFFile(path)
        self.spec = ModelSpec.from_gguf(f)
        self.tokenizer = target_tokenizer(f, self.spec)
        self.n_slots, self.n_ctx = n_slots, min(n_ctx, self.spec.n_ctx_train)
        # steps up to MAX_STEP_ROWS batch-invariant, as the engine's (engine/loader.py)
        be = create_backend(backend, threads=threads, invariant_tokens=MAX_STEP_ROWS)
        self.model = Transformer(self.spec, f, be, n_ctx=self.n_ctx, n_slots=n_slots,
                                 max_tokens=max_tokens, max_logits=max_tokens)
        self.runner = ModelRunner(self.model, n_slots, self.n_ctx,
                                  hidden=HiddenTap(tuple(points), HiddenRows.ALL))
        self.n_top = n_top
        self.sampling = replace(GREEDY, n_top=n_top) if n_top > 0 else GREEDY

    def _step(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """One tapped step whose every row is a logits row: (the target's choice per row (n,)
        i64, the tapped rows (n, 3 Et) f32, and with n_top the top ids (n, n_top) i64 and
        log-probabilities (n, n_top) f32)."""
        n = len(ids)
        inp = StepInput(list(ids), list(positions), list(slots), range(n),
                        [self.sampling] * n, hidden=True)
        out = self.runner.step(inp)
        choice = out.token_ids.astype(np.int64)
        feats = np.array(self.model.backend.to_host(self.runner.hidden_states(inp)), np.float32)
        if self.n_top <= 0:
            return choice, feats, None, None
        top_ids = np.full((n, self.n_top), -1, np.int64)                # (n, n_top) i64
        top_logp = np.full((n, self.n_top), -np.inf, np.float32)        # (n, n_top) f32
        for r, lp in enumerate(out.logprobs):
            for j, (t, v) in enumerate(lp.top):
                top_ids[r, j], top_logp[r, j] = t, v
        return choice, feats, top_ids, top_logp

    def _prefill(self, ids: Sequence[int], slot: int, parts: list) -> None:
        """Run a prompt into `slot` in chunks of max_tokens rows, appending their rows."""
        M = self.model.max_tokens
        for c0 in range(0, len(ids), M):
            chunk = ids[c0:c0 + M]
            parts.append(self._step(chunk, range(c0, c0 + len(chunk)), [slot] * len(chunk)))

    def generate(self, prompts: Sequence[Sequence[int]], tokens: int,
                 stop_ids: frozenset[int] = frozenset()) -> list[TargetSequence]:
        """Each prompt + up to `tokens` greedy tokens (ending early after a stop id), with the
        tapped rows and choices of every position fed (all but the last token's)."""
        out = []
        for g0 in range(0, len(prompts), self.n_slots):
            group = [list(p) for p in prompts[g0:g0 + self.n_slots]]
            seqs = [list(p) for p in group]
            parts: list[list] = [[] for _ in seqs]      # per sequence: its steps' row blocks
            for slot, s in enumerate(seqs):
                self._prefill(s, slot, parts[slot])
                s.append(int(parts[slot][-1][0][-1]))
            for _ in range(tokens - 1):
                live = [i for i, s in enumerate(seqs) if s[-1] not in stop_ids]
                if not live:
                    break
                rows = self._step([seqs[i][-1] for i in live],
                                  [len(seqs[i]) - 1 for i in live], live)
                for r, i in enumerate(live):
                    seqs[i].append(int(rows[0][r]))
                    parts[i].append(tuple(None if a is None else a[r:r + 1] for a in rows))
            out += [_sequence(s, len(p), blocks)
                    for p, s, blocks in zip(group, seqs, parts, strict=True)]
        return out


def _sequence(ids: list[int], n_prompt: int, blocks: list) -> TargetSequence:
    """A TargetSequence from its steps' row blocks (choice, feats, top ids, top log-probs)."""
    c, f, ti, tl = (None if col[0] is None else np.concatenate(col)
                    for col in zip(*blocks, strict=True))
    return TargetSequence(np.array(ids, np.int64), n_prompt, f, c, ti, tl)


def collect(runner: TargetRunner, prompts: Sequence[Sequence[int]], tokens: int,
            max_prompt: int) -> list[TargetSequence]:
    """The target's sequences for `prompts`, each cut to its first max_prompt tokens."""
    cut = [list(p[:max_prompt]) for p in prompts]
    if any(len(p) + tokens > runner.n_ctx for p in cut):
        raise ConfigError([("tokens", f"a prompt of {max(map(len, cut))} tokens + {tokens} "
                                      f"exceeds the target's context of {runner.n_ctx}")])
    t0 = time.perf_counter()
    seqs = runner.generate(cut, tokens, runner.tokenizer.eog_ids)
    log.info("generated", sequences=len(seqs), tokens=sum(s.n_generated for s in seqs),
             seconds=round(time.perf_counter() - t0, 1))
    return seqs


# ---------------------------------------------------------------- a generation kept on disk
def save_sequences(path: str | Path, seqs: Sequence[TargetSequence], key: dict) -> None:
    """`seqs` into one .npz (arrays concatenated, with offsets) with `key`, what made them
    (load_sequences returns them only for the same key)."""
    lens = np.array([len(s.ids) for s in seqs], np.int64)
    top = seqs[0].top_ids is not None if seqs else False
    arrays = {"key": np.array(json.dumps(key, sort_keys=True)), "lens": lens,
              "n_prompt": np.array([s.n_prompt for s in seqs], np.int64),
              "ids": np.concatenate([s.ids for s in seqs]) if seqs else np.zeros(0, np.int64),
              "feats": np.concatenate([s.feats for s in seqs]) if seqs else np.zeros((0, 0)),
              "choice": np.concatenate([s.choice for s in seqs]) if seqs else np.zeros(0)}
    if top:
        arrays["top_ids"] = np.concatenate([s.top_ids for s in seqs])
        arrays["top_logp"] = np.concatenate([s.top_logp for s in seqs])
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)
    log.info("data_saved", path=str(path), sequences=len(seqs),
             mib=round(path.stat().st_size / 2**20, 1))


def load_sequences(path: str | Path, key: dict) -> list[TargetSequence] | None:
    """The sequences save_sequences wrote to `path` for the same `key`; None when the file is
    absent or was made otherwise (another target, prompts, split, tokens, layers, backend)."""
    path = Path(path)
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as z:
        if str(z["key"]) != json.dumps(key, sort_keys=True):
            log.info("data_stale", path=str(path))
            return None
        ends = np.cumsum(z["lens"])
        starts = ends - z["lens"]
        rows = starts - np.arange(len(starts))          # a sequence of T tokens has T - 1 rows
        top = "top_ids" in z.files
        out = []
        for i, (a, b, r) in enumerate(zip(starts, ends, rows, strict=True)):
            n = b - a - 1
            out.append(TargetSequence(
                z["ids"][a:b], int(z["n_prompt"][i]), z["feats"][r:r + n], z["choice"][r:r + n],
                z["top_ids"][r:r + n] if top else None, z["top_logp"][r:r + n] if top else None))
    log.info("data_loaded", path=str(path), sequences=len(out))
    return out
