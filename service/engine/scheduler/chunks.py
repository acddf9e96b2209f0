"""Where a prompt's prefill chunks fall, and which cached KV rows a prompt may reuse exactly.

A KV row's bits depend on the step that computed it. Steps of up to `wide_rows` rows (decode,
verify, mixed steps, narrow chunks: MAX_STEP_ROWS) take the backends' step-size-invariant path,
where a row's bits are the same whatever else the step holds. A wider step (a prefill chunk of
its own) takes the wide path (CUDA: dequantize + cuBLAS GEMM and the query-tiled attention; CPU:
BLAS sgemm), where a row's bits may depend on the step's shape (a GEMM of other dimensions may
add in another order), never on the other rows' values. So a row computed in a wide chunk of
span (start, n) is reproduced exactly only by a chunk of the same span.

A prompt's chunks are fixed by its own length: chunk k covers [k C, min((k + 1) C, P)), C =
prefill_chunk, P the prompt's length, whatever the load and whatever the prefix cache gave it
(`next_rows` continues from a cached prefix to the next multiple of C). The prefix cache tags
every block with the wide spans that computed its rows (blocks.span_tag: nothing for rows of
the invariant path) inside its hash, and a prompt looks blocks up with the tags its own cold
prefill would give them (`cold_spans`), so a hit is a block computed exactly as the prompt
would compute it. The rows after the hit must then also be computed as cold: `reusable` cuts a
hit that ends inside a wide chunk back to that chunk's start, where the prompt computes the
whole chunk itself. Result: a request's tokens are the same whether or not any of its prompt
came from the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

Span = tuple[int, int]      # (first position, rows) of one wide step


@dataclass(frozen=True)
class PromptChunks:
    prefill_chunk: int          # C: prompt positions per chunk, from position 0
    wide_rows: int              # steps of more rows take the wide path (MAX_STEP_ROWS)

    def next_rows(self, n_past: int, n_prompt: int) -> int:
        """The rows of the prompt chunk that starts at n_past: to the next multiple of C (or
        the prompt's end)."""
        c = self.prefill_chunk
        return min(c - n_past % c, n_prompt - n_past)

    def cold_spans(self, n_prompt: int) -> list[Span]:
        """The wide chunks of a prompt of n_prompt tokens prefilled from position 0."""
        c = self.prefill_chunk
        spans = ((s, min(c, n_prompt - s)) for s in range(0, n_prompt, c))
        return [(s, n) for s, n in spans if n > self.wide_rows]

    def reusable(self, n_cached: int, n_prompt: int, block_size: int) -> int:
        """The positions of a cached prefix of n_cached (whole blocks) a prompt may take: cut
        back to the start of any wide chunk the prefix ends inside (block-aligned; the rows
        before a chunk start not on a block boundary belong to the chunk before it, whose
        start is checked in turn)."""
        spans = self.cold_spans(n_prompt)
        r = n_cached
        while True:
            inside = [s for s, n in spans if s < r < s + n]
            if not inside:
                return r
            r = inside[0] - inside[0] % block_size
