"""The CUDA backend's Python on the CPU: every launcher, through real model steps, on a fake CuPy
device whose launches are checked against the kernels NVRTC compiles (tests/support/).

Scenarios (tests/support/cuda_steps.py) load every model family, weight type and KV (K, V)
pair on `create_backend("cuda", ...)` and run prefill, decode, batch, verify and tree steps,
draft chains and graph capture / replay; a mismatch with a compiled kernel, or anything a
captured graph cannot hold, raises inside the step. Kernels do not run: nothing here looks at
numbers. Each scenario runs once per module (`results`) and several tests read its log.
"""

from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from service.backends import create_backend
from service.backends.cuda.kernels import (
    GEMV_MMA_C64_TYPES,
    GEMV_MMA_TYPES,
    GEMV_PREFETCH_ROWS,
    GEMV_PREFETCH_TYPES,
    GEMV_WARPS,
    KV_READ,
    MMA_WARPS,
    MOEG_GLU_ROWS,
    MOEG_ROWS,
    mma_rows,
    mma_unit_groups,
)
from service.backends.cuda.types import (
    MOEG_NC,
    ceil_div,
    gemv_mma_kernel,
    gemv_mma_nc,
    moe_group_nc,
    moe_group_tiles,
)
from service.engine.types import Finished, GenerationRequest, SamplingParams, StoppingCriteria
from service.tools import synth
from tests.support import cuda_steps
from tests.support.blocks import ALL_TYPES
from tests.support.cuda_steps import KV_TYPES, Result, Scenario
from tests.support.fake_cupy import CUDADriverError, install
from tests.support.fake_gpu import (
    FITS,
    CaptureError,
    Gemm,
    KernelCheckError,
    Launch,
    MemoryCheckError,
)
from tests.support.models import TINY

# model -> the KV (K, V) pair its full scenario runs with (captured steps on quantized caches
# too; the option scenarios vary qwen3 on f16/f16)
FAMILIES = {"llama-mixq": ("q8_0", "q4_0"), "qwen3": ("f16", "f16"),
            "qwen3moe": ("q4_0", "q8_0"), "qwen2": ("q8_0", "f16"), "gemma3": ("f16", "q4_0"),
            "laguna": ("q8_0", "q8_0")}
OPTIONS = {                                  # name -> (CudaBackend options, cuda-bindings there)
    "graphs-off": ((("graphs", False),), True),
    "pdl-off": ((("pdl", False),), True),
    "no-cuda-bindings": ((), False),
    "gemv-mma": ((("gemv_mma", True),), True),
    "gemv-mma-no-prefetch": ((("gemv_mma", True), ("gemv_prefetch_rows", 0)), True),
    "gemv-early": ((("gemv_early", True),), True),
    "fuse-norm": ((("fuse_norm", True),), True),
    "fuse-norm-no-prefetch": ((("fuse_norm", True), ("gemv_prefetch_rows", 0)), True),
    "no-prefetch": ((("gemv_prefetch_rows", 0),), True),
    "gemv-rows-1": ((("gemv_rows", 1),), True),
    "pageable-upload": ((("upload", "pageable"),), True),
    "no-prefill-gemm": ((("prefill_gemm_min_tokens", None),), True),
    "split-prefill-attention": ((("prefill_attention_min_tokens", None),), True),
}
MIXES = tuple(synth.MIXES)
# the mixes whose base type has tensor-core GEMVs, run with them up to 64 rows (no GEMM)
MMA_MIXES = tuple(m for m in MIXES if synth.MIXES[m].base.name.lower() in GEMV_MMA_TYPES)
MMA = (("gemv_mma", True), ("invariant_tokens", 64))
MMA_NORM = (("gemv_mma", True), ("fuse_norm", True))
MMA_SPLIT = {one: (("gemv_mma", True), ("gemv_mma_one", one)) for one in ("split", "split-p")}
KV_PAIRS = tuple((k, v) for k in KV_TYPES for v in KV_TYPES)

# Compiled kernels nothing in the backend launches, each pattern with the reason.
NEVER_LAUNCHED = {
    r"gemv_\w+_c(1r2|2r4|4r2|8r2|16r2)":
        "gemv_choice takes R = GEMV_WIDE_ROWS[nc] rows per warp (r1 at one column); the other "
        "rows-per-warp variants are compiled (GEMV_VARIANTS in cuda/gemv.cu) but no launcher "
        "or test picks them (measured alternatives, docs/PERFORMANCE.md sections 2-3)",
    r"gemv_(q4_0|q4_1|q5_0|q5_1|q5_k|q8_0|q2_k|q3_k|iq4_nl|iq4_xs)_c1r1p":
        "the prefetching one-column GEMV runs for GEMV_PREFETCH_TYPES (q4_k, q6_k) only; not "
        "faster on the other types (docs/PERFORMANCE.md section 11)",
    r"gemv_mma_(q4_k|q5_k|q6_k)_c64":
        "types.gemv_mma_nc runs 33..64 columns over K-quant weights as two 32-column tiles "
        "(measured faster, kernels.GEMV_MMA_C64_TYPES); compiled for bench/gpu_bench.py's "
        "c64 column, which times them side by side",
    r"dequant_f16":
        "the prefill GEMM hands F16 weights to cuBLAS as stored; tests/gpu/"
        "test_prefill_gemm.py launches it through dequant_rows",
}


def all_scenarios() -> list[Scenario]:
    out = [Scenario(m, kv=kv) for m, kv in FAMILIES.items()]
    out += [Scenario("qwen3", options=o, driver=d) for o, d in OPTIONS.values()]
    for mix in MIXES:
        out += [Scenario(f"synth-{mix}", script="widths"),
                Scenario(f"synth-{mix}", script="decode", options=(("gemv_early", True),)),
                Scenario(f"synth-{mix}", script="decode", options=(("fuse_norm", True),))]
    out += [Scenario(f"synth-{mix}", script="mma", options=MMA) for mix in MMA_MIXES]
    # the family's fused residual GEMV + RMSNorm (gemv_mma_<type>_c1[p]n)
    out += [Scenario(f"synth-{mix}", script="decode", options=MMA_NORM) for mix in MMA_MIXES]
    # the family's one column split over K (gemv_mma_<type>_c1s[p])
    out += [Scenario(f"synth-{mix}", script="decode", options=o) for mix in MMA_MIXES
            for o in MMA_SPLIT.values()]
    out += [Scenario(f"synth-{mix}", script="decode",
                     options=(*MMA_NORM, ("gemv_prefetch_rows", 0))) for mix in ("Q4_K_M", "Q6_K")]
    out += [Scenario(m, kv=p, script="kv") for p in KV_PAIRS for m in ("qwen3", "gemma3")]
    out += [Scenario(m, script="hidden") for m in ("qwen3", "gemma3")]
    out += [Scenario("qwen3", script="hidden", options=(("fuse_norm", True),)),
            Scenario("qwen3", script="eagle3"), Scenario("qwen3moe", script="moe")]
    return [*out, Scenario("qwen3", script="ops")]


