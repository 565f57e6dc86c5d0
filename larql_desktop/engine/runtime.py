"""Loading a model end to end: GGUF, tokenizer, chat template, weights and ONNX FFN graphs."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .catalog import ModelSpec, Progress, resolve_model
from .chat_template import render_chat
from .config import ModelConfig
from .block_graphs import OnnxBlocks
from .ffn_graphs import OnnxFfn
from .gguf import GgufFile
from .model import TransformerModel
from .paths import AppPaths
from .tokenizer import Tokenizer

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
        if not self.is_chat:
            # A base model continues text: the conversation is the user's text, turns concatenated.
            return "".join(m["content"] for m in messages)
        tok = self.tokenizer
        return render_chat(self.chat_template, messages, add_generation_prompt=True,
                           bos_token=tok.tokens[tok.bos_id] if tok.bos_id is not None else "",
                           eos_token=tok.tokens[tok.eos_id] if tok.eos_id is not None else "")

    def encode_prompt(self, messages: list[dict]) -> list[int]:
        text = self.render_prompt(messages)
        if self.is_chat:
            # The template writes any BOS itself; special tokens in it are parsed as llama.cpp does.
            return self.tokenizer.encode(text, add_bos=False, parse_special=True)
        return self.tokenizer.encode(text)

    @property
    def context_limit(self) -> int:
        return min(self.config.context_length, 8192)


def load_model(name_or_path: str, paths: AppPaths, threads: int = 2, progress: Progress | None = None) -> LoadedModel:
    started = time.perf_counter()
    path, spec = resolve_model(name_or_path, paths, progress)
    if progress:
        progress(f"Reading {path.name}", 0.05)
    gguf = GgufFile(path)
    config = ModelConfig.from_gguf(gguf)
    tokenizer = Tokenizer.from_gguf(gguf)
    if progress:
        progress("Checking the model's checksum", 0.1)
    checksum = cached_checksum(path, paths.cache, gguf)
    if progress:
        progress("Loading attention weights", 0.2)
    transformer = TransformerModel(gguf, config)

    def ffn_progress(message: str, fraction: float) -> None:
        if progress:
            progress(message, 0.3 + 0.45 * fraction)

    ffn = OnnxFfn(gguf, config, checksum, paths.onnx_dir, threads=threads, progress=ffn_progress)
    if ffn.rebuilt:
        log.info("exported %d ONNX graphs for %s to %s", len(ffn.rebuilt), path.name, ffn.directory)

    def blocks_progress(message: str, fraction: float) -> None:
        if progress:
            progress(message, 0.75 + 0.25 * fraction)

    blocks = OnnxBlocks(gguf, config, checksum, paths.onnx_dir, threads=threads, progress=blocks_progress)
    if blocks.rebuilt:
        log.info("exported %d attention/head graphs for %s", len(blocks.rebuilt), path.name)
    transformer.use_graphs(blocks)
    seconds = time.perf_counter() - started
    log.info("loaded %s in %.2f s", path.name, seconds)
    return LoadedModel(spec.key if spec else path.stem, spec, path, gguf, config, checksum, tokenizer,
                       transformer, ffn, seconds, threads)
