"""The chat controller: one place that owns the flow of every chat, so the window only lays out and renders.

A chat's conversation lives in the engine's session (the worker's `ChatSession`: it is handed a saved chat once,
`OpenChat`, and holds it from then on); the chat store (engine/chats.py) saves it as it happens; the `Chat` here
is what the window shows of it: the transcript of turns as they streamed (with their token details and stats), its
title and per-chat settings. The controller sends the requests, follows the reply stream into the transcript and
the store, and tells the window what changed through its signals; it never touches a widget.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QObject, Signal, Slot

from larql_desktop.engine.chats import (ChatStore, ChatStoreError, ReadOnlyChatStore, StoredChat, chat_to_json,
                                        chat_to_markdown)
from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.qt.protocol import ModelInfo, ReplyFinished, ReplyStarted, TokenEvent
from larql_desktop.qt.transcript import Transcript
from larql_desktop.qt.worker import EngineClient

log = logging.getLogger(__name__)

NEW_CHAT_TITLE = "New chat"    # replaced by the start of the first message unless the user renames the chat
TITLE_LENGTH = 40


@dataclass(eq=False)
class Chat:
    """One open chat as the window shows it (GUI thread only)."""
    id: int                              # the saved chat's id (negative: not saved) and the engine session's
    title: str
    sampling: SamplingSettings
    system_prompt: str | None            # None: the model's template default
    transcript: Transcript = field(default_factory=Transcript)
    reply_writer: object = None          # the store's StreamingReply while a reply streams


def model_choice(info: ModelInfo) -> str:
    """How a model is named in settings and saved chats: its packaged key, or its GGUF file's path."""
    return info.key if info.packaged else str(info.path)