# ---------------------------------------------------------------- fixtures
# (`compiled`, the kernels' signatures, is tests/conftest.py's)
@pytest.fixture(scope="module")
def results(compiled, tmp_path_factory):
    """scenario -> Result, each scenario run on first use."""
    files = cuda_steps.model_files(tmp_path_factory.mktemp("models"))
    done: dict[Scenario, Result] = {}

    def get(s: Scenario) -> Result:
        if s not in done:
            try:
                done[s] = cuda_steps.run(s, compiled, files)
            except Exception as e:
                e.add_note(f"in scenario {s.name}")
                raise
        return done[s]

    return get


@pytest.fixture
def gpu(compiled):
    with install(compiled) as dev:
        yield dev


def names(r: Result, prefix: str = "") -> set[str]:
    return {k for k in r.kernels if k.startswith(prefix)}


# ---------------------------------------------------------------- model steps
@pytest.mark.parametrize("model", list(FAMILIES))
def test_model_family_steps_launch_only_compiled_kernels_with_matching_arguments(
        results, compiled, model):
    r = results(Scenario(model, kv=FAMILIES[model]))
    assert len(r.dev.launches) > 300
    sigs = compiled.kernels
    for x in r.dev.launches:             # checked at launch; restated from the log
        params = sigs[x.kernel].params
        assert len(x.args) == len(params), x.kernel
        assert all(p in FITS[a.kind] for a, p in zip(x.args, params, strict=True)), x.kernel
    for prefix in ("embed_", "gemv_", "rope_kv_", "attn_", "attnt_", "round_f16",
                   "sample_rows", "record_tokens", "kv_move", "chosen_ids"):
        assert names(r, prefix), prefix


@pytest.mark.parametrize("model", list(FAMILIES))
def test_captured_steps_hold_their_eager_launches_and_replay(results, model):
    r = results(Scenario(model, kv=FAMILIES[model]))
    by_label: dict[str, list] = {}
    for m in r.marks:
        by_label.setdefault(m.label, []).append(m)
    compared = set()
    for label, reps in by_label.items():
        if len(reps) < 3 or reps[1].graphs[1] - reps[1].graphs[0] != 1:
            continue
        eager = r.dev.launches[slice(*reps[0].launches)]
        graph = r.dev.graphs[reps[1].graphs[0]]
        captured = [n for n in graph.nodes if isinstance(n, Launch)]
        assert [x.work() for x in captured] == [x.work() for x in eager], label
        eager_gemms = r.dev.gemms[slice(*reps[0].gemms)]
        assert [(g.m, g.n, g.k) for g in eager_gemms] == [
            (g.m, g.n, g.k) for g in graph.nodes if isinstance(g, Gemm)], label
        assert reps[2].launches[0] == reps[2].launches[1], f"{label}: replay launched kernels"
        assert graph.replays >= 2, label     # at capture, at the third step (tree steps too)
        compared.add(label)
    assert compared == {"decode", "batch-2", "verify-4", "verify-5", "verify-12", "verify-16",
                        "chain-3"}
    # a step wide enough for the cuBLAS GEMM runs eagerly every time (CuPy cannot capture it)
    wide = by_label["prefill-40"]
    assert all(m.graphs[0] == m.graphs[1] and m.gemms[1] > m.gemms[0] for m in wide)
    # tree verify rows read their tree arrays from the step buffer: the verify graph serves
    tree = by_label["tree-4"]
    assert all(m.launches[0] == m.launches[1] and m.graphs[0] == m.graphs[1] for m in tree)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_captured_launches_use_pdl_and_eager_ones_cupy(results, model):
    r = results(Scenario(model, kv=FAMILIES[model]))
    assert {(x.graph is not None, x.via, x.pdl) for x in r.dev.launches} == {
        (False, "cupy", False), (True, "driver", True)}


@pytest.mark.parametrize("model", list(FAMILIES))
def test_every_launch_goes_to_one_non_default_stream(results, model):
    r = results(Scenario(model, kv=FAMILIES[model]))
    assert {x.stream for x in r.dev.launches} == {r.dev.launches[0].stream} != {0}
    assert {g.stream for g in r.dev.gemms} == {r.dev.launches[0].stream}


def test_a_runner_step_is_one_pinned_upload_one_pinned_readback_and_one_wait(results):
    r = results(Scenario("qwen3"))
    steps = [m for m in r.marks if m.logits]
    assert len(steps) > 20
    for m in steps:
        copies = r.dev.copies[slice(*m.copies)]
        assert [(c.direction, c.pinned) for c in copies] == [("h2d", True), ("d2h", True)]
        assert r.dev.syncs[slice(*m.syncs)] == ["event"], m.label


def test_overlapped_steps_queue_both_readbacks_and_feed_ids_before_the_second_step(results):
    """runner.submit: each step is one pinned upload and one pinned readback queued behind it;
    the host waits only in collect (two event waits for two steps); the second step's ids are
    fed on the device (feed_ids) after its upload and before its first kernel."""
    r = results(Scenario("qwen3", script="decode"))
    marks = [m for m in r.marks if m.label == "overlapped"]
    assert len(marks) == 3
    for m in marks:
        copies = r.dev.copies[slice(*m.copies)]
        assert [(c.direction, c.pinned) for c in copies] == [("h2d", True), ("d2h", True)] * 2
        assert r.dev.syncs[slice(*m.syncs)] == ["event", "event"], m.label
        names = [x.kernel for x in r.dev.launches[slice(*m.launches)]]
        if m.rep == 0:                    # eager: the first step's kernels, then the feed
            assert names.count("feed_ids") == 1 and names.index("feed_ids") > 0
            assert names[names.index("feed_ids") + 1] != "sample_rows"
        else:                             # replayed graphs: the feed is the one eager launch
            assert names == ["feed_ids"], names


