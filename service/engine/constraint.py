"""Structured output through xgrammar: a request's Constraint compiled against the model's
vocabulary, and one matcher per constrained sequence that gives the next step's token mask.

xgrammar (and the torch it imports) is loaded on the first constrained request, never at server
import time. The vocabulary given to xgrammar is each token's exact byte string
(Tokenizer.token_piece, llama.cpp's token_to_piece) as VocabType.RAW, so byte-level BPE
(GPT-2 style) and SentencePiece (spaces as U+2581, <0xAB> byte tokens) vocabularies are both
exact; control and unused tokens are b"" (never allowed), and the model's end-of-generation ids
are the stop tokens (allowed exactly where the text is complete).

Masks are int32 words, bit (t % 32) of word (t // 32) set when token t is allowed, one row of
ceil(vocab / 32) words per constrained row.

A request's constraint is compiled once (`compile_constraint`, by the front end that checks the
request; `compilations` counts the calls): its `Compiled` holds the grammar and the first
token's mask, which every sequence of the request (n samples) starts from.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.engine.types import Constraint
from service.errors import InvalidRequestError

COMPILER_CACHE_BYTES = 256 << 20       # xgrammar's compiled-grammar cache (LRU by text)
MAX_CONSTRAINT_CHARS = 1 << 20         # a longer schema / regex / grammar is refused unread

_lock = threading.Lock()
_compilations = 0                       # compile_constraint calls (compilations())
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")      # "[13:18:00] path.cc:820: "


def xgr() -> Any:
    import xgrammar  # ~3 s: torch + transformers; first constrained request
    return xgrammar


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def tokenizer_info(tokenizer: Any, vocab_size: int | None = None) -> Any:
    """xgrammar's TokenizerInfo for a service Tokenizer: exact bytes, RAW, EOG ids as stops.
    `vocab_size` is the logits width (>= the tokenizer's; extra ids are never allowed)."""
    x = xgr()
    n = tokenizer.vocab_size
    vocab = [tokenizer.token_piece(i, skip_special=True) for i in range(n)]
    stops = sorted(tokenizer.eog_ids)
    if tokenizer.eos_id is not None and tokenizer.eos_id not in stops:
        stops.append(tokenizer.eos_id)
    return x.TokenizerInfo(vocab, x.VocabType.RAW, vocab_size=max(vocab_size or n, n),
                           stop_token_ids=stops)


_compilers: dict[int, tuple[Any, Any]] = {}     # id(tokenizer) -> (tokenizer, compiler)


def compiler(tokenizer: Any, vocab_size: int | None = None) -> Any:
    """One GrammarCompiler per tokenizer (its cache keeps compiled grammars, bounded LRU)."""
    with _lock:
        hit = _compilers.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        x = xgr()
        c = x.GrammarCompiler(tokenizer_info(tokenizer, vocab_size), max_threads=1,
                              cache_enabled=True, cache_limit_bytes=COMPILER_CACHE_BYTES)
        _compilers[id(tokenizer)] = (tokenizer, c)
        return c


def _field(c: Constraint) -> str:
    return f"constraint.{c.kind}"


def check(c: Constraint) -> None:
    """Cheap checks that need no compiler (sizes, empty fields, JSON syntax)."""
    if c.kind == "choice":
        if not c.options or any(not o for o in c.options):
            raise InvalidRequestError("constraint.choice.options",
                                      "give at least one option, none empty")
        if sum(len(o) for o in c.options) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError("constraint.choice.options", "too long")
        return
    if c.kind == "json_object":
        return
    if not c.text:
        raise InvalidRequestError(_field(c), "is empty")
    if len(c.text) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(_field(c), f"longer than {MAX_CONSTRAINT_CHARS} characters")
    if c.kind == "json_schema":
        try:
            json.loads(c.text)
        except ValueError as e:
            raise InvalidRequestError(_field(c), f"not JSON: {e}") from None


def _ebnf_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)      # "..." with \" and \\ escaped, as EBNF reads


@dataclass(frozen=True, eq=False)
class Compiled:
    """A request's constraint compiled against the model's vocabulary."""

    constraint: Constraint
    grammar: Any                # xgrammar's CompiledGrammar (shared through its compiler cache)
    first_mask: np.ndarray      # (W,) i32 read-only: the mask of the first generated token


def compilations() -> int:
    """How many times compile_constraint ran in this process (each one compiler cache lookup,
    or a compile, and one first-mask fill)."""
    return _compilations


