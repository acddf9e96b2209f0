"""Real model steps through the CUDA backend on the fake device (fake_cupy.install).

A `Scenario` names a model file, a KV (K, V) type pair, CudaBackend options and a script; `run`
builds the backend with `create_backend("cuda", ...)`, loads the model into a Transformer and a
ModelRunner exactly as the engine does, runs the script and returns the FakeDevice's log with a
`Mark` per step (which launches and graphs it made). Kernels do not run, so every id and
probability is garbage (zeros); the scripts drive steps by shape, not by what they produce.

Models: the tiny files in tests/data/tiny (llama with every weight type, qwen3, qwen3moe),
synthetic files of every quant mix (service/tools/synth.py, one layer), and two written here:
qwen2 (q/k/v biases) and gemma3 (head size 256, sliding window, post-norms, GELU, tied output).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from service import formats
from service.backends import create_backend
from service.backends.step_format import N_PARAMS, OUT_WORDS, param_record
from service.engine.engine import Engine
from service.engine.runner import GREEDY, ModelRunner, RowSampling, StepInput
from service.engine.types import Finished, GenerationRequest, SamplingParams, StoppingCriteria
from service.gguf.reader import GGUFFile
from service.model.hidden import HiddenRows, HiddenTap
from service.model.spec import ModelSpec
from service.model.transformer import Transformer, positions_for
from service.tools import synth
from tests.support.engines import running_engine
from tests.support.fake_cupy import install
from tests.support.fake_gpu import FakeDevice
from tests.support.kernel_signatures import CompiledKernels
from tests.support.models import TINY

N_CTX, N_SLOTS, MAX_TOKENS, MAX_LOGITS = 256, 2, 128, 16
KV_TYPES = tuple(str(t) for t in formats.KV_TYPES)     # every type, each backend has all
SAMPLED = RowSampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                      repetition_penalty=1.1, repeat_last_n=16, seed=7, n_top=3)
GREEDY_TOP = RowSampling(n_top=2)


@dataclass(frozen=True)
class Scenario:
    model: str
    kv: tuple[str, str] = ("f16", "f16")
    options: tuple[tuple[str, Any], ...] = ()      # CudaBackend keyword arguments
    script: str = "full"
    driver: bool = True                            # cuda-bindings importable (PDL possible)

    @property
    def name(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return (f"{self.script}:{self.model}:{self.kv[0]}/{self.kv[1]}"
                + (f":{opts}" if opts else "") + ("" if self.driver else ":no-driver"))


@dataclass(frozen=True)
class Mark:
    label: str
    rep: int                      # how many steps of this label ran before
    launches: tuple[int, int]     # [start, end) into FakeDevice.launches
    graphs: tuple[int, int]       # [start, end) into FakeDevice.graphs
    copies: tuple[int, int]
    syncs: tuple[int, int]
    gemms: tuple[int, int]
    logits: int = 0               # logits rows of a runner step


@dataclass
class Result:
    scenario: Scenario
    dev: FakeDevice
    marks: list[Mark] = field(default_factory=list)

    @property
    def kernels(self) -> set[str]:
        return {x.kernel for x in self.dev.launches}


# ---------------------------------------------------------------- model files
def model_files(tmp: Path) -> dict[str, Path]:
    out = {"llama-mixq": TINY / "tiny-llama-mixq.gguf", "qwen3": TINY / "tiny-qwen3.gguf",
           "qwen3moe": TINY / "tiny-qwen3moe.gguf", "laguna": TINY / "tiny-laguna-q8.gguf",
           "qwen2": _write(tmp / "qwen2.gguf", "qwen2", hd=64, dtype=np.float32),
           "gemma3": _write(tmp / "gemma3.gguf", "gemma3", hd=256, dtype=np.float16)}
    for mix in synth.MIXES:
        out[f"synth-{mix}"] = synth.synthesize(tmp / f"synth-{mix}.gguf", "tiny", mix, seed=1,
                                               n_layer=1, threads=1).path
    return out


def _write(path: Path, arch: str, hd: int, dtype, E: int = 256, H: int = 2, Hkv: int = 1,
           F: int = 512, V: int = 512, L: int = 2) -> Path:
    """A small random model of `arch` (2-D weights in `dtype`, norms and biases f32)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"context_length": 1024, "embedding_length": E, "block_count": L,
                       "feed_forward_length": F, "attention.head_count": H,
                       "attention.head_count_kv": Hkv, "attention.key_length": hd,
                       "attention.value_length": hd, "vocab_size": V,
                       "attention.sliding_window": 16}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    if arch != "gemma3":
        shapes["output.weight"] = (V, E)
    for i in range(L):
        p = f"blk.{i}."
        shapes |= {p + "attn_norm.weight": (E,), p + "attn_q.weight": (H * hd, E),
                   p + "attn_k.weight": (Hkv * hd, E), p + "attn_v.weight": (Hkv * hd, E),
                   p + "attn_output.weight": (E, H * hd), p + "ffn_norm.weight": (E,),
                   p + "ffn_gate.weight": (F, E), p + "ffn_up.weight": (F, E),
                   p + "ffn_down.weight": (E, F)}
        if arch == "qwen2":
            shapes |= {p + "attn_q.bias": (H * hd,), p + "attn_k.bias": (Hkv * hd,),
                       p + "attn_v.bias": (Hkv * hd,)}
        if arch == "gemma3":
            shapes |= {p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,),
                       p + "post_attention_norm.weight": (E,), p + "post_ffw_norm.weight": (E,)}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32) * 0.05
        w.add_tensor(name, x.astype(dtype) if len(shape) == 2 else x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------- the driver
class Driver:
    def __init__(self, tr: Transformer, runner: ModelRunner, dev: FakeDevice):
        self.tr, self.runner, self.dev, self.be = tr, runner, dev, tr.backend
        self.marks: list[Mark] = []
        self._reps: dict[str, int] = {}

    def _marked(self, label: str, fn: Callable[[], Any], logits: int = 0) -> Any:
        logs = (self.dev.launches, self.dev.graphs, self.dev.copies, self.dev.syncs,
                self.dev.gemms)
        at = [len(x) for x in logs]
        out = fn()
        rep = self._reps.get(label, 0)
        self._reps[label] = rep + 1
        self.marks.append(Mark(label, rep, *((a, len(x)) for a, x in zip(at, logs, strict=True)),
                               logits=logits))
        return out

    def step(self, label: str, ids, positions, slots, rows: list[RowSampling], **tree):
        n, L = len(ids), len(rows)
        inp = StepInput(list(ids), list(positions), list(slots), list(range(n - L, n)), rows,
                        **tree)
        return self._marked(label, lambda: self.runner.step(inp), L)

    def overlapped(self, label: str, ids, positions, slots) -> list:
        """Two plain steps the overlapped loop's way (runner.submit): the second submitted
        before the first is collected, its ids fed from the first's choices on the device."""
        n = len(ids)

        def run():
            first = self.runner.submit(StepInput(list(ids), list(positions), list(slots),
                                                 range(n), [GREEDY] * n))
            nxt = self.runner.submit(StepInput([0] * n, [p + 1 for p in positions],
                                               list(slots), range(n), [GREEDY] * n),
                                     list(range(n)))
            return [self.runner.collect(first), self.runner.collect(nxt)]

        return self._marked(label, run, n)

    def repeat(self, times: int, label: str, *args, **kw) -> None:
        """`times` equal steps: eager, captured, then replayed (graphs on)."""
        for _ in range(times):
            self.step(label, *args, **kw)

    def forward(self, label: str, T: int, start: int = 0, slot: int = 0) -> None:
        """A step straight through Transformer.forward without the tree rows (the model
        drafter's prefill and the benchmarks do this): a prefill-length one runs the
        query-tiled attention."""
        be = self.be
        dev = [be.zeros((T,), "int32") for _ in range(3)]                 # ids, pos, slots
        be.upload_ints(np.arange(T, dtype=np.int32) % 7, dev[0])
        be.upload_ints(positions_for(start, T), dev[1])
        be.upload_ints(np.full(T, slot, np.int32), dev[2])
        self._marked(label, lambda: be.to_host(
            self.tr.forward(dev[0], dev[1], dev[2], start + T, 1)))

    def chain(self, label: str, n: int, start: int, slot: int = 0) -> None:
        """A draft chain (Transformer.forward_chain): n one-token forwards in one backend
        step, each choosing the next one's input on the device (sample, chosen_ids)."""
        be, hist = self.be, self.runner.hist
        ids, pos, slots = (be.zeros((n,), "int32") for _ in range(3))
        params = be.zeros((N_PARAMS,), "int32")
        out = be.zeros((n, OUT_WORDS), "int32")
        adj = be.zeros((1, 2), "int32")
        be.upload_ints(positions_for(start, n), pos)
        be.upload_ints(np.full(n, slot, np.int32), slots)
        be.upload_ints(np.array(param_record(
            temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0, repeat_last_n=0,
            seed=0, token_index=0, n_top=-1, slot=slot, position=start), np.int32), params)

        def choose(i: int, logits) -> None:
            be.sample(logits, params.reshape(1, N_PARAMS), hist, adj, out[i:i + 1])
            if i + 1 < n:
                be.chosen_ids(out[i:i + 1], ids[i + 1:i + 2])

        for _ in range(3):
            self._marked(label, lambda: (self.tr.forward_chain(
                ids, pos, slots, range(start + 1, start + n + 1), choose),
                be.synchronize()))


# ---------------------------------------------------------------- scripts
def full(d: Driver) -> None:
    """A block table and a token history written, prefill (captured at 64 rows, eager at 128),
    sampled decode, a two-sequence batch, verify steps of 4, 5, 12 and 16 rows, tree verify rows
    with a KV move, a draft chain and a prefill through Transformer.forward; each step shape
    three times (eager, capture, replay)."""
    c = d.tr.cache
    table = np.arange(c.n_slots * c.max_blocks, dtype=np.int32).reshape(c.n_slots, -1)
    d._marked("block-table", lambda: d.runner.set_block_table(table[::-1].copy()))
    d._marked("history", lambda: d.runner.write_history(1, list(range(30))))
    d.repeat(3, "prefill-40", range(40), range(40), [0] * 40, [SAMPLED])
    d.step("prefill-100", range(100), range(100), [1] * 100, [GREEDY])
    for i in range(3):
        d.step("decode", [5], [40], [0], [RowSampling(**{**SAMPLED.__dict__,
                                                          "token_index": i})])
    d.repeat(3, "batch-2", [5, 6], [40, 100], [0, 1], [GREEDY_TOP, SAMPLED])
    d.repeat(3, "verify-4", [1, 2, 3, 4], range(41, 45), [0] * 4, [GREEDY_TOP] * 4)
    d.repeat(3, "verify-5", range(5), range(41, 46), [0] * 5, [GREEDY] * 5)
    d.repeat(3, "verify-12", range(12), range(41, 53), [0] * 12, [GREEDY_TOP] * 12)
    d.repeat(3, "verify-16", range(16), range(41, 57), [0] * 16, [GREEDY] * 16)   # widest
    d.repeat(3, "tree-4", [1, 2, 3, 4], [41, 42, 42, 43], [0] * 4, [GREEDY] * 4,
             kv_positions=[41, 42, 43, 44], attn_lo=[41] * 4, attn_mask=[0, 1, 1, 5])
    d._marked("move-kv", lambda: d.runner.move_kv([0, 0], [43, 44], [42, 43]))
    d.chain("chain-3", 3, 60)
    d.forward("forward-32", 32, start=64)


def widths(d: Driver) -> None:
    """One step of each padded width: the GEMV variants of 1..16 columns, then the GEMM."""
    for n in (1, 2, 4, 8, 16, 32):
        d.step(f"width-{n}", range(n), range(n), [0] * n, [GREEDY])


# the tensor-core GEMV's tile edges (types.gemv_mma_nc): each side of 8, 16, 32 and 64 rows
MMA_WIDTHS = (1, 7, 8, 9, 16, 17, 31, 32, 33, 63, 64)


def mma(d: Driver) -> None:
    """One step of each width around the tensor-core GEMV's tile edges (run with gemv_mma and
    invariant_tokens=64: no step takes the GEMM)."""
    for n in MMA_WIDTHS:
        d.step(f"mma-{n}", range(n), range(n), [0] * n, [GREEDY])


def decode(d: Driver) -> None:
    d.step("prefill-8", range(8), range(8), [0] * 8, [GREEDY])
    d.repeat(3, "decode", [3], [8], [0], [GREEDY])
    for i in range(3):
        d.overlapped("overlapped", [3, 4], [9 + 2 * i, 9 + 2 * i], [0, 1])


def kv(d: Driver) -> None:
    """The KV pair's three kernels: RoPE + KV store, split attention (runner steps), the
    query-tiled attention (a 32-row forward)."""
    d.forward("forward-32", 32)
    d.step("prefill-20", range(20), range(32, 52), [0] * 20, [GREEDY])
    d.step("decode", [3], [52], [0], [GREEDY])


def ops(d: Driver) -> None:
    """Backend ops of the interface that the transformer reaches only through fused ops:
    argmax, rope, kv_write (every KV type), rms_norm."""
    be, tr = d.be, d.tr
    logits, ids = tr.ws_logits[:4], be.zeros((4,), "int32")
    x = be.zeros((4, 2, 64))                                     # (T, H, D) f32
    w = be.upload_vector(np.ones(64, np.float32))                # (D,) f32
    pos, slots = be.zeros((4,), "int32"), be.zeros((4,), "int32")
    d._marked("argmax", lambda: be.argmax(logits, ids))
    d._marked("rope", lambda: be.rope(x, pos, tr.rope_tables[0], True))
    d._marked("rms_norm", lambda: be.rms_norm(x, w, 1e-6, x))
    for t in KV_TYPES:
        cache = be.new_kv_cache(1, 1, 64, 2, 64, 64, t, t)
        d._marked(f"kv_write-{t}", lambda c=cache: be.kv_write(c, 0, x, x, slots, pos))
    be.synchronize()


def hidden(d: Driver) -> None:
    """A runner with a hidden-state tap (points 0, 1 and n_layer; every row): a prefill, then
    verify steps of 4 rows with the tap and without it and decode steps with it (three each:
    eager, capture, replay), then one step of a logits-rows tap."""
    n = d.tr.spec.n_layer
    tap = HiddenTap(tuple(sorted({0, 1, n})))
    d.runner = ModelRunner(d.tr, N_SLOTS, N_CTX, hidden=tap)
    d.step("tap-prefill-40", range(40), range(40), [0] * 40, [GREEDY], hidden=True)
    for _ in range(3):
        d.step("tap-verify-4", [1, 2, 3, 4], range(41, 45), [0] * 4, [GREEDY] * 4, hidden=True)
        d.step("verify-4", [1, 2, 3, 4], range(41, 45), [0] * 4, [GREEDY] * 4)
    for i in range(3):
        d.step("tap-decode", [5], [45 + i], [0], [GREEDY], hidden=True)
    d.runner = ModelRunner(d.tr, N_SLOTS, N_CTX, hidden=HiddenTap(tap.points, HiddenRows.LOGITS))
    d.step("tap-logits-5", range(5), range(41, 46), [0] * 5, [GREEDY] * 2, hidden=True)


def eagle3(d: Driver) -> None:
    """An EAGLE-3 drafter for the model (service/model/eagle3_model.py; Q8_0, with a reduced
    vocabulary and the pre-fc norm) on the same backend: encode 12 tapped rows, decode them as
    one 12-row step, then one 1-row step."""
    import tempfile

    from service.model.eagle3 import Eagle3Spec
    from service.model.eagle3_model import Eagle3Model
    from service.tools.synth_eagle3 import synthesize_eagle3

    be, n = d.be, d.tr.spec.n_layer
    with tempfile.TemporaryDirectory() as tmp:
        path = synthesize_eagle3(Path(tmp) / "e3.gguf", d.tr.f_path, layers=(0, 1, n),
                                 draft_vocab=300, norm_before_fc=True, quant="Q8_0").path
        f = GGUFFile(path)
        spec = Eagle3Spec.from_gguf(f)
        m = Eagle3Model(spec, f, d.tr, n_ctx=N_CTX, n_slots=N_SLOTS, max_tokens=MAX_TOKENS)
    feats = be.zeros((12, 3 * spec.n_embd_target))                       # (12, 3Et) f32
    g = be.zeros((12, spec.n_embd))                                      # (12, E) f32
    ids, pos, slots = (be.zeros((12,), "int32") for _ in range(3))
    be.upload_ints(np.arange(12, dtype=np.int32), ids)
    be.upload_ints(positions_for(0, 12), pos)
    d._marked("eagle3-encode", lambda: m.encode(feats, g))
    d._marked("eagle3-decode-12", lambda: m.decode(ids, pos, slots, 12, g, 12))
    d._marked("eagle3-decode-1", lambda: (m.decode(ids[:1], pos[:1], slots[:1], 13, g[:1], 1),
                                          be.synchronize()))


def moe(d: Driver) -> None:
    """The MoE op straight on the backend, 16 tokens, with experts of the model's shapes in
    every weight type (gate, up and down of one type: the grouped GLU kernel), grouped at every
    tile width (labels moe-<type>-c<NC>) and gathered (moe-<type>-gathered), then gate, up and
    down of three types (moe-mixed: the grouped GEMVs with the GLU apart)."""
    from service.backends.cuda.types import MOEG_NC
    from service.gguf.reader import TensorInfo
    from tests.support.blocks import ALL_TYPES, qtype, random_tensor

    be, m, E, T = d.be, d.tr.spec.moe, d.tr.spec.n_embd, 16
    F, n_exp, k = m.n_ff_expert, m.n_expert, m.n_expert_used
    rng = np.random.default_rng(0)
    router = be.load_matrix([TensorInfo("moe.router", qtype("F32"), (n_exp, E),
                                        random_tensor("F32", n_exp, E, rng))])
    x, out = be.zeros((T, E)), be.zeros((T, E))                          # (T, E) f32

    def experts(types: tuple[str, str, str]) -> list:
        shapes = ((n_exp, F, E), (n_exp, F, E), (n_exp, E, F))
        return [be.load_experts(TensorInfo(f"moe.{t}.{i}", qtype(t), sh,
                                           random_tensor(t, sh[0] * sh[1], sh[2], rng)))
                for i, (t, sh) in enumerate(zip(types, shapes, strict=True))]

    def run(label: str, mats: list, nc: int | None, grouped: bool = True) -> None:
        be._moe.group_nc, be.moe_group_min_tokens = nc, (2 if grouped else None)
        d._marked(label, lambda: be.moe(x, router, *mats, k, True, "silu", out))

    for t in ALL_TYPES:
        mats = experts((t, t, t))
        for nc in MOEG_NC:
            run(f"moe-{t.lower()}-c{nc}", mats, nc)
        run(f"moe-{t.lower()}-gathered", mats, None, grouped=False)
    run("moe-mixed", experts(("Q4_K", "Q5_K", "Q6_K")), None)
    be._moe.group_nc, be.moe_group_min_tokens = None, 2
    be.synchronize()


SCRIPTS: dict[str, Callable[[Driver], None]] = {
    "full": full, "widths": widths, "mma": mma, "decode": decode, "kv": kv, "ops": ops,
    "hidden": hidden, "eagle3": eagle3, "moe": moe}


def run(s: Scenario, kernels: CompiledKernels, files: dict[str, Path]) -> Result:
    """Load s.model on a CUDA backend over a fresh fake device and run s.script."""
    with install(kernels, driver=s.driver) as dev:
        be = create_backend("cuda", **dict(s.options))
        f = GGUFFile(files[s.model])
        tr = Transformer(ModelSpec.from_gguf(f), f, be, n_ctx=N_CTX, n_slots=N_SLOTS,
                         max_tokens=MAX_TOKENS, max_logits=MAX_LOGITS, type_k=s.kv[0],
                         type_v=s.kv[1])
        tr.f_path = files[s.model]        # (the eagle3 script's synth reads the target file)
        d = Driver(tr, ModelRunner(tr, N_SLOTS, N_CTX), dev)
        SCRIPTS[s.script](d)
        return Result(s, dev, d.marks)


# ---------------------------------------------------------------- the engine on the fake device
@contextmanager
def fake_device_engine(kernels: CompiledKernels, **options) -> Iterator[tuple[FakeDevice, Engine]]:
    """tiny-qwen3 in an Engine on the CUDA backend over a fresh fake device, two slots, started;
    options: running_engine's keywords and config overrides. On exit the engine is stopped,
    then the device taken away."""
    with install(kernels) as dev, running_engine(
            TINY / "tiny-qwen3.gguf", **{"backend": "cuda", "n_slots": 2, **options}) as eng:
        yield dev, eng


def speculate_greedily(eng: Engine, max_new_tokens: int) -> Finished:
    """A 299-token prompt decoded greedily with speculation on `eng`, max_new_tokens past any
    end token: its Finished event, which must carry no error."""
    req = GenerationRequest("t", tuple(range(1, 300)), SamplingParams(temperature=0.0),
                            StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
                            speculative=True)
    fin = list(eng.generate(req, timeout=120))[-1]
    assert isinstance(fin, Finished) and fin.error is None, fin
    return fin