@pytest.mark.parametrize("model", ["qwen3", "gemma3"])
def test_hidden_state_taps_copy_each_point_inside_the_captured_step(results, model):
    """A tapped step launches one copy_rows per capture point, (E, rows) wide, into the
    runner's buffer; its graph holds them and replays; the same shape without the tap is
    its own graph with no copy (untapped steps pay nothing)."""
    r = results(Scenario(model, script="hidden"))
    E = 256
    by_label: dict[str, list] = {}
    for m in r.marks:
        by_label.setdefault(m.label, []).append(m)

    def copies(m) -> list:
        return [x for x in r.dev.launches[slice(*m.launches)] if x.kernel == "copy_rows"]

    first = copies(by_label["tap-prefill-40"][0])
    n = len(first)
    assert n == 3 and all(x.grid == (ceil_rows(E), 64, 1) for x in first)  # padded to 64
    tap, plain = by_label["tap-verify-4"], by_label["verify-4"]
    assert [len(copies(m)) for m in tap] == [n, n, 0]     # eager, captured, replayed
    assert all(x.graph is not None for x in copies(tap[1]))
    graph = r.dev.graphs[tap[1].graphs[0]]
    assert [x.grid for x in graph.nodes if isinstance(x, Launch) and x.kernel == "copy_rows"] \
        == [(ceil_rows(E), 4, 1)] * n
    assert tap[2].launches[0] == tap[2].launches[1] and graph.replays >= 2
    assert all(not copies(m) for m in plain)
    assert r.dev.graphs[plain[1].graphs[0]] is not graph
    plain_graph = r.dev.graphs[plain[1].graphs[0]]
    assert not [x for x in plain_graph.nodes if isinstance(x, Launch) and x.kernel == "copy_rows"]
    logits = copies(by_label["tap-logits-5"][0])
    assert [x.grid for x in logits] == [(ceil_rows(E), 2, 1)] * n     # the 2 logits rows


def test_hidden_state_taps_sit_between_the_fused_norm_gemv_and_its_reader(results):
    """With fuse_norm, a tapped decode step's copies keep the 8-bit blocks the fused GEMV
    wrote (copy_rows is registered keeps_blocks): the step quantizes no more activations than
    the untapped decode of the full scenario does per layer."""
    r = results(Scenario("qwen3", script="hidden", options=(("fuse_norm", True),)))
    m = next(m for m in r.marks if m.label == "tap-decode" and m.rep == 0)
    names = [x.kernel for x in r.dev.launches[slice(*m.launches)]]
    assert names.count("copy_rows") == 3
    assert any(n.startswith("gemv_") and n.endswith("n") for n in names), names
    plain = results(Scenario("qwen3", script="decode", options=(("fuse_norm", True),)))
    p = next(m for m in plain.marks if m.label == "decode" and m.rep == 0)
    plain_names = [x.kernel for x in plain.dev.launches[slice(*p.launches)]]
    assert names.count("quantize_act") == plain_names.count("quantize_act")


def test_an_eagle3_drafter_runs_on_the_fake_device(results):
    """The drafter's encoder and decoder launch only compiled kernels with matching arguments
    (checked at each launch): the fc GEMM/GEMV, the strided norms into [e | gn], RoPE + KV
    write into its own cache, attention, the residual copy and the output over 300 rows."""
    r = results(Scenario("qwen3", script="eagle3"))
    marks = {m.label: m for m in r.marks}
    for label in ("eagle3-encode", "eagle3-decode-12", "eagle3-decode-1"):
        assert marks[label].launches[1] > marks[label].launches[0], label
    names = {x.kernel for m in marks.values() for x in r.dev.launches[slice(*m.launches)]}
    for prefix in ("embed_", "rms_norm", "rope_kv_", "attn", "copy_rows", "glu"):
        assert any(n.startswith(prefix) for n in names), (prefix, names)