class ChatController(QObject):
    """Opens, continues, renames, closes and deletes chats; follows each reply into its transcript and the store."""

    opened = Signal(object)              # Chat: a chat to show (new, or from the store)
    reply_started = Signal(object, object)   # Chat, ReplyStarted: its transcript has the prompt and an empty reply
    streamed = Signal(object, str)       # Chat, text: the reply's next text (already in its transcript)
    reply_finished = Signal(object, object)  # Chat, ReplyFinished: the transcript holds the whole reply
    retitled = Signal(object)            # Chat
    list_changed = Signal()              # the saved chats changed: a chat list should be read again
    problem = Signal(str)                # a failure to show (the chat carries on)
    note = Signal(str)                   # a passing message for the status bar

    def __init__(self, client: EngineClient, store: ChatStore, parent: QObject | None = None):
        super().__init__(parent)
        self.client = client
        self.store = store
        self.chats: dict[int, Chat] = {}
        self._unsaved_ids = itertools.count(1)   # ids for chats the store could not save (negative)
        client.reply_started.connect(self._on_reply_started)
        client.tokens.connect(self._on_tokens)
        client.reply_finished.connect(self._on_reply_finished)

    # --- the store ---

    def stored(self, call: Callable, *args):
        """A chats-store call; a failure is reported (the chat in the window carries on) and gives None."""
        try:
            return call(*args)
        except ReadOnlyChatStore as exc:      # said once by the window's status note; not an error each time
            self.note.emit(f"Saved chats: {exc}")
            return None
        except ChatStoreError as exc:
            self.problem.emit(f"Saved chats: {exc}")
            return None

    def _model_key(self) -> str:
        return model_choice(self.client.model) if self.client.model else ""

    def list_chats(self, search: str = ""):
        return self.stored(self.store.list_chats, search)

    # --- opening and closing ---

    def new_chat(self, sampling: SamplingSettings) -> Chat:
        chat_id = self.stored(self.store.create_chat, NEW_CHAT_TITLE, sampling.to_dict(), None, self._model_key())
        if chat_id is None:
            chat_id = -next(self._unsaved_ids)   # not saved, but usable
        chat = self._open(Chat(chat_id, NEW_CHAT_TITLE, sampling, None))
        self.list_changed.emit()
        return chat

    def open_saved(self, chat_id: int) -> Chat | None:
        """A saved chat, opened (its own if it is open already); its session is handed the conversation once."""
        if chat_id in self.chats:
            return self.chats[chat_id]
        saved: StoredChat | None = self.stored(self.store.load, chat_id)
        if saved is None:
            return None
        try:
            sampling = SamplingSettings.from_dict(saved.sampling)
        except (TypeError, ValueError) as exc:
            log.info("chat %s has unusable sampling settings (%s); using the defaults", chat_id, exc)
            sampling = SamplingSettings()
        chat = Chat(saved.id, saved.title, sampling, saved.system_prompt)
        for message in saved.messages:
            chat.transcript.add_restored(message.role, message.content, message.complete)
            chat.transcript.last.tokens = list(message.tokens)   # the token view works on saved replies too
        self.client.open_chat(saved.id, tuple((m.role, m.content) for m in saved.messages), saved.system_prompt)
        return self._open(chat)

    def _open(self, chat: Chat) -> Chat:
        self.chats[chat.id] = chat
        self.opened.emit(chat)
        return chat

    def close(self, chat_id: int) -> None:
        """Close a chat: its session ends; it stays saved (an empty one is not kept)."""
        chat = self.chats.pop(chat_id, None)
        self.client.close_session(chat_id)
        if chat is not None:
            self._forget_if_empty(chat)
        self.list_changed.emit()

    def delete(self, chat_id: int) -> None:
        self.chats.pop(chat_id, None)
        self.stored(self.store.delete, chat_id)
        self.list_changed.emit()

    def _forget_if_empty(self, chat: Chat) -> None:
        if not chat.transcript.messages() and chat.system_prompt is None and chat.id > 0:
            self.stored(self.store.delete, chat.id)

    def rename(self, chat_id: int, title: str) -> str:
        """The chat's new title as kept (whitespace folded); ValueError for an empty one."""
        self.stored(self.store.rename, chat_id, title)   # ValueError: nothing changes
        title = " ".join(title.split())
        chat = self.chats.get(chat_id)
        if chat is not None:
            chat.title = title
            self.retitled.emit(chat)
        self.list_changed.emit()
        return title

    def shutdown(self) -> None:
        """After the engine thread has ended: replies stopped by closing are kept as far as they got."""
        for chat in self.chats.values():
            writer, chat.reply_writer = chat.reply_writer, None
            if writer is not None:
                self.stored(writer.finish, None, chat.transcript.last.tokens)
            self._forget_if_empty(chat)
        self.store.close()

    # --- per-chat settings ---

    def set_sampling(self, chat: Chat, sampling: SamplingSettings) -> None:
        chat.sampling = sampling
        if chat.id > 0:
            self.stored(self.store.set_sampling, chat.id, sampling.to_dict())

    def set_system_prompt(self, chat: Chat, system_prompt: str | None) -> None:
        chat.system_prompt = system_prompt
        self.client.set_system_prompt(chat.id, system_prompt)
        if chat.id > 0:
            self.stored(self.store.set_system_prompt, chat.id, system_prompt)

    def model_changed(self, info: ModelInfo) -> None:
        """The worker carried each conversation to the new model's sessions: say so where the conversation is."""
        for chat in self.chats.values():
            if chat.transcript.turns:
                chat.transcript.add_notice(f"Model changed to {info.display_name}: "
                                           "the conversation continues on it.")

    # --- replies ---

    def send(self, chat: Chat, text: str, settings: SamplingSettings) -> int:
        return self.client.send_prompt(chat.id, text, settings)

    def regenerate(self, chat: Chat, settings: SamplingSettings) -> int | None:
        if not chat.transcript.can_regenerate:
            return None
        return self.client.regenerate(chat.id, settings)

    @Slot(object)
    def _on_reply_started(self, started: ReplyStarted) -> None:
        chat = self.chats.get(started.session_id)
        if chat is None:
            return
        if started.prompt is None:
            chat.transcript.drop_last_reply()
        else:
            chat.transcript.add_user(started.prompt)
        chat.transcript.start_reply()
        self._save_reply_start(chat, started.prompt)
        self.reply_started.emit(chat, started)

    @Slot(object)
    def _on_tokens(self, events: tuple[TokenEvent, ...]) -> None:
        """A reply's next tokens, as the engine thread batched them (one reply's, in order): handled as one
        piece of text, so the GUI thread's cost per token stays small while the decode shares its cores."""
        chat = self.chats.get(events[0].session_id)
        if chat is None:
            return
        if chat.transcript.streaming:
            chat.transcript.last.tokens.extend(events)
        text = "".join(event.text for event in events)
        if text:
            chat.transcript.append(text)
            if chat.reply_writer is not None:
                self.stored(chat.reply_writer.append, text)   # written at most every 0.5 s
            self.streamed.emit(chat, text)

    @Slot(object)
    def _on_reply_finished(self, finished: ReplyFinished) -> None:
        chat = self.chats.get(finished.session_id)
        if chat is None:
            return
        chat.transcript.finish_reply(finished.text, finished.stats)   # the session's final text
        writer, chat.reply_writer = chat.reply_writer, None
        if writer is not None:
            self.stored(writer.finish, finished.text, chat.transcript.last.tokens)
        self.reply_finished.emit(chat, finished)

    def _save_reply_start(self, chat: Chat, prompt: str | None) -> None:
        """The prompt (or, regenerating, the dropped reply) and an empty reply row the tokens stream into."""
        if chat.id <= 0:
            return
        if prompt is None:
            self.stored(self.store.drop_last_reply, chat.id)
        else:
            self.stored(self.store.add_message, chat.id, "user", prompt)
            if chat.title == NEW_CHAT_TITLE and prompt.strip():
                title = " ".join(prompt.split())
                title = title if len(title) <= TITLE_LENGTH else title[:TITLE_LENGTH - 1] + "…"
                self.stored(self.store.rename, chat.id, title)
                chat.title = title
                self.retitled.emit(chat)
        if self.client.model is not None:
            self.stored(self.store.set_model, chat.id, self._model_key())
        chat.reply_writer = self.stored(self.store.begin_reply, chat.id)
        self.list_changed.emit()

    # --- export ---

    def export(self, chat_id: int, path: Path, fmt: str, default_system_prompt: str | None) -> StoredChat:
        """Write the chat as it is saved: "md" (Markdown) or "json"."""
        if fmt not in ("md", "json"):
            raise ValueError(f"export format is md or json, not {fmt!r}")
        saved = self.store.load(chat_id)
        text = chat_to_json(saved) if fmt == "json" else chat_to_markdown(saved, default_system_prompt)
        Path(path).write_text(text, encoding="utf-8")
        return saved