def compile_constraint(tokenizer: Any, c: Constraint, vocab_size: int | None = None
                       ) -> Compiled:
    """`c` compiled (the grammar cached by text in the compiler) with its first token's mask;
    a constraint that does not compile, or that no text satisfies (the first mask allows not
    even an end token), is INVALID_ARGUMENT naming its field."""
    global _compilations
    with _lock:
        _compilations += 1
    check(c)
    if not tokenizer.can_encode:
        raise InvalidRequestError("constraint", "the model has no text vocabulary to constrain")
    compiled = _compile(compiler(tokenizer, vocab_size), c)
    first = np.empty(mask_words(compiled.tokenizer_info.vocab_size), np.int32)      # (W,) i32
    xgr().GrammarMatcher(compiled).fill_next_token_bitmask(first.reshape(1, -1), 0)
    if not first.any():     # not even an end token: every draw would be from an empty set
        raise InvalidRequestError(_field(c), "no text satisfies it: no token of the model's "
                                             "vocabulary can begin it")
    first.setflags(write=False)         # shared by the request's sequences
    return Compiled(c, compiled, first)


def _compile(comp: Any, c: Constraint) -> Any:
    try:
        if c.kind == "json_schema":
            return comp.compile_json_schema(c.text, any_whitespace=False, strict_mode=True)
        if c.kind == "json_object":
            return comp.compile_builtin_json_grammar()
        if c.kind == "regex":
            return comp.compile_regex(c.text)
        if c.kind == "grammar":
            return comp.compile_grammar(c.text, root_rule_name="root")
        if c.kind == "choice":
            body = " | ".join(_ebnf_string(o) for o in c.options)
            return comp.compile_grammar(f"root ::= {body}", root_rule_name="root")
    except (RuntimeError, ValueError, TypeError) as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        reason = _LOG_PREFIX.sub("", lines[0]) if lines else type(e).__name__
        raise InvalidRequestError(_field(c), reason) from None
    raise InvalidRequestError("constraint", f"unknown constraint kind {c.kind!r}")


class Matcher:
    """One constrained sequence: the mask of its next token, advanced by committed tokens.
    Masks are filled by xgrammar straight into numpy rows (DLPack): no torch buffer between."""

    def __init__(self, compiled: Compiled, vocab_size: int):
        x = xgr()
        self._m = x.GrammarMatcher(compiled.grammar)      # rollback is unlimited
        self._first = compiled.first_mask
        self.vocab_size = vocab_size
        self._stops = np.asarray(self._m.stop_token_ids, np.int64)
        # (W,) i32: every token but the stop tokens; done() ANDs the next mask with it
        self._free = np.full(mask_words(vocab_size), -1, np.int32)
        for t in self._stops[self._stops < vocab_size]:
            self._free.view(np.uint32)[t >> 5] &= ~np.uint32(1 << (int(t) & 31))
        self.ahead: int | None = None     # a committed token already accepted (advance_rows)

    def fill(self, out: np.ndarray) -> None:
        """Write the next token's mask (int32 words) into `out` (W,) i32 contiguous; past the
        stop token (an end token taken under ignore_eos) nothing is allowed."""
        if self._m.is_terminated():     # xgrammar refuses to fill a terminated matcher
            out[:] = 0
            return
        self._m.fill_next_token_bitmask(out.reshape(1, -1), 0)

    def mask(self) -> np.ndarray:
        out = np.empty(mask_words(self.vocab_size), np.int32)      # (W,) i32
        self.fill(out)
        return out

    def first_mask(self) -> np.ndarray:
        """The mask before any token (the compiled one, read-only: no fill)."""
        return self._first

    def is_stop(self, token: int) -> bool:
        """Whether `token` is one of the grammar's stop tokens (it ends the constraint)."""
        return bool((self._stops == token).any())

    def accept(self, token: int) -> bool:
        """Advance by one token; False when the token is not allowed (nothing changes)."""
        return bool(self._m.accept_token(int(token)))

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    @property
    def terminated(self) -> bool:
        """A stop token was accepted."""
        return bool(self._m.is_terminated())

    def done(self, mask: np.ndarray) -> bool:
        """The text is complete and `mask` (this matcher's next mask) allows nothing but stop
        tokens: the constraint ends the generation (FINISH_REASON_CONSTRAINT)."""
        return bool(self._m.is_completed()) and not np.bitwise_and(mask, self._free).any()

    @property
    def completed(self) -> bool:
        return bool(self._m.is_completed())


