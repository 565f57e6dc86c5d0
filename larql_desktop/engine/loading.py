"""Loading a model end to end: GGUF, tokenizer, chat template, weights and ONNX FFN graphs."""
from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from larql_desktop.engine.catalog import ModelSpec, Progress, resolve_model
from larql_desktop.engine.formats.chat_template import render_chat
from larql_desktop.engine.model.config import ModelConfig
from larql_desktop.engine.model.prefix_cache import common_prefix
from larql_desktop.engine.graphs.blocks import OnnxBlocks
from larql_desktop.engine.graphs.decoder import OnnxDecoder
from larql_desktop.engine.graphs.ffn import OnnxFfn
from larql_desktop.engine.graphs.softmax import OnnxSoftmax
from larql_desktop.engine.formats.gguf import GgufFile
from larql_desktop.engine.heap import return_freed_memory
from larql_desktop.engine.model.transformer import TransformerModel
from larql_desktop.engine.paths import AppPaths
from larql_desktop.engine.formats.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def cached_checksum(path: Path, cache_dir: Path, gguf: GgufFile) -> str:
    """sha256 of a GGUF, remembered per (path, size, mtime) so a restart does not re-hash the file."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    store = cache_dir / "checksums.json"
    try:
        known = json.loads(store.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(key), str):
        return known[key]
    digest = gguf.sha256()
    known[key] = digest
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = store.with_name(f"checksums.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, store)
    return digest


@dataclass
class LoadedModel:
    """Everything needed to run one model. Immutable after loading except the ONNX sessions' internals."""
    name: str
    spec: ModelSpec | None
    path: Path
    gguf: GgufFile
    config: ModelConfig
    checksum: str
    tokenizer: Tokenizer
    transformer: TransformerModel
    ffn: OnnxFfn
    load_seconds: float
    threads: int

    @property
    def chat_template(self) -> str | None:
        template = self.gguf.get("tokenizer.chat_template")
        return template if isinstance(template, str) and template.strip() else None

    @property
    def is_chat(self) -> bool:
        """Instruct models with a template get chat prompts; base models (Gemma 3 270M) plain completion."""
        return self.chat_template is not None

    def render_prompt(self, messages: list[dict]) -> str:
        template = self.chat_template
        if template is None:
            # A base model continues text: the conversation is the user's text, turns concatenated.
            return "".join(m["content"] for m in messages)
        tok = self.tokenizer
        return render_chat(template, messages, add_generation_prompt=True,
                           bos_token=tok.tokens[tok.bos_id] if tok.bos_id is not None else "",
                           eos_token=tok.tokens[tok.eos_id] if tok.eos_id is not None else "")

    @property
    def default_system_prompt(self) -> str | None:
        """The system prompt the chat template writes when the chat gives none (SmolLM2's names the assistant);
        None when it writes none or cannot take one. Found by rendering with and without a marked system turn."""
        if not self.is_chat:
            return None
        system, user = "\x00larql-system\x00", "\x00larql-user\x00"
        try:
            with_system = self.render_prompt([{"role": "system", "content": system},
                                              {"role": "user", "content": user}])
            without = self.render_prompt([{"role": "user", "content": user}])
        except ValueError:   # a template that refuses system turns
            return None
        if system not in with_system:
            return None
        before, after = with_system.split(system, 1)
        after = after[:after.index(user)] if user in after else after
        # `after` holds the system turn's end and the user turn's start, which the default render shares.
        end = without.find(after, len(before)) if without.startswith(before) and after else -1
        return without[len(before):end] if end > len(before) else None

    def encode_prompt(self, messages: list[dict], max_tokens: int | None = None,
                      specials_in_content: bool = False) -> list[int]:
        """The token ids the model reads for `messages`. The template's own markers are special tokens; a marker
        typed in a message's content (`<|im_start|>`) is plain text, several tokens, so user text can never open
        a turn of another role (unless `specials_in_content`, llama.cpp's behaviour). max_tokens: a prompt whose
        text cannot fit raises TextTooLong before it is tokenised."""
        tok = self.tokenizer
        if not self.is_chat:
            return tok.encode(self.render_prompt(messages), max_tokens=max_tokens)
        if not specials_in_content:
            messages = [{**m, "content": tok.escape_specials(m["content"])} if isinstance(m.get("content"), str)
                        else m for m in messages]
        # The template writes any BOS itself.
        return tok.encode_template(self.render_prompt(messages), add_bos=False, max_tokens=max_tokens)

    @property
    def context_limit(self) -> int:
        return min(self.config.context_length, 8192)

    @functools.cached_property
    def _one_turn_prompts(self) -> tuple[np.ndarray, np.ndarray]:
        """Two chat prompts of one user turn each, differing only in the turn's text: what the template writes
        around any turn is what they share (`template_head`, `template_cue`)."""
        first, second = (np.asarray(self.encode_prompt([{"role": "user", "content": text}]))
                         for text in ("Hello", "Why"))
        return first, second

    @functools.cached_property
    def template_head(self) -> tuple[int, ...]:
        """The tokens every chat prompt on the template's default system prompt starts with (SmolLM2: 24, its
        system turn and the opening of the user's), found as two one-turn prompts' common prefix; none for a base
        model. The prefill cuts a chunk there (prefix_cache.PrefillSchedule), so each new conversation reuses
        them from the prefix cache."""
        if not self.is_chat:
            return ()
        first, second = self._one_turn_prompts
        return tuple(first[:common_prefix(first, second)].tolist())

    @functools.cached_property
    def template_cue(self) -> tuple[int, ...]:
        """The tokens every chat prompt ends with (SmolLM2: the user's turn closed and the assistant's opened),
        found as two one-turn prompts' common suffix; none for a base model. The prefill cuts a chunk after each
        (prefix_cache.PrefillSchedule), so a conversation's next turn reuses the whole of the prompt before it."""
        if not self.is_chat:
            return ()
        first, second = self._one_turn_prompts
        return tuple(first[first.size - common_prefix(first[::-1], second[::-1]):].tolist())


