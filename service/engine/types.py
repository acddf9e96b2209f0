"""Domain types of a generation request and of the events it produces.

These are what the engine sees: no protobuf here. The server converts protobuf <-> these types
and the CLI builds them from flags. `validate()` methods raise `InvalidRequestError` naming the
field, so every front end reports the same message for the same mistake.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
MAX_PRIORITY = 1000              # GenerationRequest.priority: in [-MAX_PRIORITY, MAX_PRIORITY]
MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 256
MAX_TOP_K = 1_000_000
MAX_REPEAT_LAST_N = 1_000_000
MIN_REPETITION_PENALTY = 0.01    # a smaller one turns positive logits into float32 inf
MAX_LOGIT_BIAS = 300             # entries of SamplingParams.logit_bias
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 16                       # parallel samples of one prompt (GenerationRequest.n)


@dataclass(frozen=True)
class SamplingParams:
    """Token selection. temperature == 0 means greedy (argmax); the other knobs are then unused.

    Defaults follow llama.cpp's: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05.
    """

    temperature: float = 0.8
    top_k: int = 40                  # keep the k most likely tokens; 0 = off
    top_p: float = 0.95              # nucleus: smallest set with cumulative prob >= top_p; 1 = off
    min_p: float = 0.05              # drop tokens with prob < min_p * max prob; 0 = off
    repetition_penalty: float = 1.0  # CTRL-style penalty on the last `repeat_last_n` ids; 1 = off
    repeat_last_n: int = 64
    seed: int | None = None          # None: the engine picks one and reports it
    # OpenAI's penalties over the GENERATED tokens: l_i -= c_i * frequency + (c_i > 0) * presence
    frequency_penalty: float = 0.0   # in [-2, 2]; 0 = off
    presence_penalty: float = 0.0    # in [-2, 2]; 0 = off
    # (token id, bias in [-100, 100]) added to the logits, at most MAX_LOGIT_BIAS, unique ids
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reads_history(self) -> bool:
        """Whether the sample op reads the token history by position for this request (the
        repetition, frequency or presence penalty): chain verify only (spec/options.py)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    def validate(self, prefix: str = "sampling") -> None:
        checks = [
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_k", 0 <= self.top_k <= MAX_TOP_K,
             f"must be in [0, {MAX_TOP_K}] (0 disables top-k)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            # the bound as a float32, as the proto carries it (0.01 arrives as 0.0099999998)
            ("repetition_penalty",
             float(np.float32(MIN_REPETITION_PENALTY)) <= self.repetition_penalty <= 10.0,
             f"must be in [{MIN_REPETITION_PENALTY}, 10]"),
            ("repeat_last_n", 0 <= self.repeat_last_n <= MAX_REPEAT_LAST_N,
             f"must be in [0, {MAX_REPEAT_LAST_N}] (0 turns the repetition penalty off)"),
            ("seed", self.seed is None or 0 <= self.seed < 2**64, "must be in [0, 2^64)"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
        ]
        for name, ok, msg in checks:
            value = getattr(self, name)
            if not ok or (isinstance(value, float) and value != value):  # NaN fails too
                raise InvalidRequestError(f"{prefix}.{name}", f"{msg}, got {value!r}")

    def validate_bias(self, vocab_size: int, prefix: str = "sampling") -> None:
        """logit_bias: at most MAX_LOGIT_BIAS unique ids in the vocabulary, values in
        [-100, 100]."""
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"{prefix}.logit_bias", f"at most {MAX_LOGIT_BIAS} "
                                      f"entries allowed, got {len(self.logit_bias)}")
        seen: set[int] = set()
        for tok, bias in self.logit_bias:
            if not 0 <= tok < vocab_size:
                raise InvalidRequestError(f"{prefix}.logit_bias[{tok}]", f"token id {tok} is "
                                          f"outside the vocabulary [0, {vocab_size})")
            if tok in seen:
                raise InvalidRequestError(f"{prefix}.logit_bias[{tok}]", "given twice")
            seen.add(tok)
            if not -100.0 <= bias <= 100.0:                         # NaN fails too
                raise InvalidRequestError(f"{prefix}.logit_bias[{tok}]",
                                          f"must be in [-100, 100], got {bias!r}")


