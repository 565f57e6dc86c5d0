"""Stop strings: streamed text cut at the first of some strings that never reach the reader (the OpenAI API's
`stop`), for a completion's text and for a chat session's token stream alike."""
from __future__ import annotations

from typing import Sequence

# One limit for every front-end (the window's chats, the HTTP API, the command line): the OpenAI API's.
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 200


def checked_stop_strings(stops: object) -> tuple[str, ...]:
    """`stops` as a tuple, or ValueError naming what is wrong (too many, empty, too long, not strings)."""
    if isinstance(stops, str) or not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop strings must be a list of strings")
    if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_LENGTH for s in stops):
        raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_LENGTH} "
                         f"characters (got {len(stops)}, of {min(map(len, stops), default=0)} to "
                         f"{max(map(len, stops), default=0)} characters)")
    return tuple(stops)


class StopStrings:
    """Cuts streamed text at the first of some stop strings, which never reach the client: text that could be
    the start of a stop string is held back until the next piece shows whether it is."""

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("a stop string cannot be empty")
        self.stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of held + `text` that is certainly reply text; after a stop string, nothing more."""
        if self.stopped:
            return ""
        buffer = self._held + text
        cuts = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped, self._held = True, ""
            return buffer[:min(cuts)]
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if buffer.endswith(stop[:k]):
                    hold = k
                    break
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold]

    def flush(self) -> str:
        """At the natural end: what was held back was reply text after all."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held


class StopStringDecoder:
    """A token stream decoder whose text is cut at the first of some stop strings (`StopStrings`, as the OpenAI
    API cuts its replies); `stopped` tells `decode` to end the reply there."""

    def __init__(self, decoder, stops: tuple[str, ...]):
        self.decoder = decoder
        self.stops = StopStrings(stops)

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    def feed(self, token_id: int) -> str:
        return self.stops.feed(self.decoder.feed(token_id))

    def flush(self) -> str:
        return self.stops.feed(self.decoder.flush()) + self.stops.flush()
