"""train-drafter's target runner (service/tools/eagle3_data.py TargetRunner) on the CUDA
backend over the fake device (tests/support/fake_cupy.py): prompts of 40, 40 and 150 tokens run
in chunks of up to 128 tapped rows (a 32..64-row chunk is captured, a wider one takes the cuBLAS
GEMM eagerly; CuPy refuses cuBLAS inside a capture, and so does the fake device), then greedy
tokens two sequences at a time. The kernels do not compute here, so only the path is checked
(shapes of what comes back); tests/engine/test_train_drafter.py checks the values on the CPU."""

from __future__ import annotations

from service.tools.eagle3_data import TargetRunner
from tests.support.fake_cupy import install
from tests.support.models import TINY


def test_the_target_runner_generates_tapped_rows_on_the_fake_device(compiled):
    with install(compiled) as dev:
        runner = TargetRunner(TINY / "tiny-qwen3.gguf", (0, 1, 2), backend="cuda", n_slots=2,
                              n_ctx=256, max_tokens=128)
        # two 40-token chunks: one shape twice (the second use is captured), then 150 tokens
        prompts = [list(range(1, 41)), list(range(2, 42)), list(range(3, 153))]
        seqs = runner.generate(prompts, 5)
        assert dev.gemms, "no prompt chunk took the GEMM path"
        assert dev.graphs and all(g.replays for g in dev.graphs)
    assert len(seqs) == 3
    E = runner.spec.n_embd
    for s, p in zip(seqs, prompts, strict=True):
        assert list(s.ids[:len(p)]) == p and s.n_prompt == len(p) and len(s.ids) <= len(p) + 5
        assert s.feats.shape == (len(s.ids) - 1, 3 * E)
