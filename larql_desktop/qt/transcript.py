"""What a chat tab shows, as plain data: turns with their text and, under replies, a stats line."""
from __future__ import annotations

from dataclasses import dataclass

from larql_desktop.qt.reply_stats import ReplyStats, format_reply_stats

USER = "user"
ASSISTANT = "assistant"
NOTICE = "notice"   # a line from the app itself, e.g. "the model changed"


@dataclass
class Turn:
    role: str
    text: str = ""
    stats: ReplyStats | None = None

    @property
    def footer(self) -> str | None:
        return format_reply_stats(self.stats) if self.stats else None


class Transcript:
    def __init__(self) -> None:
        self.turns: list[Turn] = []

    @property
    def last(self) -> Turn | None:
        return self.turns[-1] if self.turns else None

    @property
    def streaming(self) -> bool:
        last = self.last
        return last is not None and last.role == ASSISTANT and last.stats is None

    @property
    def can_regenerate(self) -> bool:
        last = self.last
        return last is not None and last.role == ASSISTANT and last.stats is not None

    def add_user(self, text: str) -> None:
        self.turns.append(Turn(USER, text))

    def add_notice(self, text: str) -> None:
        self.turns.append(Turn(NOTICE, text))

    def start_reply(self) -> None:
        self.turns.append(Turn(ASSISTANT))

    def append(self, text: str) -> None:
        self.turns[-1].text += text

    def finish_reply(self, full_text: str, stats: ReplyStats) -> str:
        """Close the streaming reply; returns text the stream had not delivered (a held-back UTF-8 tail)."""
        turn = self.turns[-1]
        missing = full_text[len(turn.text):] if full_text.startswith(turn.text) else ""
        turn.text += missing
        turn.stats = stats
        return missing

    def drop_last_reply(self) -> None:
        if self.last is not None and self.last.role == ASSISTANT:
            self.turns.pop()
