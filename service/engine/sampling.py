"""Token selection from logits: repetition penalty, top-k, top-p, min-p, temperature, draw.

Pure numpy, no I/O. The filter order is llama.cpp's default chain:

    penalty -> top-k -> top-p -> min-p -> temperature -> draw

top-p and min-p judge tokens by their temperature-1 probabilities p_i = softmax(logits)_i over the
tokens still in play; temperature only reshapes the distribution of the survivors:
q_i ∝ exp(l_i / T). Both top-p and min-p keep a prefix of the tokens ranked by probability, and
min-p's test p_i >= min_p * p_max does not depend on normalisation, so applying min-p first and
then cutting the nucleus inside its survivors (with the pre-min-p normaliser) gives exactly the
same set as llama.cpp's order, while sorting only the few survivors instead of the vocabulary.

`Sampler.distribution()` returns the final distribution (ids and probabilities) and
`Sampler.sample()` draws from it; the sampling tests check the filters through it. Speculative
decoding does not use it: the engine speculates only for greedy requests without a repetition
penalty (`Engine._new_sequence`) and accepts drafts that equal the target's argmax
(`speculative.accept_chain`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from service.engine.types import SamplingParams, TokenLogprob

# Nucleus search without top-k: look at the best 256, 2048, 16384, ... tokens until their mass
# reaches top_p, so a peaked distribution never pays for sorting a 262144-entry vocabulary.
_NUCLEUS_FIRST = 256
_NUCLEUS_GROWTH = 8


def resolve_seed(seed: int | None) -> int:
    """`seed`, or a fresh random 63-bit seed (reported back to the caller for replay)."""
    if seed is not None:
        return seed
    return int.from_bytes(os.urandom(8), "little") >> 1


class Sampler:
    """Per-request token selector; reproducible for a given (params, seed, logits sequence)."""

    def __init__(self, params: SamplingParams, vocab_size: int, seed: int):
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.params = params
        self.vocab_size = vocab_size
        self.seed = seed
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self._work = np.empty(vocab_size, np.float32)   # (V,) f32 penalised logits
        self._exp = np.empty(vocab_size, np.float64)    # (V,) f64 exp(l - max) scratch
        self._all_ids = np.arange(vocab_size, dtype=np.int64)    # (V,) returned when unfiltered
        self._all_ids.flags.writeable = False

    # ---------------------------------------------------------------- public
    def sample(self, logits: np.ndarray, recent_ids: Sequence[int] = ()) -> int:
        """Pick the next token. logits: (V,) f32 (extra trailing padding entries are ignored);
        recent_ids: the sequence so far, most recent last (for the repetition penalty)."""
        if self.params.greedy:
            return int(np.argmax(self._penalised(logits, recent_ids)))
        ids, probs = self.distribution(logits, recent_ids)
        # inverse CDF: one uniform per token keeps the random stream easy to replay
        cdf = np.cumsum(probs)
        i = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return int(ids[min(i, ids.size - 1)])

    def distribution(self, logits: np.ndarray,
                     recent_ids: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The distribution `sample()` draws from: ids (n,) int64 and probs (n,) f64 summing to
        1, most likely first when a filter sorted them. Greedy: the argmax with probability 1."""
        work = self._penalised(logits, recent_ids)
        if self.params.greedy:
            return np.array([np.argmax(work)], np.int64), np.ones(1)
        ids, vals = self._top_k(work)
        ids, vals, w, z = self._min_p(ids, vals)
        ids, vals = self._top_p(ids, vals, w, z)
        return ids, self._temperature(vals)

    # ---------------------------------------------------------------- filters
    def _penalised(self, logits: np.ndarray, recent_ids: Sequence[int]) -> np.ndarray:
        """CTRL/llama.cpp repetition penalty on the distinct ids among the last repeat_last_n:
        l -> l / r if l > 0 else l * r (both make the token less likely for r > 1)."""
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.shape[0] < self.vocab_size:
            raise ValueError(f"logits must be ({self.vocab_size},), got {logits.shape}")
        logits = logits[:self.vocab_size]
        r, n = self.params.repetition_penalty, self.params.repeat_last_n
        if r == 1.0 or n == 0 or len(recent_ids) == 0:
            return logits if logits.dtype == np.float32 else logits.astype(np.float32)
        tail = np.asarray(recent_ids[-n:] if isinstance(recent_ids, list | tuple | np.ndarray)
                          else list(recent_ids)[-n:], dtype=np.int64)
        seen = np.unique(tail[(tail >= 0) & (tail < self.vocab_size)])
        work = self._work
        np.copyto(work, logits)
        v = work[seen]
        work[seen] = np.where(v > 0, v / np.float32(r), v * np.float32(r))
        return work

    def _top_k(self, work: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Keep the k largest logits: argpartition is O(V), no full sort."""
        k = self.params.top_k
        if k <= 0 or k >= work.size:
            return self._all_ids, work
        ids = np.argpartition(work, work.size - k)[work.size - k:]    # (k,) unordered
        return ids, work[ids]

    def _min_p(self, ids: np.ndarray, vals: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Drop tokens with p < min_p * p_max, i.e. exp(l - l_max) < min_p. Also returns the
        unnormalised weights w = exp(l - l_max) (n,) f64 and their sum z over the tokens that
        entered (the top-p normaliser)."""
        m = vals.max()
        w = self._exp[:vals.size]
        np.subtract(vals, m, out=w, dtype=np.float64)
        np.exp(w, out=w)
        z = float(w.sum())
        if self.params.min_p > 0.0:
            keep = np.flatnonzero(w >= self.params.min_p)
            ids, vals, w = ids[keep], vals[keep], w[keep]
        return ids, vals, w, z

    def _top_p(self, ids: np.ndarray, vals: np.ndarray, w: np.ndarray,
               z: float) -> tuple[np.ndarray, np.ndarray]:
        """Smallest most-likely-first prefix whose mass reaches top_p (the crossing token is
        kept). Stable sort on -w ranks equal probabilities by position, deterministically."""
        top_p = self.params.top_p
        if top_p >= 1.0:
            return ids, vals
        target = top_p * z
        n_try = _NUCLEUS_FIRST
        while True:
            if n_try >= w.size:
                cand = np.arange(w.size)
            else:   # the n_try heaviest; enough if their mass already reaches the target
                cand = np.argpartition(-w, n_try)[:n_try]
                if w[cand].sum() < target:
                    n_try *= _NUCLEUS_GROWTH
                    continue
            order = cand[np.argsort(-w[cand], kind="stable")]
            cut = int(np.searchsorted(np.cumsum(w[order]), target, side="left")) + 1
            order = order[:cut]
            return ids[order], vals[order]

    def _temperature(self, vals: np.ndarray) -> np.ndarray:
        """q_i = exp((l_i - l_max) / T) / sum: (n,) f64."""
        q = np.exp((vals.astype(np.float64) - float(vals.max())) / self.params.temperature)
        return q / q.sum()


# ---------------------------------------------------------------- log-probabilities
def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p_i = l_i - logsumexp(l), in f64: (V,) f32 -> (V,) f64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def top_logprobs(logits: np.ndarray, chosen: int, k: int) -> TokenLogprob:
    """The chosen token's logprob under softmax of the raw logits (no penalty, temperature 1),
    plus the k most likely tokens (most likely first, lower id first on ties)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, x.size)
        # the k-th largest logit; ties with it are resolved towards lower ids, so the answer
        # does not depend on how argpartition happened to order equal values
        kth = -np.partition(-x, k - 1)[k - 1]
        above = np.flatnonzero(x > kth)
        cand = np.concatenate([above, np.flatnonzero(x == kth)[:k - above.size]])
        cand = cand[np.lexsort((cand, -x[cand]))]     # by logit desc, then id asc
        top = tuple((int(i), float(x[i] - lse)) for i in cand)
    return TokenLogprob(token_id=int(chosen), logprob=float(x[chosen] - lse), top=top)
