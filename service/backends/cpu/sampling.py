"""Token choice from logits rows, the reference of the `sample` op (cuda/sampling.cu computes the
same choices on the GPU). Pure numpy.

Each logits row comes with one int32 parameter record (`step_format.Param` gives the word of
each field; floats travel as their float32 bits, so both backends see the same values) and reads the
request's recent tokens from the token history hist (n_slots, n_ctx) int32, where every step
stores its input ids at [slot, position] (`record_tokens`). The chain, llama.cpp's default order:

    penalty -> frequency/presence -> logit adjustments -> top-k -> top-p -> min-p ->
    temperature -> draw

- penalty r on the distinct ids among hist[slot, max(0, pos - n + 1) .. pos] (n = repeat_last_n):
  l -> l / r if l > 0 else l * r (float32).
- frequency f and presence p (OpenAI's): with c_i the count of id i among the generated tokens
  hist[slot, gen_start .. pos], l_i -> l_i - (c_i * f + p) for every i with c_i > 0, float32
  rounding after each operation (f32(c_i) * f, then + p, then the subtraction).
- logit adjustments: l_i -> l_i + d_i (float32) for each pair (i, d_i) of the row's range of the
  step's adjustment list adj (K, 2) int32 (logit_bias, and -inf on the ids min_tokens bans).
  Everything below reads the adjusted logits l.
- greedy (temperature == 0): argmax l, the lowest id on ties.
- top-k (0 < k < V): the first k tokens in the order (l descending, id ascending).
- weights w_i = exp(l_i - l_max) in float64, z = sum of w over the top-k survivors.
- min-p (> 0): keep w_i >= min_p (p_i >= min_p * p_max, whatever the normaliser).
- top-p (< 1): order the survivors by (l descending, id ascending) and keep the shortest prefix
  whose w sum reaches top_p * z (the crossing token is kept). Judging by the pre-min-p
  normaliser z makes min-p-then-top-p pick the same set as llama.cpp's top-p-then-min-p.
- temperature T: q_i = exp((l_i - l_max) / T) (float64) over the survivors.
- draw: u = counter_uniform(seed, token_index); walking the survivors in ASCENDING ID order,
  the first whose running q sum exceeds u * (sum of q); the last survivor if rounding leaves
  none. A fixed order over ids (not over probabilities) is what a GPU block can scan without
  sorting.
- log-probabilities, when n_top >= 0: of the raw (unpenalised) logits, log_softmax in float64,
  stored as float32: the chosen token's (the SCORE token's when the record names one: a prompt
  token's log-probability) and the n_top most likely (logit descending, id ascending).

Output record per row (OUT_WORDS int32 words): [id, logprob bits, top ids (TOP_MAX),
top logprob bits (TOP_MAX)]; unused top entries are id -1, logprob 0.
"""

from __future__ import annotations

import numpy as np

from service.backends.counter_rng import counter_uniform
from service.backends.step_format import TOP_MAX, Param

_NUCLEUS_FIRST = 256           # top-p looks at the heaviest 256, 2048, ... tokens first
_NUCLEUS_GROWTH = 8


def _f32(word) -> np.float32:
    return np.array([word], np.int32).view(np.float32)[0]


# ---------------------------------------------------------------- the filters
def penalised(row: np.ndarray, window: np.ndarray, penalty: np.float32) -> np.ndarray:
    """A copy of row (V,) f32 with the penalty applied once to each distinct id of window."""
    work = np.array(row, np.float32)
    ids = np.unique(window[(window >= 0) & (window < row.size)])
    v = row[ids]
    work[ids] = np.where(v > 0, v / penalty, v * penalty)
    return work


