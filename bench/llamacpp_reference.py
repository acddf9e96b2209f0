"""Produce llama.cpp reference outputs for prompts of our choosing (a development tool).

Needs the `llama_cpp` package (llama-cpp-python; it builds llama.cpp from source, which takes
several minutes on 2 cores, so it is not a test dependency). Writes the same format as the
fixtures in tests/data: prompt ids, greedy ids, text and the top-8 logits at every position.

    python bench/llamacpp_reference.py models/smollm2-135m.gguf out.json "prompt one" "prompt two"
"""

from __future__ import annotations

import json
import sys

import numpy as np


def reference(model_path: str, prompts: list[str], n_gen: int = 48) -> dict:
    from llama_cpp import Llama, __version__

    llm = Llama(model_path=model_path, n_ctx=512, n_threads=2, logits_all=True, verbose=False,
                seed=0)
    eog = _eog(llm)
    cases = []
    for prompt in prompts:
        ids = llm.tokenize(prompt.encode(), add_bos=llm.metadata.get(
            "tokenizer.ggml.add_bos_token", "false") == "true", special=True)
        llm.reset()
        llm.eval(ids)
        greedy, top8 = [], []
        for _ in range(n_gen):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            order = np.argsort(-logits, kind="stable")[:8]
            top8.append({"ids": [int(i) for i in order],
                         "logits": [round(float(logits[i]), 4) for i in order]})
            tok = int(order[0])
            greedy.append(tok)
            if tok in eog:
                break
            llm.eval([tok])
        text = llm.detokenize(greedy).decode("utf-8", errors="replace")
        cases.append({"prompt": prompt, "prompt_ids": list(ids), "greedy_ids": greedy,
                      "greedy_text": text, "top8": top8})
    return {"provenance": f"llama.cpp via llama-cpp-python {__version__}, CPU build, 2 threads",
            "model": model_path.rsplit("/", 1)[-1], "n_gen": n_gen, "cases": cases}


def _eog(llm) -> set[int]:
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}


if __name__ == "__main__":
    model, out, *prompts = sys.argv[1:]
    with open(out, "w") as fh:
        json.dump(reference(model, prompts), fh, ensure_ascii=False)