# Rows a step's batch fill spreads over host threads from (fewer: one thread, no hand-off)
THREADED_ROWS = 4
# Threads of a threaded batch fill: every core (the engine thread waits for the fill; xgrammar's
# "auto" would take half of them)
FILL_THREADS = os.cpu_count() or 1
# The hand-off to the threads costs about half a millisecond (16-core host, 16 rows of a JSON
# schema: 0.85 ms threaded, against 0.02 ms a row on one thread), so a batch goes threaded only
# where one thread would take at least THREAD_MIN_MS for it, by the cost per row of the last
# one-thread fill; while batches go threaded that cost is measured again (one batch on one
# thread) every REMEASURE batches.
THREAD_MIN_MS = 1.0
REMEASURE = 256
_batchers: dict[int, Any] = {}           # by thread count


class FillThreads:
    """Whether a batch fill of n rows goes to the threads, from what one-thread fills cost."""

    def __init__(self) -> None:
        self.row_ms: float | None = None    # ms a row of the last one-thread fill
        self.threaded_since = 0             # threaded batches since that fill

    def threaded(self, n: int) -> bool:
        if n < THREADED_ROWS or FILL_THREADS <= 1 or self.row_ms is None:
            return False
        if self.threaded_since >= REMEASURE:
            return False
        return self.row_ms * n >= THREAD_MIN_MS

    def record(self, n: int, threaded: bool, ms: float) -> None:
        if threaded:
            self.threaded_since += 1
        else:
            self.row_ms, self.threaded_since = ms / n, 0


# the process's (its engines' threads share it: it decides how fast a fill runs, never a mask)
fill_threads = FillThreads()


def _batcher(threaded: bool) -> Any:
    n = FILL_THREADS if threaded else 1
    with _lock:
        b = _batchers.get(n)
        if b is None:
            b = _batchers[n] = xgr().BatchGrammarMatcher(n)
        return b


def advance_rows(matchers: list[Matcher], tokens: list[int],
                 fill: list[bool] | None = None) -> tuple[np.ndarray, list[bool]]:
    """Accept one committed token per matcher and fill the next masks, all in one batch
    (xgrammar's BatchGrammarMatcher: accept, then fill, on its threads where one thread would
    take long: FillThreads) into one array: (masks (n, W) i32, which rows were filled). A
    matcher whose `ahead` is already its token accepted it before (it is not accepted twice);
    `fill[i]` False skips row i's fill (its mask is filled when asked for), as does a matcher
    past its stop token. Each matcher's `ahead` records its token. A token a matcher refuses
    leaves it unchanged with `ahead` None (its row of the array is garbage): the per-token path
    then refuses it as before."""
    x, n = xgr(), len(matchers)
    masks = np.empty((n, mask_words(matchers[0].vocab_size) if n else 1), np.int32)   # (n, W)
    if not n:
        return masks, []
    ok = [m.ahead is not None and m.ahead == int(t) for m, t in zip(matchers, tokens, strict=True)]
    todo = [i for i in range(n) if not ok[i]]
    if todo:
        got = x.BatchGrammarMatcher.batch_accept_token([matchers[i]._m for i in todo],
                                                       [int(tokens[i]) for i in todo])
        for i, g in zip(todo, got, strict=True):
            ok[i] = bool(g)
    # a matcher that took its stop token (an end token under ignore_eos) has no next mask:
    # unfilled, its sequence ends with the constraint (Sequence._advance)
    filled = [ok[i] and (fill is None or fill[i]) and not matchers[i].terminated
              for i in range(n)]
    for i, m in enumerate(matchers):    # before the fill: a fill that fails accepted them
        m.ahead = int(tokens[i]) if ok[i] else None
    keep = [i for i in range(n) if filled[i]]
    if keep:
        threaded = fill_threads.threaded(len(keep))
        t0 = time.perf_counter()
        _batcher(threaded).batch_fill_next_token_bitmask([matchers[i]._m for i in keep],
                                                         masks, keep)
        fill_threads.record(len(keep), threaded, 1e3 * (time.perf_counter() - t0))
    return masks, filled


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def dead_end(mask: np.ndarray) -> bool:
    """`mask` allows no token, not even an end token: the constraint has no continuation of
    the text so far (the regex a[^\\x00-\\U0010ffff] after "a"), and the generation ends
    there (FINISH_REASON_CONSTRAINT_DEAD_END) rather than draw from an empty set."""
    return not mask.any()


def mask_logits(logits: np.ndarray, mask: np.ndarray) -> None:
    """-inf on the tokens `mask` forbids (the host reference of the sample op's mask)."""
    n = logits.shape[-1]
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:n].astype(bool)
    logits[~bits] = -np.inf
