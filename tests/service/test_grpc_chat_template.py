"""Chat input over a real socket: the ids are llama.cpp's for the same prompt text (SmolLM2's own
template), and a model without a chat template refuses chat input until one is configured."""

from __future__ import annotations

from tests.conftest import load_json
from tests.engine.test_engine import assert_matches_llamacpp

SYSTEM_CASE = next(c for c in load_json("llamacpp_smollm2_greedy_extra.json")["cases"]
                   if c["prompt"].startswith("<|im_start|>system\n"))
SYSTEM_CHAT = [("system", "You are a helpful assistant."), ("user", "Name three primary colors.")]


def test_smollm2_chat_ids_and_answer_are_llamacpps(client, engine):
    # SYSTEM_CHAT in SmolLM2's template is the fixture's prompt text
    assert engine.tokenizer.decode(SYSTEM_CASE["prompt_ids"]) == SYSTEM_CASE["prompt"]
    ids = list(client.tokenize(chat=SYSTEM_CHAT).ids)
    assert ids == SYSTEM_CASE["prompt_ids"]
    # no system message: the template writes its own, and the prompt still opens with BOS
    hi = list(client.tokenize(chat=[("user", "hi")]).ids)
    assert hi[:2] == [engine.tokenizer.bos_id, 9690]
    assert hi == client.tokenize(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n").ids
    done = client.complete(chat=SYSTEM_CHAT, max_new_tokens=len(SYSTEM_CASE["greedy_ids"]),
                           temperature=0.0)
    assert done.prompt_tokens == len(SYSTEM_CASE["prompt_ids"])
    assert_matches_llamacpp("smollm2", SYSTEM_CASE, done.token_ids)