@dataclass(frozen=True)
class StoppingCriteria:
    max_new_tokens: int = 256
    stop_sequences: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # tokens generated before EOS and stop_token_ids are allowed (they are banned, logit -inf,
    # at token indexes below it) and stop sequences are looked for; 0 = off
    min_tokens: int = 0

    def validate(self, vocab_size: int, prefix: str = "stopping") -> None:
        if not 1 <= self.max_new_tokens <= 1_000_000:
            raise InvalidRequestError(f"{prefix}.max_new_tokens",
                                      f"must be in [1, 1000000], got {self.max_new_tokens}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequestError(f"{prefix}.min_tokens", f"must be in [0, max_new_tokens "
                                      f"= {self.max_new_tokens}], got {self.min_tokens}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"{prefix}.stop_token_ids",
                                      f"at most {MAX_STOP_TOKEN_IDS} allowed")
        if len(self.stop_sequences) > MAX_STOP_SEQUENCES:
            raise InvalidRequestError(f"{prefix}.stop_sequences",
                                      f"at most {MAX_STOP_SEQUENCES} allowed")
        for i, s in enumerate(self.stop_sequences):
            if not s or len(s) > MAX_STOP_SEQUENCE_CHARS:
                raise InvalidRequestError(
                    f"{prefix}.stop_sequences[{i}]",
                    f"must be 1..{MAX_STOP_SEQUENCE_CHARS} characters long")
        for i, t in enumerate(self.stop_token_ids):
            if not 0 <= t < vocab_size:
                raise InvalidRequestError(
                    f"{prefix}.stop_token_ids[{i}]",
                    f"token id {t} is outside the vocabulary [0, {vocab_size})")


SPECULATIVE_MODES = ("chain", "tree", "off")


@dataclass(frozen=True)
class SpeculativeOptions:
    """Per-request speculation within the server's limits (service/engine/spec/options.py
    resolves and checks them); None: the server's default. `GenerationRequest.speculative`
    is the on/off switch beside these."""

    mode: str | None = None          # "chain" | "tree" | "off"
    width: int | None = None         # chain verify rows, 2..the server's verify_width
    tree_budget: int | None = None   # tree verify nodes, 2..the server's tree_budget


@dataclass(frozen=True)
class Speculation:
    """A request's speculation once resolved against the server's limits: what its sequence
    runs with."""

    on: bool                 # drafts are proposed and verified
    verify_width: int        # rows of a chain verify step (seed + drafts)
    tree_budget: int         # > 0: tree verify with this many nodes; 0: chain verify


CONSTRAINT_KINDS = ("json_schema", "regex", "grammar", "choice", "json_object")


@dataclass(frozen=True)
class Constraint:
    """Structured output: `kind` one of CONSTRAINT_KINDS; `text` the schema, regex or grammar
    ("" for json_object); `options` the strings of a choice. Compiled by engine/constraint.py."""

    kind: str
    text: str = ""
    options: tuple[str, ...] = ()


class FinishReason(enum.Enum):
    LENGTH = "length"                # max_new_tokens reached
    EOS = "eos"                      # the model's end-of-generation token
    STOP_SEQUENCE = "stop_sequence"  # one of stop_sequences appeared in the text
    STOP_TOKEN = "stop_token"        # one of stop_token_ids was generated
    CONTEXT_LIMIT = "context_limit"  # the sequence filled the context window
    CANCELLED = "cancelled"          # the caller cancelled (or its deadline passed)
    CONSTRAINT = "constraint"        # the request's constraint was complete
    # the constraint allows no token after the text so far, not even an end token
    CONSTRAINT_DEAD_END = "constraint_dead_end"
    ERROR = "error"                  # the engine failed on this request


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    stopping: StoppingCriteria = StoppingCriteria()
    top_logprobs: int = 0            # alternatives reported per generated token, 0..20
    speculative: bool | None = None  # None: the server's default
    speculative_options: SpeculativeOptions = SpeculativeOptions()
    # the two above resolved (spec/options.resolve) by the front end that built the request;
    # None: the engine resolves them when the request is submitted
    speculation: Speculation | None = None
    # None: no prompt log-probabilities; k in 0..20: each prompt token's (after the first)
    # with k alternatives, in Started (sent once the prompt is processed)
    prompt_logprobs: int | None = None
    priority: int = 0                # admission order: lower first, FIFO within a level
    # structured output (service/engine/constraint.py); None: unconstrained
    constraint: Constraint | None = None
    # `constraint` compiled (constraint.Compiled) by the front end that checked it, for this
    # model; None: the engine compiles it when the request is submitted
    compiled_constraint: Any = field(default=None, compare=False, repr=False)

    def validate(self, vocab_size: int, n_ctx: int) -> None:
        if not self.prompt_ids:
            raise InvalidRequestError("input", "the prompt is empty")
        if len(self.prompt_ids) >= n_ctx:
            raise InvalidRequestError(
                "input", f"the prompt has {len(self.prompt_ids)} tokens; the context holds "
                f"{n_ctx}, leaving no room to generate", reason="PROMPT_TOO_LONG")
        ids = np.asarray(self.prompt_ids, dtype=np.int64)          # one pass, not per id
        bad = np.nonzero((ids < 0) | (ids >= vocab_size))[0]
        if len(bad):
            i = int(bad[0])
            raise InvalidRequestError(f"input.tokens.ids[{i}]", f"token id {int(ids[i])} is "
                                      f"outside the vocabulary [0, {vocab_size})")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("output.top_logprobs",
                                      f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.prompt_logprobs is not None and not (
                0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError("output.prompt_top_logprobs",
                                      f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise InvalidRequestError("priority", f"{self.priority} is outside "
                                      f"[-{MAX_PRIORITY}, {MAX_PRIORITY}]")
        self.sampling.validate()
        self.sampling.validate_bias(vocab_size)
        self.stopping.validate(vocab_size)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), most likely first


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    decode_steps: int = 0            # target steps after the prompt that decoded the request
    mean_tokens_per_step: float = 0.0   # accepted drafts + 1, averaged over decode_steps
    cached_prompt_tokens: int = 0    # prompt tokens whose KV came from the prefix cache


@dataclass(frozen=True)
class Timings:
    queue_ms: float = 0.0            # submit -> first engine step for this request
    time_to_first_token_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0           # first token -> last token
    per_token_decode_ms: float = 0.0
    # step profile (EngineConfig.step_profile; 0 when off): the decode steps that held the
    # request, each counted in full, split into drafting / candidate building / target step /
    # the rest
    draft_ms: float = 0.0
    heads_ms: float = 0.0
    verify_ms: float = 0.0
    other_ms: float = 0.0


# ---------------------------------------------------------------- events, in stream order
@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    seed: int
    # GenerationRequest.prompt_logprobs: prompt tokens 1..n-1, each under the logits after the
    # tokens before it
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Delta:
    token_ids: tuple[int, ...]
    text: str                        # valid UTF-8; never a partial stop sequence
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage
    timings: Timings
    matched_stop: str | int | None = None
    error: str | None = None         # set only with FinishReason.ERROR


Event = Started | Delta | Finished


@dataclass
class Collected:
    """All events of one request folded together (CLI --json, tests)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    started: Started | None = None
    finished: Finished | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, Started):
            self.started = event
        elif isinstance(event, Delta):
            self.token_ids.extend(event.token_ids)
            self.text += event.text
        else:
            self.finished = event
