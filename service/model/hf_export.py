"""A GGUF vocabulary written out as a HuggingFace tokenizer folder: tokenizer.json,
tokenizer_config.json and config.json, so that a gateway that tokenizes with the `tokenizers`
library (and renders chat with tokenizer_config.json's template) gives the ids this server
gives for the same text (tests/unit/test_hf_export.py checks both vocabulary kinds).

How llama.cpp's rules (service/model/tokenizer.py) are written in tokenizer.json terms:

    special-token partition  -> added_tokens (normalized false: matched on the raw text);
                                control/unknown tokens special=true, user-defined special=false,
                                so `encode_special_tokens` (text only) keeps user-defined ones,
                                as parse_special=False does
    byte-level BPE           -> the BPE model and pre-tokenizer the tokenizer already runs on,
                                ByteLevel decoder
    SentencePiece-style      -> the same BPE model (merges from scores, byte fallback); a
                                normalizer writes ' ' as U+2581 and, with add_space_prefix,
                                prepends one to every text run (HF normalizes each run between
                                added tokens apart, as llama.cpp prefixes each fragment);
                                decoder: U+2581 -> ' ', byte fallback, fuse (strip one leading
                                space with add_space_prefix)
    add_bos / add_eos        -> a TemplateProcessing post-processor (HF's add_special_tokens)

The chat template is the one the engine renders with. HF convention renders BOS in the template
and encodes the render without special tokens; our chat path drops a rendered BOS and lets the
tokenizer add it. So when the tokenizer adds BOS and the template does not write it, the
exported template writes `bos_token` first: both paths then give one BOS.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.model.chat import render_chat
from service.model.tokenizer import Tokenizer
from service.model.vocab import SPACE_MARK, VocabKind

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")
_PROBE = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class ModelFacts:
    """What config.json says about the model besides its vocabulary."""

    name: str
    architecture: str
    n_ctx: int
    n_layer: int = 0
    n_embd: int = 0


def _added_tokens(tok: Tokenizer) -> list[dict[str, Any]]:
    return [{"id": tid, "content": text, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": special}
            for text, tid, special in sorted(tok.literal_tokens(), key=lambda t: t[1])]


def _post_processor(tok: Tokenizer) -> dict[str, Any] | None:
    ends = [(tok.add_bos, tok.bos_id), (tok.add_eos, tok.eos_id)]
    if not any(on and tid is not None for on, tid in ends):
        return None
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    eos = [tok.eos_id] if tok.add_eos and tok.eos_id is not None else []

    def seq(name: str) -> list[dict[str, Any]]:
        return ([{"SpecialToken": {"id": tok.token_text(i), "type_id": 0}} for i in bos]
                + [{"Sequence": {"id": name, "type_id": 0}}]
                + [{"SpecialToken": {"id": tok.token_text(i), "type_id": 0}} for i in eos])

    specials = {tok.token_text(i): {"id": tok.token_text(i), "ids": [i],
                                    "tokens": [tok.token_text(i)]} for i in bos + eos}
    return {"type": "TemplateProcessing", "single": seq("A"), "pair": seq("A") + seq("B"),
            "special_tokens": specials}


def _normalizer_decoder(tok: Tokenizer) -> tuple[dict | None, dict]:
    if tok.kind is VocabKind.BPE:
        return None, {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                      "use_regex": True}
    norms: list[dict[str, Any]] = []
    if tok.add_space_prefix:
        norms.append({"type": "Prepend", "prepend": SPACE_MARK})
    norms.append({"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK})
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": SPACE_MARK}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}]
    if tok.add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {"type": "Sequence", "normalizers": norms}, {"type": "Sequence",
                                                         "decoders": decoders}


def tokenizer_json(tok: Tokenizer) -> dict[str, Any]:
    """tokenizer.json of `tok` (a vocabulary of either kind)."""
    if not tok.can_encode:
        raise ValueError("a model without a vocabulary has no tokenizer to export")
    out = json.loads(tok.backend_json())
    normalizer, decoder = _normalizer_decoder(tok)
    out.update(added_tokens=_added_tokens(tok), normalizer=normalizer,
               post_processor=_post_processor(tok), decoder=decoder)
    return out


def exported_template(tok: Tokenizer, template: str | None) -> str | None:
    """The chat template as HF-style consumers need it (BOS rendered, see the docstring)."""
    if template is None or not (tok.add_bos and tok.bos_id is not None):
        return template
    bos = tok.token_text(tok.bos_id)
    try:
        writes_bos = render_chat(template, _PROBE, bos, "").startswith(bos)
    except Exception:  # noqa: BLE001 - a template that needs other roles: read its text
        writes_bos = "bos_token" in template
    return template if writes_bos else "{{ bos_token }}" + template


def tokenizer_config(tok: Tokenizer, template: str | None, n_ctx: int) -> dict[str, Any]:
    def text(tid: int | None) -> str | None:
        return tok.token_text(tid) if tid is not None else None

    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": n_ctx,
        "bos_token": text(tok.bos_id), "eos_token": text(tok.eos_id),
        "unk_token": text(tok.unk_id), "add_bos_token": tok.add_bos,
        "add_eos_token": tok.add_eos, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                 for a in _added_tokens(tok)},
    }
    chat = exported_template(tok, template)
    if chat is not None:
        cfg["chat_template"] = chat
    return {k: v for k, v in cfg.items() if v is not None}


def config_json(tok: Tokenizer, facts: ModelFacts) -> dict[str, Any]:
    eog = sorted(tok.eog_ids)
    cfg = {"model_type": facts.architecture, "architectures": [facts.architecture],
           "_name_or_path": facts.name, "vocab_size": tok.vocab_size,
           "max_position_embeddings": facts.n_ctx, "bos_token_id": tok.bos_id,
           "eos_token_id": eog if len(eog) != 1 else eog[0],
           "num_hidden_layers": facts.n_layer, "hidden_size": facts.n_embd}
    return {k: v for k, v in cfg.items() if v is not None}


def tokenizer_files(tok: Tokenizer, template: str | None, facts: ModelFacts
                    ) -> dict[str, bytes]:
    """The three files, by name, as UTF-8 JSON."""
    docs = {"tokenizer.json": tokenizer_json(tok),
            "tokenizer_config.json": tokenizer_config(tok, template, facts.n_ctx),
            "config.json": config_json(tok, facts)}
    return {name: json.dumps(doc, ensure_ascii=False, indent=1).encode("utf-8")
            for name, doc in docs.items()}


def zip_files(files: Mapping[str, bytes]) -> bytes:
    """The files as one zip archive, entries at its root, with a fixed timestamp so the same
    files give the same bytes (and the same sha256)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, files[name])
    return buf.getvalue()
