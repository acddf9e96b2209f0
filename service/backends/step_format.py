"""The step format both backends and the model runner share: the sample op's per-row int32
parameter record and its per-row output record.

These are the only definitions. The CUDA kernels receive them as NVRTC `-D` defines
(`CUDA_DEFINES` below, passed by service/backends/cuda/sources.py), so the Python and CUDA sides
cannot drift; tests/unit/test_step_format.py checks that no kernel file defines them itself.

Parameter record (N_PARAMS int32 words per logits row): the fields of `Param`; floats travel as
their float32 bits so both backends read the same values.
Adjustment list (the sample op's `adj` input, (K, 2) int32): the sparse additive logit
adjustments of a step, [token id, delta f32 bits] pairs; row r reads pairs
[ADJ_START, ADJ_START + ADJ_COUNT) (unique ids within a row; rows of one sequence may share a
range). ADJ_ROW_MAX bounds one row's pairs (logit_bias + the ids min_tokens bans).
Mask list (the sample op's `masks` input, (R, MASK_WORDS(V)) int32): structured-output token
masks, bit (t % 32) of word t // 32 set when token t is allowed; row r with MASK = m >= 0 gives
every token whose bit is clear in mask row m the logit -inf after the adjustments (before the
filters). Rows with MASK = -1 read nothing of it.
Output record (OUT_WORDS int32 words per row): [id, logprob bits, top ids (TOP_MAX),
top logprob bits (TOP_MAX)]; unused top entries are id -1, logprob 0. The logprob is the chosen
id's, or the SCORE id's where the record names one (a prompt token's log-probability).
"""

from __future__ import annotations

import enum

import numpy as np

TOP_MAX = 20                   # the most top log-probabilities a row may ask for
OUT_WORDS = 2 + 2 * TOP_MAX    # int32 words per row of the sample op's output
OUT_TOP_IDS = 2                # output record: where the top ids start (then their logprob bits)
ADJ_ROW_MAX = 2048             # the most adjustment pairs one row may carry


class Param(enum.IntEnum):
    """Word index of each field of a row's int32 parameter record."""

    TEMPERATURE = 0     # f32 bits; 0 = greedy
    TOP_K = 1           # 0 = off
    TOP_P = 2           # f32 bits; 1 = off
    MIN_P = 3           # f32 bits; 0 = off
    PENALTY = 4         # f32 bits; 1 = off
    REPEAT_LAST_N = 5   # window of the penalty; 0 = off
    SEED_LO = 6         # seed bits 0..31
    SEED_HI = 7         # seed bits 32..63
    TOKEN_INDEX = 8     # the counter of the draw (generated tokens so far)
    N_TOP = 9           # -1: no log-probabilities; 0..TOP_MAX: chosen + n_top alternatives
    SLOT = 10           # the row's KV slot (history row)
    POSITION = 11       # the row's position (its token is the newest in the window)
    FREQUENCY = 12      # f32 bits; frequency penalty over hist[slot, GEN_START..POSITION]; 0 = off
    PRESENCE = 13       # f32 bits; presence penalty over the same tokens; 0 = off
    GEN_START = 14      # position of the first generated token (the prompt's length)
    ADJ_START = 15      # first pair of the row's logit adjustments in the step's list
    ADJ_COUNT = 16      # pairs of the row's logit adjustments; 0 = none
    SCORE = 17          # -1: word 1 is the chosen id's log-probability; else this id's
    MASK = 18           # -1: no token mask; else the row of the step's mask list it reads


N_PARAMS = len(Param)


def mask_words(vocab: int) -> int:
    """int32 words of one token-mask row."""
    return (vocab + 31) // 32


def f32_bits(x: float) -> int:
    """The float32 bits of x as a signed int32 value."""
    return int(np.array([x], np.float32).view(np.int32)[0])


def param_record(*, temperature: float, top_k: int, top_p: float, min_p: float,
                 penalty: float, repeat_last_n: int, seed: int, token_index: int, n_top: int,
                 slot: int, position: int, frequency: float = 0.0, presence: float = 0.0,
                 gen_start: int = 0, adj_start: int = 0, adj_count: int = 0,
                 score: int = -1, mask: int = -1) -> list[int]:
    """One row's parameter record (N_PARAMS int32 values)."""
    seed &= (1 << 64) - 1
    rec = [0] * N_PARAMS
    rec[Param.TEMPERATURE] = f32_bits(temperature)
    rec[Param.TOP_K] = top_k
    rec[Param.TOP_P] = f32_bits(top_p)
    rec[Param.MIN_P] = f32_bits(min_p)
    rec[Param.PENALTY] = f32_bits(penalty)
    rec[Param.REPEAT_LAST_N] = repeat_last_n
    rec[Param.SEED_LO] = int(np.uint32(seed & 0xFFFFFFFF).view(np.int32))
    rec[Param.SEED_HI] = int(np.uint32(seed >> 32).view(np.int32))
    rec[Param.TOKEN_INDEX] = token_index
    rec[Param.N_TOP] = n_top
    rec[Param.SLOT] = slot
    rec[Param.POSITION] = position
    rec[Param.FREQUENCY] = f32_bits(frequency)
    rec[Param.PRESENCE] = f32_bits(presence)
    rec[Param.GEN_START] = gen_start
    rec[Param.ADJ_START] = adj_start
    rec[Param.ADJ_COUNT] = adj_count
    rec[Param.SCORE] = score
    rec[Param.MASK] = mask
    return rec


def cuda_defines() -> dict[str, int]:
    """The record layout as preprocessor names for cuda/sampling.cu: P_<FIELD>, N_PARAMS,
    TOP_MAX, OUT_WORDS."""
    out = {f"P_{p.name}": int(p) for p in Param}
    out.update(N_PARAMS=N_PARAMS, TOP_MAX=TOP_MAX, OUT_WORDS=OUT_WORDS)
    return out


def read_output(rec: np.ndarray, n_top: int) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """One row's output record (OUT_WORDS,) int32 as read back: the chosen id, its
    log-probability and the first min(n_top, TOP_MAX) alternatives that are set, as (id,
    log-probability), most likely first."""
    f = rec.view(np.float32)                                       # (OUT_WORDS,) f32 bits
    ids, logps = OUT_TOP_IDS, OUT_TOP_IDS + TOP_MAX
    top = tuple((int(rec[ids + i]), float(f[logps + i])) for i in range(min(n_top, TOP_MAX))
                if rec[ids + i] >= 0)
    return int(rec[0]), float(f[1]), top
