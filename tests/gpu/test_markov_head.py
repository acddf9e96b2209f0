"""The DSpark Markov head on the CUDA backend: the correction (embed + matmul_add on the device)
equals the CPU backend's within float tolerance; a headed drafter drafts the same chain eager,
captured and replayed (the head is inside the draft step's graph), the head changes its drafts,
and greedy output stays identical to plain greedy output."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from service.backends import create_backend
from service.engine.spec.markov_head import MarkovHead, read_head_shape
from service.gguf.reader import GGUFFile
from service.model.spec import ModelSpec
from service.tools.fit_markov import write_head
from tests.gpu.test_model_drafter import _run
from tests.gpu.test_models import cuda_engine, real_path
from tests.support.models import load_json, open_gguf

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

V = 49152                        # SmolLM2's vocabulary


def _random_head(vocab: int, rank: int, scale: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((vocab, rank)).astype(np.float32)                 # (V, R)
    w2 = (rng.standard_normal((vocab, rank)) * scale / np.sqrt(rank)).astype(np.float32)
    return w1, w2


@pytest.mark.parametrize("dtype", ["f16", "f32"])
@pytest.mark.parametrize("rank", [16, 64])
def test_head_on_cuda_equals_cpu(tmp_path, dtype, rank):
    from service.backends.cuda.backend import CudaBackend

    # a backend of its own: a backend shares loaded matrices by tensor name, and every case
    # here names its head's tensors alike
    cuda = CudaBackend(graphs=False, prefill_gemm_min_tokens=None)
    tiny = open_gguf("tiny-qwen3")
    vocab = ModelSpec.from_gguf(tiny).vocab_size
    out = tmp_path / "tiny-head.gguf"
    write_head(tiny, out, *_random_head(vocab, rank, 3.0), dtype)
    f = GGUFFile(out)
    shape = read_head_shape(f, vocab)
    gpu, cpu = MarkovHead(f, shape, cuda), MarkovHead(f, shape, create_backend("cpu"))
    cuda.finish_load()
    rng = np.random.default_rng(rank)
    with cuda.stream:
        for ids in ([3], [1, vocab - 1], [0, 7, 7, 2, 5]):
            logits = rng.standard_normal((1, vocab)).astype(np.float32)        # (1, V)
            ref = logits.copy()
            cpu.apply(np.array(ids, np.int32), ref)
            dev = cp.asarray(logits)                                           # (1, V) f32
            gpu.apply(cp.asarray(np.array(ids, np.int32)), dev)
            got = cuda.to_host(dev)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
            assert not np.allclose(got, logits)          # the head added something


@pytest.fixture(scope="module")
def headed_draft(requantized, tmp_path_factory):
    plain = requantized(real_path("smollm2"), "q8_0", 4)
    headed = tmp_path_factory.mktemp("markov") / "smol-4l-head.gguf"
    write_head(GGUFFile(plain), headed, *_random_head(V, 16, 4.0), "f16")
    return plain, headed


def test_headed_drafter_on_cuda_is_captured_and_lossless(headed_draft):
    from tests.engine.test_model_drafter import _State

    plain, headed = headed_draft
    with cuda_engine("smollm2", drafter="model", draft_model=str(headed), verify_width=16,
                     n_slots=2, draft_in_full=True) as eng, \
            cuda_engine("smollm2", drafter="model", draft_model=str(plain), verify_width=16,
                        n_slots=2) as other:
        d, p = eng.drafter, other.drafter
        assert d.head is not None and d.head.rank == 16 and p.head is None
        prompt = load_json("llamacpp_smollm2_greedy.json")["cases"][3]["prompt_ids"]
        chains = []
        for _ in range(3):                 # eager, captured, replayed
            s = _State(0, list(prompt))
            d.start(s)
            chains.append(d.propose(s, 6))
            d.release(s)
        assert chains[0] == chains[1] == chains[2], chains
        s = _State(0, list(prompt))
        p.start(s)
        assert p.propose(s, 6) != chains[0]          # the head decides drafts on the device
        for width in (2, 6, 16):
            eng.config = replace(eng.config, verify_width=width)
            drafted = 0
            for case in load_json("llamacpp_smollm2_greedy.json")["cases"]:
                plain_out = _run(eng, case["prompt_ids"], False)
                spec = _run(eng, case["prompt_ids"], None)
                assert spec.token_ids == plain_out.token_ids, (width, case["name"])
                drafted += spec.finished.usage.draft_tokens
            assert drafted > 0
