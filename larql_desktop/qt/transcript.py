"""What a chat tab shows, as plain data: turns with their text and, under replies, a stats line."""
from __future__ import annotations

from dataclasses import dataclass, field

from larql_desktop.qt.reply_stats import ReplyStats, format_reply_stats

USER = "user"
ASSISTANT = "assistant"
NOTICE = "notice"   # a line from the app itself, e.g. "the model changed"

INTERRUPTED_NOTE = "interrupted: the app closed before this reply ended"


@dataclass
class Turn:
    role: str
    text: str = ""
    stats: ReplyStats | None = None
    done: bool = False          # a reply that has ended (streamed to its end here, or restored from disk)
    interrupted: bool = False   # restored from a reply the app never finished writing
    tokens: list = field(default_factory=list)   # TokenEvents of a reply generated in this run (token view)
    # Token index -> the layers where an INSERTed feature fired in its pass (from the reply's analysis; empty
    # until the reply map has been computed for it).
    fired: dict = field(default_factory=dict)

    @property
    def footer(self) -> str | None:
        if self.stats:
            return format_reply_stats(self.stats)
        return INTERRUPTED_NOTE if self.interrupted else None


class Transcript:
    def __init__(self) -> None:
        self.turns: list[Turn] = []

    @property
    def last(self) -> Turn | None:
        return self.turns[-1] if self.turns else None

    @property
    def streaming(self) -> bool:
        last = self.last
        return last is not None and last.role == ASSISTANT and not last.done

    @property
    def can_regenerate(self) -> bool:
        last = self.last
        return last is not None and last.role == ASSISTANT and last.done

    def add_user(self, text: str) -> None:
        self.turns.append(Turn(USER, text))

    def add_notice(self, text: str) -> None:
        self.turns.append(Turn(NOTICE, text))

    def add_restored(self, role: str, text: str, complete: bool = True) -> None:
        """A turn read back from the saved chat."""
        self.turns.append(Turn(role, text, done=True, interrupted=role == ASSISTANT and not complete))

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
        turn.done = True
        return missing

    def drop_last_reply(self) -> None:
        if self.last is not None and self.last.role == ASSISTANT:
            self.turns.pop()

    def messages(self) -> tuple[tuple[str, str], ...]:
        """The conversation the model sees: (role, text) of user turns and replies (notices are the app's)."""
        return tuple((t.role, t.text) for t in self.turns if t.role in (USER, ASSISTANT))

    def replies(self) -> list[Turn]:
        return [t for t in self.turns if t.role == ASSISTANT]
