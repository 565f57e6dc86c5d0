"""Messages between the GUI thread and the engine worker: immutable requests in, immutable snapshots out.

Plain dataclasses without Qt, so they can be built and tested anywhere. Every request carries the
`request_id` the client gave it; every answer names the request it answers. New panels add their own
request types and register a handler with the worker (`EngineWorker.register_handler`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.generation import SamplingSettings, TokenStep
from .reply_stats import ReplyStats


# --- requests (GUI -> worker) ---

@dataclass(frozen=True)
class LoadModel:
    request_id: int
    name_or_path: str   # a packaged model's key or a path to a GGUF file
    threads: int


@dataclass(frozen=True)
class SendPrompt:
    request_id: int
    session_id: int
    text: str
    settings: SamplingSettings
    # Set from the GUI thread, read by the worker between tokens: a queued "stop" signal would wait
    # behind the generation loop it is meant to interrupt. One per request, so a Stop can never leak
    # into the next reply.
    cancel: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)


@dataclass(frozen=True)
class Regenerate:
    request_id: int
    session_id: int
    settings: SamplingSettings
    cancel: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)


@dataclass(frozen=True)
class CloseSession:
    request_id: int
    session_id: int


# --- snapshots (worker -> GUI) ---

@dataclass(frozen=True)
class ModelInfo:
    request_id: int
    key: str                  # packaged key, or the GGUF file's stem
    packaged: bool            # one of PACKAGED_MODELS (else a GGUF file the user opened)
    display_name: str
    path: Path
    is_chat: bool
    architecture: str
    n_layers: int
    hidden: int
    vocab_size: int
    context_limit: int
    load_seconds: float
    threads: int


@dataclass(frozen=True)
class ReplyStarted:
    request_id: int
    session_id: int
    prompt: str | None        # the user's text; None when regenerating the last reply


@dataclass(frozen=True)
class TokenEvent:
    request_id: int
    session_id: int
    token_id: int
    text: str
    index: int
    seconds: float
    prompt_tokens: int
    is_stop: bool

    @classmethod
    def from_step(cls, request_id: int, session_id: int, step: TokenStep) -> "TokenEvent":
        return cls(request_id, session_id, step.token_id, step.text, step.index, step.seconds,
                   step.prompt_tokens, step.is_stop)


@dataclass(frozen=True)
class ReplyFinished:
    request_id: int
    session_id: int
    text: str                 # the whole reply as the session stored it (includes any held-back UTF-8 tail)
    stats: ReplyStats


@dataclass(frozen=True)
class ErrorReport:
    request_id: int | None
    session_id: int | None
    context: str              # what failed, e.g. "Loading smollm2", "Reply"
    message: str

    def describe(self) -> str:
        return f"{self.context}: {self.message}"
