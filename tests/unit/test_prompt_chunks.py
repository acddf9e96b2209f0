"""scheduler/chunks.py: a prompt's chunks from position 0, the wide ones a cold prefill takes,
and how far a cached prefix may be reused without changing a bit."""

from __future__ import annotations

from service.engine.scheduler.chunks import PromptChunks


def test_chunks_run_to_the_next_multiple_of_the_chunk_size():
    c = PromptChunks(256, 64)
    assert [c.next_rows(p, 600) for p in (0, 256, 512)] == [256, 256, 88]
    assert c.next_rows(80, 600) == 176             # after a cached prefix: back on the grid
    assert c.next_rows(300, 310) == 10


def test_cold_spans_are_the_chunks_wider_than_the_invariant_steps():
    c = PromptChunks(256, 64)
    assert c.cold_spans(600) == [(0, 256), (256, 256), (512, 88)]
    assert c.cold_spans(300) == [(0, 256)]         # the last 44 rows take the invariant path
    assert c.cold_spans(64) == [] and PromptChunks(64, 64).cold_spans(1000) == []


def test_a_hit_ending_inside_a_wide_chunk_is_cut_to_its_start():
    c = PromptChunks(256, 64)
    assert c.reusable(528, 600, 16) == 512          # inside (512, 88)
    assert c.reusable(512, 600, 16) == 512          # on a boundary
    assert c.reusable(240, 600, 16) == 0
    assert c.reusable(288, 300, 16) == 288          # inside the narrow last chunk: kept
    assert PromptChunks(32, 64).reusable(80, 93, 16) == 80     # no wide chunk at all
    # chunk starts off the block grid: each cut lands in the chunk before, cut in turn
    c = PromptChunks(100, 64)
    assert c.cold_spans(400) == [(0, 100), (100, 100), (200, 100), (300, 100)]
    assert c.reusable(208, 400, 16) == 0
    assert c.reusable(304, 400, 16) == 0