def ceil_rows(n: int) -> int:
    return -(-n // 256)       # ROW_THREADS


def test_sampling_launches_one_block_per_logits_row(results):
    r = results(Scenario("qwen3"))
    for m in (m for m in r.marks if m.logits and m.launches[0] != m.launches[1]):
        grids = [x.grid for x in r.dev.launches[slice(*m.launches)] if x.kernel == "sample_rows"]
        assert grids == [(m.logits, 1, 1)], m.label


def test_engine_generates_on_the_fake_device(compiled):
    with cuda_steps.fake_device_engine(compiled, n_ctx=256, prefill_chunk=64) as (dev, eng):
        req = GenerationRequest("t", tuple(range(1, 50)), SamplingParams(temperature=0.0),
                                StoppingCriteria(max_new_tokens=6, ignore_eos=True))
        events = list(eng.generate(req, timeout=120))
    assert isinstance(events[-1], Finished)
    assert sum(len(getattr(e, "token_ids", ())) for e in events[1:-1]) == 6
    assert dev.graphs and all(g.replays for g in dev.graphs)
    assert {"attn_f16_f16_d128", "sample_rows", "gemv_q4_k_c1r1p"} <= {
        x.kernel for x in dev.launches}


def test_engine_start_captures_every_decode_and_verify_shape(compiled):
    """Before the first request the engine runs each (padded n, n logits) step shape up to its
    rows (2 slots x verify width 4 = 8) twice: every one is captured, so decoding alone and
    with speculation (chains of 2..4 rows) captures nothing new (prompt chunks of up to 64
    rows are captured on their second use, as before). With the overlapped loop (on by default
    on an asynchronous backend) each shape of up to its slots (the loop's rows: one a
    sequence) also as its rows sampled once their masks come: the model without its sample op
    (tagged "sample later") and the sample op of n rows."""
    with cuda_steps.fake_device_engine(compiled, n_ctx=512, prefill_chunk=64) as (dev, eng):
        be = eng.model.backend
        assert be.captures_steps and eng.overlap
        keys = {k[:2] for k in be.graph_keys}
        assert {(eng.runner.padded(n), n) for n in range(1, 9)} <= keys, keys
        later = {k[1] for k in be.graph_keys if k[2:3] == ("sample later",)}
        assert later == {1, 2}, later                  # 2 slots
        assert {k[0] for k in be.graph_keys if k[1:2] == ("sample",)} == {1, 2}
        start = be.graph_replays                      # (the step costs' timed steps)
        # the cost of a step of each size up to its rows, timed on the replayed graphs
        assert len(eng.row_costs) == 9 and eng.row_costs[1] == 1.0, eng.row_costs
        assert {k[:2] for k, n in start.items() if n} == {(s, s) for s in (1, 2, 4, 8)}
        before = be.n_graphs
        req = GenerationRequest("t", tuple(range(1, 50)), SamplingParams(temperature=0.0),
                                StoppingCriteria(max_new_tokens=12, ignore_eos=True))
        list(eng.generate(req, timeout=120))
        cuda_steps.speculate_greedily(eng, 12)
        new = [k[:2] for k in be.graph_keys[before:]]     # prompt chunks of 64: (64, 0 | 1)
        assert not [k for k in new if k[0] == eng.runner.padded(k[1])], new
        replayed = {k[:2] for k, n in be.graph_replays.items() if n > start.get(k, 0)}
        assert (1, 1) in replayed                       # decoding replayed the start's graph
        assert any(k[1] > 1 and k[0] == eng.runner.padded(k[1]) for k in replayed), replayed


@pytest.mark.xfail(strict=True, reason=(
    "service/engine/runner.py passes kv_positions / attn_lo / attn_mask on every step "
    "(ordinary rows too), and CudaBackend._attention takes the query-tiled kernel only when "
    "attn_lo is None: engine prefill always runs the split kernel"))
def test_runner_prefill_steps_use_the_query_tiled_attention(results):
    r = results(Scenario("qwen3"))
    m = next(m for m in r.marks if m.label == "prefill-40")
    assert any(x.kernel.startswith("attnt_") for x in r.dev.launches[slice(*m.launches)])


# ---------------------------------------------------------------- weight types, KV pairs
@pytest.mark.parametrize("mix", MMA_MIXES)
def test_tensor_core_gemv_takes_the_smallest_tile_that_holds_the_step(results, mix):
    """gemv_mma: a GEMV of C >= 2 columns launches gemv_mma_<type>_c<NC> with NC the smallest
    of 8, 16, 32, 64 >= C, grid (ceil(N / rows of the tile), ceil(C / NC)), one column
    gemv_mma_<type>_c1[p] (p: the prefetch rule of the dp4a GEMV) with one warp per row, and
    no dp4a GEMV runs over the type; the steps of 1..64 rows (padded by the runner to its
    captured widths; a replayed graph launches nothing) launch every tile of the base type."""
    t = synth.MIXES[mix].base.name.lower()
    r = results(Scenario(f"synth-{mix}", script="mma", options=MMA))
    assert [m.label for m in r.marks] == [f"mma-{n}" for n in cuda_steps.MMA_WIDTHS]
    want = {1: 8, 7: 8, 8: 8, 9: 16, 16: 16, 17: 32, 31: 32, 32: 32, 33: 64, 63: 64, 64: 64}
    if t not in GEMV_MMA_C64_TYPES:                 # K-quants: 32-column tiles over grid.y
        want.update({33: 32, 63: 32, 64: 32})
    assert {n: gemv_mma_nc(n, t) for n in cuda_steps.MMA_WIDTHS} == want
    widths = set()
    for m in r.marks:
        n = int(m.label.split("-")[1])
        mine = [x for x in r.dev.launches[slice(*m.launches)] if x.kernel.startswith("gemv")]
        assert not [x.kernel for x in mine if x.kernel.startswith(f"gemv_{t}_")], m.label
        for x in (x for x in mine if x.kernel.startswith("gemv_mma_")):
            N, C = int(x.args[5].value), int(x.args[8].value)      # K, N, qa, ads, n_cols
            kt = x.kernel[len("gemv_mma_"):].rsplit("_c", 1)[0]
            prefetch = N <= GEMV_PREFETCH_ROWS and kt in GEMV_PREFETCH_TYPES
            assert x.kernel == gemv_mma_kernel(C, kt, prefetch), (m.label, x.kernel, C)
            if C == 1:
                assert x.grid[:2] == (ceil_div(N, GEMV_WARPS), 1), (m.label, x)
                assert x.block[:2] == (32, GEMV_WARPS)
            else:
                nc = gemv_mma_nc(C, kt)
                assert x.grid[:2] == (ceil_div(N, mma_rows(nc)), ceil_div(C, nc)), (m.label, x)
                assert x.block[:2] == (32, MMA_WARPS)
            if x.kernel.startswith(f"gemv_mma_{t}_"):
                # the step padded, or the one sampled row's logits
                assert n <= C < 2 * max(n, 4) or C == 1, (m.label, C)
                widths.add(C)
    tiles = set(want.values())
    assert 1 in widths                              # the sampled row's logits, one column
    assert {gemv_mma_nc(C, t) for C in widths - {1}} == tiles, sorted(widths)
    assert {f"gemv_mma_{t}_c{nc}" for nc in tiles} <= r.kernels


@pytest.mark.parametrize("one", MMA_SPLIT)
@pytest.mark.parametrize("mix", MMA_MIXES)
def test_tensor_core_one_column_split_over_k(results, mix, one):
    """gemv_mma_one="split" / "split-p": every one-column GEMV over the type's weights launches
    gemv_mma_<type>_c1s / c1sp with blocks (32, MMA_WARPS) of 32 / unit-groups rows (grid
    ceil(N / rows)); none launches the warp-per-row c1[p] or a dp4a GEMV of the type."""
    t = synth.MIXES[mix].base.name.lower()
    r = results(Scenario(f"synth-{mix}", script="decode", options=MMA_SPLIT[one]))
    want = f"gemv_mma_{t}_c1s{'p' if one == 'split-p' else ''}"
    ones = [x for x in r.dev.launches if x.kernel.startswith(f"gemv_mma_{t}_c1")]
    assert ones and {x.kernel for x in ones} == {want}, {x.kernel for x in ones}
    assert not names(r, f"gemv_{t}_")
    for x in ones:
        N = int(x.args[5].value)
        assert x.grid[:2] == (ceil_div(N, 32 // mma_unit_groups(t)), 1), x
        assert x.block[:2] == (32, MMA_WARPS)


@pytest.mark.parametrize("mix", MIXES)
def test_every_weight_type_runs_embed_each_gemv_variant_and_the_gemm(results, mix):
    t = synth.MIXES[mix].base.name.lower()                  # the layout's kernel suffix
    quantized = synth.MIXES[mix].quantized
    r = results(Scenario(f"synth-{mix}", script="widths"))
    one = "c1r1p" if t in ("q4_k", "q6_k") else "c1r1"
    want = {f"embed_{t}", *(f"gemv_{t}_{v}" for v in (one, "c2r2", "c4r4", "c8r4", "c16r4"))}
    if t != "f16":
        want.add(f"dequant_{t}")
    assert want <= r.kernels
    early = results(Scenario(f"synth-{mix}", script="decode", options=(("gemv_early", True),)))
    fused = results(Scenario(f"synth-{mix}", script="decode", options=(("fuse_norm", True),)))
    if quantized:
        assert f"gemv_{t}_c1r1e" in early.kernels
        assert f"gemv_{t}_c1r1{'p' if one == 'c1r1p' else ''}n" in fused.kernels
    else:
        assert not names(early, f"gemv_{t}_c1r1e") and not names(fused, f"gemv_{t}_c1r1n")


@pytest.mark.parametrize("pair", KV_PAIRS, ids="/".join)
def test_every_kv_pair_runs_rope_kv_and_both_attentions_at_both_head_sizes(results, pair):
    k, v = pair
    (rk, kk), (rv, vk) = KV_READ[k], KV_READ[v]     # the 4/5-bit types share a reader
    for model, d in (("qwen3", 128), ("gemma3", 256)):
        r = results(Scenario(model, kv=pair, script="kv"))
        assert {f"rope_kv_{k}_{v}", f"attn_{rk}_{rv}_d{d}", f"attnt_{rk}_{rv}_d{d}"} <= r.kernels
        # each attention launch passes the readers' kinds of this pair (its last two arguments)
        kinds = {tuple(a.value for a in x.args[-2:]) for x in r.dev.launches
                 if x.kernel.startswith(("attn_", "attnt_"))}
        assert kinds == {(kk, vk)}, (model, kinds)


# ---------------------------------------------------------------- backend options
def _expect(option: str, r: Result, base: Result) -> None:
    launches, kernels = r.dev.launches, r.kernels
    if option in ("graphs-off",):
        assert not r.dev.graphs and {x.via for x in launches} == {"cupy"}
    elif option in ("pdl-off", "no-cuda-bindings"):
        assert r.dev.graphs and {x.via for x in launches} == {"cupy"}
    elif option == "gemv-mma":
        assert names(r, "gemv_mma_") == {f"gemv_mma_{t}_c{n}" for t in ("q4_k", "q6_k")
                                          for n in ("1p", 8, 16)}
        assert not names(r, "gemv_q4_k_") and not names(r, "gemv_q6_k_")
    elif option == "gemv-mma-no-prefetch":
        assert names(r, "gemv_mma_") == {f"gemv_mma_{t}_c{n}" for t in ("q4_k", "q6_k")
                                          for n in (1, 8, 16)}
    elif option == "gemv-early":
        assert {"gemv_q4_k_c1r1e", "gemv_q6_k_c1r1e"} <= kernels
        assert not {"gemv_q4_k_c1r1p", "gemv_q6_k_c1r1p"} & kernels
    elif option == "fuse-norm":
        assert "gemv_q4_k_c1r1pn" in kernels
    elif option == "fuse-norm-no-prefetch":
        assert {"gemv_q4_k_c1r1n", "gemv_q6_k_c1r1n"} & kernels
        assert not names(r, "gemv_q4_k_c1r1p")
    elif option == "no-prefetch":
        assert {"gemv_q4_k_c1r1", "gemv_q6_k_c1r1"} <= kernels and not {
            "gemv_q4_k_c1r1p", "gemv_q6_k_c1r1p"} & kernels
    elif option == "gemv-rows-1":
        assert all(re.fullmatch(r"gemv_\w+_c1r1p?", k) for k in names(r, "gemv_"))
    elif option == "pageable-upload":
        loading = r.dev.copies[:r.marks[0].copies[0]]
        assert loading and not any(c.pinned for c in loading)
        base_loading = base.dev.copies[:base.marks[0].copies[0]]
        assert sum(c.nbytes for c in base_loading if c.pinned) > 1_000_000
    elif option == "no-prefill-gemm":
        assert not r.dev.gemms and not names(r, "round_f16") and not names(r, "dequant_")
        assert base.dev.gemms
    elif option == "split-prefill-attention":
        assert not names(r, "attnt_") and names(base, "attnt_")
    else:
        raise AssertionError(option)


@pytest.mark.parametrize("option", OPTIONS)
def test_each_backend_option_launches_its_own_kernels(results, option):
    opts, driver = OPTIONS[option]
    _expect(option, results(Scenario("qwen3", options=opts, driver=driver)),
            results(Scenario("qwen3")))


# ---------------------------------------------------------------- expert-grouped MoE
def moe_segments(r: Result) -> list[tuple[int, list[Launch]]]:
    """Each MoE op of a run's log: (its step's tokens, its launches from moe_route to
    moe_combine)."""
    out, cur = [], None
    for x in r.dev.launches:
        if x.kernel == "moe_route":
            cur = (int(x.args[2].value), [x])         # moe_route(logits, ld, T, ...)
        elif cur is not None:
            cur[1].append(x)
            if x.kernel == "moe_combine":
                out.append(cur)
                cur = None
    return out


def test_moe_steps_of_two_or_more_tokens_group_pairs_by_expert(results):
    """tiny-qwen3moe (16 experts, 4 used): in every step of 2+ tokens (prefill, batch, verify,
    tree, eager and captured) each MoE op groups the pairs by expert (moe_group, one block, over
    T * 4 pairs, tiles of types.moe_group_nc's width) and runs the grouped gate|up+GLU and down
    GEMVs over grid.y = the tile bound; one-token steps (decode, draft chains) keep the gathered
    GEMVs and the separate GLU."""
    r = results(Scenario("qwen3moe", kv=FAMILIES["qwen3moe"]))
    n_exp, k = 16, 4
    seen = Counter()
    for T, xs in moe_segments(r):
        names = [x.kernel for x in xs]
        if T == 1:
            assert "moe_group" not in names and not any(n.startswith("moeg_") for n in names)
            assert "glu" in names
            seen["gathered"] += 1
            continue
        nc = moe_group_nc(T, k, n_exp)
        bound = moe_group_tiles(T * k, n_exp, nc)
        (group,) = [x for x in xs if x.kernel == "moe_group"]
        assert group.grid == (1, 1, 1)
        assert [int(group.args[i].value) for i in (1, 2, 4)] == [T * k, n_exp, nc]
        gemvs = [x for x in xs if x.kernel.startswith("moeg_")]
        assert [family(x.kernel) for x in gemvs] == [
            f"moeg_glu_<t>_c{nc}r{MOEG_GLU_ROWS[nc]}", f"moeg_<t>_c{nc}r{MOEG_ROWS[nc]}"]
        assert all(x.grid[1] == bound for x in gemvs), (T, [x.grid for x in gemvs])
        assert "glu" not in names and not any(n.startswith("gemv_") for n in names)
        seen["captured" if group.graph is not None else "eager"] += 1
    assert seen["gathered"] and seen["eager"] and seen["captured"], seen


def test_moe_group_min_tokens_none_keeps_the_gathered_path(results):
    r = results(Scenario("qwen3moe", script="decode", options=(("moe_group_min_tokens", None),)))
    segs = moe_segments(r)
    assert {T for T, _ in segs} >= {1, 2, 8}
    assert not {n for n in r.kernels if n == "moe_group" or n.startswith("moeg_")}


def test_the_moe_op_runs_every_grouped_kernel_of_every_type_and_tile_width(results, compiled):
    r = results(Scenario("qwen3moe", script="moe"))
    by_label = {m.label: {x.kernel for x in r.dev.launches[slice(*m.launches)]} for m in r.marks}
    for t in (t.lower() for t in ALL_TYPES):
        for nc in MOEG_NC:
            assert {"moe_group", f"moeg_glu_{t}_c{nc}r{MOEG_GLU_ROWS[nc]}",
                    f"moeg_{t}_c{nc}r{MOEG_ROWS[nc]}"} <= by_label[f"moe-{t}-c{nc}"]
        gathered = by_label[f"moe-{t}-gathered"]
        assert "moe_group" not in gathered and "glu" in gathered
    mixed = by_label["moe-mixed"]
    nc = moe_group_nc(16, 4, 16)                  # the script's 16 tokens, 4 of 16 experts
    assert {f"moeg_{t}_c{nc}r{MOEG_ROWS[nc]}" for t in ("q4_k", "q5_k", "q6_k")} <= mixed
    assert "glu" in mixed and not {n for n in mixed if n.startswith("moeg_glu_")}
    mine = {n for n in compiled.kernels if n == "moe_group" or n.startswith("moeg_")}
    assert mine and mine <= r.kernels


# ---------------------------------------------------------------- coverage
def family(name: str) -> str:
    """A kernel's name with its weight / KV type parts replaced: gemv_<t>_c1r1."""
    return re.sub(r"(?<=_)(f32|f16|bf16|q\d_[01k]|iq4_nl|iq4_xs)(?=_|$)", "<t>", name)


def test_every_compiled_kernel_is_launched_or_listed_as_never_launched(results, compiled):
    launched: set[str] = set()
    for s in all_scenarios():
        launched |= results(s).kernels
    listed = {k for k in compiled.kernels if any(re.fullmatch(p, k) for p in NEVER_LAUNCHED)}
    assert not launched - set(compiled.kernels)
    assert not launched & listed, sorted(launched & listed)
    assert sorted(set(compiled.kernels) - launched - listed) == []
    assert all(any(re.fullmatch(p, k) for k in compiled.kernels) for p in NEVER_LAUNCHED)
    fams = Counter(family(k) for k in compiled.kernels)
    hit = Counter(family(k) for k in launched)
    assert {f for f in fams if not hit[f]} == {family(k) for k in listed} - set(hit)
    print(f"\nCUDA kernels launched on the fake device: {len(launched)} of "
          f"{len(compiled.kernels)} compiled, {len(listed)} listed as never launched")
    for f in sorted(fams):
        print(f"  {f:28s} {hit[f]:3d} / {fams[f]:3d}")


# ---------------------------------------------------------------- negative controls
def _table(be, kernel: str, planes: int):
    """A stand-in embedding table: what CudaBackend.embed reads of one."""
    plane = be.zeros((1024,), "uint8")
    return SimpleNamespace(layout=SimpleNamespace(kernel=kernel), k=256,
                           args=lambda: [plane] * planes)


def test_a_misspelled_kernel_name_fails_naming_the_kernel(gpu):
    """Caught twice: by the backend's registry before the launch, and by the fake device (the
    compiled module has no such function) for a launch that bypasses the registry."""
    be = create_backend("cuda", graphs=False)
    out, ids = be.zeros((1, 256)), be.zeros((1,), "int32")
    with pytest.raises(KeyError, match=r"no kernel embed_q4_O in the registry"):
        be.embed(_table(be, "q4_O", 4), ids, 1.0, out)
    with pytest.raises(CUDADriverError, match=r"no kernel 'embed_q4_O' in cuda/elementwise\.cu"):
        _module(gpu, "elementwise.cu").get_function("embed_q4_O")


def test_an_extra_argument_fails_naming_the_kernel_and_its_signature(gpu, compiled):
    """Caught by the registry's signature through the backend, and by the compiled signature at
    the fake device for a launch that bypasses the registry."""
    be = create_backend("cuda", graphs=False)
    out, ids = be.zeros((1, 256)), be.zeros((1,), "int32")
    be.embed(_table(be, "q4_0", 4), ids, 1.0, out)                  # the right count passes
    with pytest.raises(TypeError, match=r"embed_q4_0: arguments \(.*\) do not match embed_q4_0\("):
        be.embed(_table(be, "q4_0", 5), ids, 1.0, out)
    fn = _module(gpu, "elementwise.cu").get_function("embed_q4_0")
    t = _table(be, "q4_0", 5)
    with pytest.raises(KernelCheckError) as e:
        fn((1,), (256,), (*t.args(), np.int32(t.k), ids, np.float32(1.0), out))
    msg = str(e.value)
    assert "kernel embed_q4_0 (cuda/elementwise.cu): 9 arguments for 8 parameters" in msg
    assert compiled.kernels["embed_q4_0"].describe() in msg


def _module(gpu, name: str):
    """The fake RawModule of one kernel source, as the backend loads it."""
    import cupy

    return cupy.RawModule(code=gpu.kernels.sources[name], options=gpu.kernels.options)


def _rms_norm(gpu):
    """The fake cupy, its rms_norm kernel, an array and a valid argument list for it."""
    import cupy

    x = cupy.zeros((2, 64), cupy.float32)
    i32, f32 = np.int32, np.float32
    args = [x, i32(1), i32(64), i32(0), i32(64), x[0], f32(1e-6), x, i32(64), i32(0)]
    return cupy, _module(gpu, "elementwise.cu").get_function("rms_norm"), x, args


def test_a_wrong_scalar_type_and_an_oversized_block_fail(gpu):
    cupy, fn, x, args = _rms_norm(gpu)
    fn((2,), (64,), tuple(args))
    with pytest.raises(KernelCheckError, match=r"argument 6 \(float64 1e-06\) on a \.f32"):
        fn((2,), (64,), tuple(args[:6] + [np.float64(1e-6)] + args[7:]))
    gemv = _module(gpu, "gemv.cu").get_function("gemv_f32_c1r1")
    i32 = np.int32
    gemv_args = (x, i32(64), i32(2), x, i32(64), i32(1), np.uint64(0), i32(0), i32(1), x,
                 i32(2), i32(0))
    gemv((1, 1), (32, 4), gemv_args)
    with pytest.raises(KernelCheckError, match=r"256 threads exceeds __launch_bounds__ 128"):
        gemv((1, 1), (32, 8), gemv_args)


def test_raw_module_options_or_sources_other_than_the_compile_checks_fail(gpu, compiled):
    import cupy

    code = compiled.sources["sampling.cu"]
    with pytest.raises(KernelCheckError, match="differ from the compile check's"):
        cupy.RawModule(code=code, options=(*compiled.options, "--use_fast_math"))
    with pytest.raises(KernelCheckError, match="none of the compile check's sources"):
        cupy.RawModule(code=code + "\n// edited", options=compiled.options)


def test_allocation_inside_a_captured_step_raises(gpu):
    be = create_backend("cuda")
    ids = be.zeros((1,), "int32")
    be.run_step((1, 1), (ids,), lambda: be.zeros((4,)))           # first use: eager
    with pytest.raises(CaptureError, match="allocating 16 bytes"):
        be.run_step((1, 1), (ids,), lambda: be.zeros((4,)))       # second: captured
    assert gpu.allocations[-1].during_capture and not gpu.capturing


def test_a_host_read_inside_a_captured_step_raises(gpu):
    be = create_backend("cuda")
    ids = be.zeros((1,), "int32")
    be.run_step((1, 1), (ids,), lambda: be.to_host(ids))
    with pytest.raises(CaptureError, match="ndarray.get"):
        be.run_step((1, 1), (ids,), lambda: be.to_host(ids))


def test_a_launch_on_another_stream_during_a_capture_raises(gpu):
    cupy, fn, _, args = _rms_norm(gpu)
    s = cupy.cuda.Stream(non_blocking=True)
    s.begin_capture()
    try:
        with pytest.raises(CaptureError, match="missing from the graph"):
            fn((2,), (64,), tuple(args))                     # on the null stream
    finally:
        s.end_capture()


def test_replaying_a_graph_whose_buffer_was_freed_raises(gpu):
    cupy, fn, x, args = _rms_norm(gpu)
    s = cupy.cuda.Stream(non_blocking=True)
    y = cupy.zeros((2, 64), cupy.float32)
    s.begin_capture()
    with s:
        fn((2,), (64,), tuple(args[:7] + [y] + args[8:]))
    graph = s.end_capture()
    graph.launch(stream=s)
    del y
    with pytest.raises(MemoryCheckError, match="freed since the capture"):
        graph.launch(stream=s)


def test_the_driver_path_reads_parameters_by_their_compiled_types(gpu):
    import ctypes

    from cuda.bindings import driver

    cupy, fn, x, args = _rms_norm(gpu)
    values = [ctypes.c_void_p(x.data.ptr), *(ctypes.c_int32(int(a)) for a in args[1:5]),
              ctypes.c_void_p(x.data.ptr), ctypes.c_float(1e-6), ctypes.c_void_p(x.data.ptr),
              ctypes.c_int32(64), ctypes.c_int32(0)]
    params = (ctypes.c_void_p * 10)(*(ctypes.addressof(v) for v in values))
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = 2, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 64, 1, 1
    s = cupy.cuda.Stream(non_blocking=True)
    cfg.hStream = driver.CUstream(s.ptr)
    (err,) = driver.cuLaunchKernelEx(cfg, driver.CUfunction(fn.kernel.ptr),
                                     ctypes.addressof(params), 0)
    assert err == driver.CUresult.CUDA_SUCCESS
    assert [str(a) for a in gpu.launches[-1].args][5:8] == [
        f"ptr {x.data.ptr:#x}", "float32 9.999999974752427e-07", f"ptr {x.data.ptr:#x}"]
    host = np.zeros(128, np.float32)
    values[7] = ctypes.c_void_p(host.ctypes.data)                   # a host pointer
    params[7] = ctypes.addressof(values[7])
    with pytest.raises(MemoryCheckError, match=r"parameter 7 \(.u64\).*no live device"):
        driver.cuLaunchKernelEx(cfg, driver.CUfunction(fn.kernel.ptr),
                                ctypes.addressof(params), 0)


def test_sampling_controls_run_on_the_fake_device(compiled):
    """Penalties, logit_bias and min_tokens (the adjustment list: one more pinned upload of
    8 bytes per pair, only on steps that carry pairs) and prompt log-probabilities (every
    prefill row a logits row) through the engine, graphs captured and replayed."""
    with cuda_steps.fake_device_engine(compiled, n_ctx=256, prefill_chunk=64) as (dev, eng):
        def copies(sampling, **kw):
            before = len(dev.copies)
            req = GenerationRequest("t", tuple(range(1, 50)), sampling,
                                    StoppingCriteria(max_new_tokens=6, ignore_eos=True,
                                                     min_tokens=kw.pop("min_tokens", 0)),
                                    **kw)
            events = list(eng.generate(req, timeout=120))
            assert isinstance(events[-1], Finished) and events[-1].error is None
            return events, dev.copies[before:]

        _, plain = copies(SamplingParams(temperature=0.0))
        _, penalised = copies(SamplingParams(temperature=0.0, frequency_penalty=0.5,
                                             presence_penalty=0.5))
        _, biased = copies(SamplingParams(temperature=0.7, seed=1,
                                          logit_bias=((3, -100.0), (5, 2.0))), min_tokens=3)
        events, _ = copies(SamplingParams(temperature=0.0), prompt_logprobs=2)
    # the adjustment list of 2 pairs (no end-of-generation ids in this vocabulary): 16 bytes
    adj = [[c for c in cs if c.direction == "h2d" and c.nbytes == 16]
           for cs in (plain, penalised, biased)]
    assert adj[0] == [] and adj[1] == []           # penalties read the history: no upload
    assert 1 <= len(adj[2]) <= 6 and all(c.pinned for c in adj[2])   # one per step
    assert len(events[0].prompt_logprobs) == 48
    assert dev.graphs and all(g.replays for g in dev.graphs)


def test_laguna_layers_launch_their_own_heads_window_rope_and_gate_views(gpu):
    """tiny-laguna-q8's prompt chunk: each layer's rope_kv, attention and softplus_gate launch
    carry that layer's query head count, window, RoPE table (YaRN over part of the head on the
    full-attention layers), the attention scale, and q, k, v and the per-head gate as views of
    the layer's own q|k|v|g row (pointers and strides); the KV cache's heads are the file's."""
    from service.model.spec import ModelSpec
    from tests.support.models import build_model, forward_host, open_gguf

    path = TINY / "tiny-laguna-q8.gguf"
    spec = ModelSpec.from_gguf(open_gguf(path))
    tr = build_model(path, create_backend("cuda", graphs=False), n_ctx=64, max_tokens=32)
    be, log = tr.backend, []
    run = be._launch

    def record(name, grid, block, args, **kw):
        if name.startswith(("rope_kv_", "attn_", "softplus_gate")):
            log.append((name, grid, args))
        run(name, grid, block, args, **kw)

    be._launch = record
    T = 24
    forward_host(tr, list(range(5, 5 + T)), 0, T)
    assert len(log) == 3 * spec.n_layer
    hd, hkv, f4 = spec.head_dim, spec.n_head_kv, 4
    seen_tables = set()
    for i, lay in enumerate(spec.layers):
        (rk, rk_grid, ra), (at, at_grid, aa), (sg, _, ga) = log[3 * i: 3 * i + 3]
        assert (rk[:8], at[:9], sg) == ("rope_kv_", "attn_f16_", "softplus_gate"), log[3 * i]
        H, Q, K = lay.n_head, lay.n_head * hd, hkv * hd
        width = Q + 2 * K + H * lay.attn_gate            # the layer's q|k|v|g row
        q, k, v = ra[0], ra[3], ra[6]
        assert [int(a) for a in (ra[1], ra[2], ra[4], ra[5], ra[7], ra[8])] == \
            [width, hd, width, hd, width, hd], i
        assert (k.data.ptr - q.data.ptr, v.data.ptr - q.data.ptr) == (f4 * Q, f4 * (Q + K)), i
        assert [int(a) for a in ra[9:13]] == [H, hkv, hd, spec.head_dim_v], i
        assert rk_grid == (T, H + 2 * hkv), i
        cos = ra[19]
        assert int(ra[21]) == lay.rope_dims // 2 == cos.shape[1], i
        assert cos is tr.rope_tables[i][0], i
        seen_tables.add(cos.data.ptr)
        # attention: the same q view, this layer's heads, window and the model's scale
        assert aa[0] is q and [int(a) for a in (aa[1], aa[2], aa[3], aa[4])] == \
            [width, hd, H, hkv], i
        assert at_grid[1:] == (H, T), i
        assert int(aa[18]) == lay.window and float(aa[19]) == pytest.approx(spec.attn_scale), i
        out = aa[24]
        assert (out.shape, int(aa[25]), int(aa[26])) == ((T, H, spec.head_dim_v),
                                                        H * spec.head_dim_v,
                                                        spec.head_dim_v), i
        # the gate: a (T, H, Dv) *= softplus(g), g the row's last H * G columns
        a, g = ga[0], ga[4]
        assert a.data.ptr == out.data.ptr and int(ga[2]) == H * spec.head_dim_v, i
        assert g.shape == (T, H, lay.attn_gate) and int(ga[5]) == width, i
        assert g.data.ptr - q.data.ptr == f4 * (Q + 2 * K) and int(ga[6]) == lay.attn_gate, i
    # two RoPE tables: YaRN on the full-attention layers, plain on the sliding-window ones
    assert len(seen_tables) == len({(la.rope_dims, la.rope_base, la.rope_scaling)
                                    for la in spec.layers}) == 2


def test_the_sample_op_takes_a_token_mask_list(gpu):
    """sample_rows gets the mask list and its row width (0 without one: no record reads it);
    a list of the wrong width is refused before the launch."""
    from service.backends.step_format import N_PARAMS, OUT_WORDS, mask_words
    be = create_backend("cuda", graphs=False)
    V, L = 100, 2
    be.prepare_sampling(L, V)
    logits, params = be.zeros((L, V)), be.zeros((L, N_PARAMS), "int32")
    hist, adj, out = be.zeros((1, 8), "int32"), be.zeros((1, 2), "int32"), \
        be.zeros((L, OUT_WORDS), "int32")
    masks = be.zeros((L, mask_words(V)), "int32")
    be.sample(logits, params, hist, adj, out)
    be.sample(logits, params, hist, adj, out, masks)
    launches = [x for x in gpu.launches if x.kernel == "sample_rows"]
    assert [int(x.args[8].value) for x in launches] == [0, mask_words(V)]
    assert launches[1].args[7].shape == (L, mask_words(V))
    with pytest.raises(ValueError, match="sample masks"):
        be.sample(logits, params, hist, adj, out, be.zeros((L, 3), "int32"))


def test_kernels_warm_compiles_every_source_as_the_launcher_does(gpu, capsys):
    """`specstream kernels warm` compiles each CUDA source once, with the code and options the
    launcher loads it with (the fake RawModule refuses any other code or options, so CuPy's
    cache key is the launcher's); an unknown source is refused by name."""
    from service.backends.cuda import sources
    from service.backends.cuda.warm import compile_sources
    from service.cli import main

    assert main(["kernels", "warm", "--processes", "1"]) == 0
    assert gpu.compiled == list(sources.SOURCES)
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [*sources.SOURCES, "all"]
    with pytest.raises(ValueError, match="not CUDA sources of the backend: \\['nope.cu'\\]"):
        compile_sources(["nope.cu"], processes=1)


def test_the_norm_before_a_gemv_splits_its_rows_over_blocks(gpu):
    """rms_norm_quant gets (T, S) blocks: S = norm_slices, at most one per register pass of
    the row and none past 1024 blocks in all; norm_slices below 1 is refused."""
    from service.backends.cuda.norm import NORM_SLICES
    from tests.support.blocks import random_tensor_info
    be = create_backend("cuda", graphs=False)
    be.load_matrix([random_tensor_info("Q8_0", 32, 4096, seed=1)])
    be.prepare(max_tokens=512, n_head=4, head_dim_v=64, n_ctx=600, n_embd=4096)
    grids = {}
    for T, D, slices in ((1, 4096, NORM_SLICES), (1, 4096, 64), (3, 576, 8), (1, 256, 8),
                         (256, 4096, 8), (2048 // 4, 4096, 8), (1, 4096, 1)):
        be.norm_slices = slices
        n = len(gpu.launches)
        be.rms_norm_for_matmul(be.zeros((T, D)), be.zeros((D,)), 1e-6, be.zeros((T, D)))
        (x,) = [x for x in gpu.launches[n:] if x.kernel == "rms_norm_quant"]
        grids[T, D, slices] = x.grid[:2]
    assert grids == {(1, 4096, NORM_SLICES): (1, min(NORM_SLICES, 16)), (1, 4096, 64): (1, 16),
                     (3, 576, 8): (3, 3), (1, 256, 8): (1, 1), (256, 4096, 8): (256, 4),
                     (512, 4096, 8): (512, 2), (1, 4096, 1): (1, 1)}
    with pytest.raises(ValueError, match="norm_slices"):
        create_backend("cuda", graphs=False, norm_slices=0)
