"""Does llama.cpp load and run an EAGLE-3 head file (e.g. one `specstream train-drafter` wrote)
as our reference forward does? One prompt, llama.cpp's own target run and draft chain (the
`probe` of bench/llamacpp_eagle3_oracle.py: the three layers' inputs extracted, the encoder, the
prefill pairs (token[P + 1], g[P]), then a chain fed its own drafts and pre-norm outputs), and
service/model/eagle3_forward.py on llama.cpp's features the same way. Prints per chain row both
drafts and the relative RMS difference of the logits over the draft vocabulary.

    .venv/bin/python bench/llamacpp_eagle3_check.py HEAD.gguf smollm2-135m \\
        --llama-python /tmp/llenv/bin/python --prompt "def fibonacci(n):"
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ORACLE = Path(__file__).resolve().parent / "llamacpp_eagle3_oracle.py"


def unpack(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["f32"]), np.float32).reshape(d["shape"])


def llama_side(py: str, target: Path, head: Path, ids: list[int], depth: int) -> dict:
    code = (f"import sys, json; sys.path.insert(0, {str(ORACLE.parent)!r}); "
            "import llamacpp_eagle3_oracle as o; "
            f"r = o.probe({str(target)!r}, {str(head)!r}, {ids!r}, {depth}); "
            "r['logits'] = r['logits'].tolist(); print(json.dumps(r))")
    p = subprocess.run([py, "-c", code], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head")
    ap.add_argument("target", help="a .gguf path or a known model name")
    ap.add_argument("--llama-python", required=True, help="an interpreter with llama_cpp")
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--depth", type=int, default=6)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from service.config import models_dir_from_env
    from service.gguf.fetch import resolve_model
    from service.gguf.reader import GGUFFile
    from service.model.eagle3 import Eagle3Spec
    from service.model.eagle3_forward import Eagle3Draft
    from service.model.tokenizer import Tokenizer

    target, head = resolve_model(a.target, models_dir_from_env()), Path(a.head)
    tf, hf = GGUFFile(target), GGUFFile(head)
    ids = Tokenizer.from_metadata(tf.metadata).encode(a.prompt, parse_special=True)
    res = llama_side(a.llama_python, target, head, ids, a.depth)
    spec = Eagle3Spec.from_gguf(hf)
    cols = hf.index_tensor("d2t") if spec.has_d2t else np.arange(spec.vocab_size)
    feats, T = unpack(res["features"]), len(ids)                       # (T, 3 Et)
    ref = Eagle3Draft(spec, hf, tf, T + a.depth)
    g = ref.encode(feats)                                               # (T, E)
    g_err = float(np.sqrt(((g - unpack(res["g"])) ** 2).mean() / (g ** 2).mean()))
    ref.decode(ids[1:], g[:T - 1], 0)
    tok, state = res["t0"], g[T - 1:T]
    print(f"llama_cpp {res['version']}, layers {res['layers']}, prompt {T} tokens, t0 {tok}, "
          f"encoder relative RMS difference {g_err:.2e}")
    print(f"{'row':>4} {'llama.cpp':>10} {'reference':>10} {'logits rel. RMS':>16}")
    for k, row in enumerate(np.array(res["logits"], np.float64)[:, cols]):   # (Vd,)
        logits, state = ref.decode([tok], state, T - 1 + k)
        ours = logits[0, cols].astype(np.float64)
        err = np.sqrt(((ours - row) ** 2).mean() / (row ** 2).mean())
        mine = int(cols[ours.argmax()])
        print(f"{k:>4} {res['draft_ids'][k]:>10} {mine:>10} {err:>16.2e}")
        tok = res["draft_ids"][k]              # both chains read llama.cpp's drafts
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
