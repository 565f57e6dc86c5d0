"""Checks the engine against outputs recorded from llama.cpp (the shared reference file format)."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Callable

import numpy as np

from larql_desktop.engine.catalog import PACKAGED_MODELS
from larql_desktop.engine.formats.jsonfile import read_json
from larql_desktop.engine.loading import chat_prompt_ids
from larql_desktop.engine.model.generation import greedy
from larql_desktop.engine.model.transformer import KvCache
from larql_desktop.engine.loading import LoadedModel

CLEAR_GAP = 0.5   # llama.cpp's top-1/top-2 logit gap above which its argmax is not a near-tie


@dataclass
class ModelAgreement:
    name: str
    tokenizer_identical: int = 0
    tokenizer_total: int = 0
    greedy_identical: int = 0
    greedy_total: int = 0
    clear_agree: int = 0
    clear_total: int = 0
    top10_logit_mae: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_reference(path: str | Path) -> dict:
    doc = read_json(path, "reference file")
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict):
        raise ValueError(f"{path}: expected an object with a 'models' mapping (llama.cpp reference format)")
    return doc


def model_key_for(reference_name: str, entry: dict) -> str | None:
    """Map a reference file's model name onto a packaged model key."""
    for spec in PACKAGED_MODELS.values():
        if reference_name == spec.reference_name or reference_name == spec.key:
            return spec.key
    gguf_file = str(entry.get("gguf_file", "")).lower()
    if "smollm2" in gguf_file:
        return "smollm2"
    if "gemma-3-270m" in gguf_file or "gemma3-270m" in gguf_file:
        return "gemma3-270m"
    return None


def check_model(model: LoadedModel, name: str, entry: dict, log: Callable[[str], None] = print) -> ModelAgreement:
    result = ModelAgreement(name)
    tok = model.tokenizer
    for case in entry.get("tokenize", []):
        ids = tok.encode(case["text"], add_bos=False)
        result.tokenizer_total += 1
        if ids == case["ids"]:
            result.tokenizer_identical += 1
        else:
            result.notes.append(f"tokenize {case['text'][:40]!r}: ours {ids[:12]} vs llama.cpp {case['ids'][:12]}")
    for prompt in entry.get("prompts", []):
        if prompt.get("kind") == "chat":
            ours = chat_prompt_ids(model, prompt["text"])
        else:
            ours = tok.encode(prompt.get("rendered", prompt.get("text", "")))
        ref_prompt = list(prompt["prompt_ids"])
        result.tokenizer_total += 1
        if ours == ref_prompt:
            result.tokenizer_identical += 1
        else:
            result.notes.append(f"prompt {prompt.get('text', '')[:40]!r}: token ids differ from llama.cpp")
        greedy_ref = list(prompt.get("greedy_ids", []))
        # Greedy continuation, decoded token by token from llama.cpp's prompt ids.
        ours_greedy = []
        for token in islice(greedy(model.transformer, ref_prompt, model.ffn), len(greedy_ref)):
            ours_greedy.append(token)
            if token in tok.stop_ids:
                break
        result.greedy_total += 1
        if ours_greedy == greedy_ref:
            result.greedy_identical += 1
        # Teacher-forced: our argmax at every position of llama.cpp's sequence.
        seq = ref_prompt + greedy_ref
        all_logits = model.transformer.forward(seq, KvCache(model.config), model.ffn, all_logits=True)
        for i, (top_ids, top_logits) in enumerate(zip(prompt["top10_ids"], prompt["top10_logits"])):
            if i >= len(all_logits):
                break
            ours_row = all_logits[i]
            result.top10_logit_mae.append(float(np.mean(np.abs(ours_row[top_ids] - np.asarray(top_logits)))))
            if top_logits[0] - top_logits[1] >= CLEAR_GAP:
                result.clear_total += 1
                result.clear_agree += int(int(np.argmax(ours_row)) == int(top_ids[0]))
        diverge = next((i for i, (a, b) in enumerate(zip(ours_greedy, greedy_ref)) if a != b), None)
        verdict = "identical" if ours_greedy == greedy_ref else \
            f"differs from token {diverge if diverge is not None else len(ours_greedy)}"
        log(f"  {prompt.get('kind', 'text'):4s} {prompt.get('text', '')[:48]!r}: greedy {verdict} "
            f"of {len(greedy_ref)}")
    return result


def format_summary(results: list[ModelAgreement]) -> list[str]:
    lines = []
    for r in results:
        pct = 100.0 * r.clear_agree / max(r.clear_total, 1)
        mae = float(np.mean(r.top10_logit_mae)) if r.top10_logit_mae else float("nan")
        lines.append(f"{r.name}: tokenizer {r.tokenizer_identical}/{r.tokenizer_total} identical; greedy "
                     f"continuations {r.greedy_identical}/{r.greedy_total} identical; argmax agreement "
                     f"{r.clear_agree}/{r.clear_total} ({pct:.1f}%) at clear positions; top-10 logit MAE {mae:.3f}")
        lines.extend(f"  note: {n}" for n in r.notes[:10])
    agree = sum(r.clear_agree for r in results)
    total = sum(r.clear_total for r in results)
    tok_a = sum(r.tokenizer_identical for r in results)
    tok_b = sum(r.tokenizer_total for r in results)
    lines.append(f"agreement: {100.0 * agree / max(total, 1):.1f}% of {total} clear positions; "
                 f"tokenizer: {tok_a}/{tok_b} identical")
    return lines
