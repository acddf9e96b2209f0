"""Vocabulary rules read from llama.cpp's behaviour, as data: the BPE pre-tokenizer regexes
selected by `tokenizer.ggml.pre`, and the special-token roles llama.cpp assigns by token text
(end-of-generation tokens included). Used by service/model/tokenizer.py and bpe.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# ---------------------------------------------------------------- pre-tokenizer registry (BPE)

@dataclass(frozen=True)
class PreTokenizer:
    """Regexes applied in order (each one splits every piece of the previous, matches isolated)."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a whole piece that is a token is emitted without merging
    add_bos: bool = False        # llama.cpp's default before tokenizer.ggml.add_bos_token


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_HEAD = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
_LLAMA3_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _LLAMA3_HEAD + r"|\p{N}{1,3}" + _LLAMA3_TAIL
_QWEN2 = _LLAMA3_HEAD + r"|\p{N}" + _LLAMA3_TAIL

PRE_TOKENIZERS: dict[str, PreTokenizer] = {}


def _register(names: Iterable[str], spec: PreTokenizer) -> None:
    for name in names:
        PRE_TOKENIZERS[name] = spec


_register(["default"], PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")))
_register(["gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe"], PreTokenizer((_GPT2,)))
_register(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
          PreTokenizer((r"\p{N}", _GPT2)))
_register(["llama3", "llama-v3", "llama-bpe", "falcon3"],
          PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True))
_register(["dbrx", "smaug-bpe"], PreTokenizer((_LLAMA3,)))
_register(["qwen2", "stablelm2", "megrez"], PreTokenizer((_QWEN2,)))
_register(["laguna"], PreTokenizer((r"[^\n]+|[\n]+", _QWEN2)))   # lines, then qwen2's


# ---------------------------------------------------------------- special-token roles by text
# llama.cpp gives these roles by token text when the metadata names no id, and adds CONTROL to the
# token's attributes. role -> (metadata keys, texts in order of preference).
_FW = "\uff5c"  # DeepSeek's full-width bar
ROLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "eot": (("tokenizer.ggml.eot_token_id",),
            ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
             "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
             f"<{_FW}end\u2581of\u2581sentence{_FW}>", "<end_of_utterance>")),
    "eom": (("tokenizer.ggml.eom_token_id",), ("<|eom_id|>",)),
    "fim_pre": (("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
                ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", f"<{_FW}fim\u2581begin{_FW}>",
                 "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>")),
    "fim_suf": (("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
                ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", f"<{_FW}fim\u2581hole{_FW}>",
                 "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>")),
    "fim_mid": (("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
                ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", f"<{_FW}fim\u2581end{_FW}>",
                 "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>")),
    "fim_pad": (("tokenizer.ggml.fim_pad_token_id",),
                ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>")),
    "fim_rep": (("tokenizer.ggml.fim_rep_token_id",),
                ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    "fim_sep": (("tokenizer.ggml.fim_sep_token_id",), ("<|file_sep|>",)),
}
EOG_ROLES = ("eot", "eom", "fim_pad", "fim_rep", "fim_sep")
# Tokens that end generation whatever their role (also made CONTROL).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    f"<{_FW}end\u2581of\u2581sentence{_FW}>", "[e~["})
ALWAYS_SHOWN = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})
# (text, new attribute, groups): the token leaves the EOG set, with the new attribute, when every
# text of one group is also an EOG token (tokenizers where that text is an ordinary marker).
EOG_EXCEPTIONS = (
    ("<|end|>", "USER_DEFINED", ({"<|return|>", "<|call|>"}, {"<|return|>", "<|calls|>"},
                                 {"<|call|>", "<|flush|>"}, {"<|calls|>", "<|flush|>"})),
    ("</s>", "NORMAL", ({"<|tool_response>"}, {"<|plamo:eos|>"})),
)