def _top_k(lg: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of the first k tokens in (lg descending, id ascending) order."""
    if k <= 0 or k >= lg.size:
        return np.arange(lg.size)
    kth = -np.partition(-lg, k - 1)[k - 1]
    above = np.flatnonzero(lg > kth)
    ties = np.flatnonzero(lg == kth)[:k - above.size]
    return np.sort(np.concatenate([above, ties]))


def _top_p(lg: np.ndarray, ids: np.ndarray, w: np.ndarray, target: float) -> np.ndarray:
    """Ascending ids of the shortest (lg desc, id asc) prefix of ids whose w sum >= target
    (all of ids when their sum stays below). Looks at the heaviest few first: any set closed
    under ties at its smallest logit that already holds the target holds the prefix."""
    n_try = _NUCLEUS_FIRST
    while True:
        if n_try >= ids.size:
            cand = np.arange(ids.size)
        else:
            cut = -np.partition(-lg[ids], n_try - 1)[n_try - 1]
            cand = np.flatnonzero(lg[ids] >= cut)
            if w[cand].sum() < target:
                n_try *= _NUCLEUS_GROWTH
                continue
        order = cand[np.lexsort((ids[cand], -lg[ids[cand]]))]
        n = int(np.searchsorted(np.cumsum(w[order]), target, side="left")) + 1
        return np.sort(ids[order[:n]])


def survivors(lg: np.ndarray, temperature: float, top_k: int, top_p: float,
              min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The tokens the draw walks over the penalised logits lg (V,) f32: ids (n,) int64 ascending
    and their unnormalised weights q (n,) f64. Parameters are taken as float32."""
    temperature, top_p, min_p = (np.float64(np.float32(x)) for x in (temperature, top_p, min_p))
    ids = _top_k(lg, top_k)
    lmax = np.float64(lg.max())
    w = np.exp(lg[ids].astype(np.float64) - lmax)                       # (n,) f64
    z = float(w.sum())
    if min_p > 0:
        keep = w >= min_p
        ids, w = ids[keep], w[keep]
    if top_p < 1:
        ids = _top_p(lg, ids, w, float(top_p * z))
    q = np.exp((lg[ids].astype(np.float64) - lmax) / temperature)        # (n,) f64
    return ids.astype(np.int64), q


def distribution(lg: np.ndarray, temperature: float, top_k: int, top_p: float,
                 min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """survivors() with the weights normalised to probabilities (n,) f64 summing to 1."""
    ids, q = survivors(lg, temperature, top_k, top_p, min_p)
    return ids, q / q.sum()


def draw(lg: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
         u: float) -> int:
    """The token the uniform u in [0, 1) picks: inverse CDF over the ascending survivor ids."""
    ids, q = survivors(lg, temperature, top_k, top_p, min_p)
    cdf = np.cumsum(q)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(ids[min(i, ids.size - 1)])


# ---------------------------------------------------------------- log-probabilities
def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p_i = l_i - logsumexp(l), in f64: (V,) f32 -> (V,) f64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def top_ids(x: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries' ids, by value descending then id ascending."""
    k = min(k, x.size)
    if k <= 0:
        return np.zeros(0, np.int64)
    kth = -np.partition(-x, k - 1)[k - 1]
    above = np.flatnonzero(x > kth)
    cand = np.concatenate([above, np.flatnonzero(x == kth)[:k - above.size]])
    return cand[np.lexsort((cand, -x[cand]))]


def counted(lg: np.ndarray, generated: np.ndarray, frequency: np.float32,
            presence: np.float32) -> np.ndarray:
    """A copy of lg (V,) f32 with l_i - (c_i * frequency + presence) for the ids i that occur
    c_i > 0 times in generated (n,) int32."""
    work = np.array(lg, np.float32)
    ids, c = np.unique(generated[(generated >= 0) & (generated < lg.size)], return_counts=True)
    work[ids] = work[ids] - (c.astype(np.float32) * frequency + presence)
    return work


def adjusted(lg: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """A copy of lg (V,) f32 with l_i + d_i for each pair (i, d_i bits) of pairs (n, 2) int32
    (unique ids; ids outside [0, V) are skipped)."""
    work = np.array(lg, np.float32)
    ok = (pairs[:, 0] >= 0) & (pairs[:, 0] < lg.size)
    ids = pairs[ok, 0]
    work[ids] = work[ids] + pairs[ok, 1].view(np.float32)
    return work


def masked(lg: np.ndarray, words: np.ndarray) -> np.ndarray:
    """A copy of lg (V,) f32 with -inf where the mask row `words` (int32) has a clear bit."""
    bits = np.unpackbits(np.ascontiguousarray(words, np.int32).view(np.uint8),
                         bitorder="little")[:lg.size].astype(bool)
    work = np.array(lg, np.float32)
    work[~bits] = -np.inf
    return work


def _adjust(row: np.ndarray, rec: np.ndarray, hist: np.ndarray, adj: np.ndarray,
            masks: np.ndarray | None = None) -> np.ndarray:
    """The logits the filters read: row (V,) f32 with the repetition penalty, the frequency /
    presence penalties and the row's logit adjustments (the row itself when none applies)."""
    penalty, n = _f32(rec[Param.PENALTY]), int(rec[Param.REPEAT_LAST_N])
    slot, pos = int(rec[Param.SLOT]), int(rec[Param.POSITION])
    lg = row
    if penalty != 1 and n > 0 and slot >= 0:
        lg = penalised(row, hist[slot, max(0, pos - n + 1):pos + 1], penalty)
    freq, pres = _f32(rec[Param.FREQUENCY]), _f32(rec[Param.PRESENCE])
    gen = int(rec[Param.GEN_START])
    if (freq != 0 or pres != 0) and slot >= 0 and gen <= pos:
        lg = counted(lg, hist[slot, gen:pos + 1], freq, pres)
    start, count = int(rec[Param.ADJ_START]), int(rec[Param.ADJ_COUNT])
    if count > 0:
        lg = adjusted(lg, adj[start:start + count])
    m = int(rec[Param.MASK])
    if m >= 0 and masks is not None:
        lg = masked(lg, masks[m])
    return lg


# ---------------------------------------------------------------- the op
def sample_row(row: np.ndarray, rec: np.ndarray, hist: np.ndarray, adj: np.ndarray,
               out: np.ndarray, masks: np.ndarray | None = None) -> None:
    """One row of the op: row (V,) f32 logits, rec (N_PARAMS,) int32, hist (n_slots, n_ctx)
    int32, adj (K, 2) int32 (the step's logit adjustments), out (OUT_WORDS,) int32."""
    V = row.shape[0]
    temperature = _f32(rec[Param.TEMPERATURE])
    lg = _adjust(row, rec, hist, adj, masks)
    if temperature == 0:
        chosen = int(np.argmax(lg))
    else:
        seed = (int(np.int32(rec[Param.SEED_HI]).view(np.uint32)) << 32) | int(
            np.int32(rec[Param.SEED_LO]).view(np.uint32))
        u = counter_uniform(seed, int(rec[Param.TOKEN_INDEX]))
        chosen = draw(lg, float(temperature), int(rec[Param.TOP_K]), float(_f32(rec[Param.TOP_P])),
                      float(_f32(rec[Param.MIN_P])), u)
    out[:] = 0
    out[0] = chosen
    out[2:2 + TOP_MAX] = -1
    n_top = int(rec[Param.N_TOP])
    if n_top >= 0:
        x = row.astype(np.float64)
        m = x.max()
        lse = m + np.log(np.exp(x - m).sum())
        fl = out.view(np.float32)
        score = int(rec[Param.SCORE])
        fl[1] = np.float32(x[score if 0 <= score < V else chosen] - lse)
        top = top_ids(x, min(n_top, TOP_MAX, V))
        out[2:2 + top.size] = top
        fl[2 + TOP_MAX:2 + TOP_MAX + top.size] = (x[top] - lse).astype(np.float32)


def sample_rows(logits: np.ndarray, params: np.ndarray, hist: np.ndarray, adj: np.ndarray,
                out: np.ndarray, masks: np.ndarray | None = None) -> None:
    """logits (L, V) f32, params (L, N_PARAMS) int32, hist (n_slots, n_ctx) int32,
    adj (K, 2) int32, out (L, OUT_WORDS) int32, masks (R, MASK_WORDS) int32 or None."""
    for r in range(logits.shape[0]):
        sample_row(logits[r], params[r], hist, adj, out[r], masks)