def conversation(model: LoadedModel, messages: Sequence[dict], system_prompt: str | None = None) -> list[dict]:
    """The messages a chat renders through its template: the system prompt first when one is set (None: the
    template's own default, as a new chat tab has it) and the model is a chat model, then the turns."""
    if system_prompt is not None and model.is_chat:
        return [{"role": "system", "content": system_prompt}] + list(messages)
    return list(messages)


def chat_prompt_ids(model: LoadedModel, user_text: str, system_prompt: str | None = None) -> list[int]:
    """The tokens a chat's first turn sends the model: `user_text` as the only turn, with the assistant's reply
    begun (what a new chat tab runs when the user asks `user_text`)."""
    return model.encode_prompt(conversation(model, [{"role": "user", "content": user_text}], system_prompt))


PRELOAD_CHOICES = ("all", "layers", "decoder", "none")


def load_model(name_or_path: str, paths: AppPaths, threads: int = 2, progress: Progress | None = None,
               preload: str = "all") -> LoadedModel:
    """Load a model; every ONNX file is checked (exported if missing or changed) here. `preload` says which
    onnxruntime sessions to create now, the rest being made on first use: "all", "layers" (the per-layer
    graphs: what the walk FFN runs), "decoder" (only the whole-model graph: a plain dense run), "none".
    Each set holds its own copy of the weights in onnxruntime's packed form, so loading only what the current
    FFN mode runs keeps memory down (peak RSS in `larql-desktop bench`, dense on the decoder alone: SmolLM2
    221 MB, Gemma 3 270M 417 MB; a walk, on the per-layer and walk decoder graphs, about twice as much)."""
    if preload not in PRELOAD_CHOICES:
        raise ValueError(f"preload must be one of {', '.join(PRELOAD_CHOICES)}, not {preload!r}")
    started = time.perf_counter()
    path, spec = resolve_model(name_or_path, paths, progress)
    if progress:
        progress(f"Reading {path.name}", 0.05)
    gguf = GgufFile(path)
    config = ModelConfig.from_gguf(gguf)
    if progress:
        progress("Checking the model's checksum", 0.1)
    checksum = cached_checksum(path, paths.cache, gguf)
    if progress:
        progress("Loading attention weights", 0.2)
    transformer = TransformerModel(gguf, config)

    def part(low: float, high: float) -> Progress:
        def report(message: str, fraction: float) -> None:
            if progress:
                progress(message, low + (high - low) * fraction)
        return report

    ffn = OnnxFfn(gguf, config, checksum, paths.onnx_dir, threads=threads, progress=part(0.2, 0.55))
    blocks = OnnxBlocks(gguf, config, checksum, paths.onnx_dir, threads=threads, progress=part(0.55, 0.65))
    decoder = OnnxDecoder(gguf, config, checksum, paths.onnx_dir, threads=threads, progress=part(0.65, 0.75))
    exported = len(ffn.rebuilt) + len(blocks.rebuilt) + len(decoder.rebuilt)
    if exported:
        log.info("exported %d ONNX graphs for %s to %s", exported, path.name, ffn.directory)
    if preload in ("all", "decoder"):
        decoder.load_sessions(part(0.75, 0.8))
    if preload in ("all", "layers"):      # what a walk step runs: attention with the gate, then the walk
        blocks.load_sessions(part(0.8, 0.86), gated=True)
        ffn.load_sessions(part(0.86, 0.95), kinds=("walk",))
        decoder.load_sessions(part(0.95, 1.0), walk=True)   # whole decode steps of the walk
    if preload == "all":
        blocks.load_sessions(gated=False)
        ffn.load_sessions()
    transformer.use_graphs(blocks, decoder, OnnxSoftmax(config.vocab_size, threads))
    # After the sessions: onnxruntime's load peaks (weights being prepacked), and building the tokenizer (Gemma 3's
    # 262k token texts, SmolLM2's BPE merges, for a moment as Python objects) no longer adds to that peak.
    tokenizer = Tokenizer.from_gguf(gguf)
    gguf.release_header_pages()
    # Building the tokenizer (the BPE's vocabulary and merges as Python objects for a moment) and prepacking the
    # weights leave ~10 MB of free heap the allocator would keep for the process's life.
    return_freed_memory()
    seconds = time.perf_counter() - started
    log.info("loaded %s in %.2f s", path.name, seconds)
    return LoadedModel(spec.key if spec else path.stem, spec, path, gguf, config, checksum, tokenizer,
                       transformer, ffn, seconds, threads)
