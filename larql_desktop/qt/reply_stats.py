"""Statistics of one streamed reply, and how the UI words them. Plain Python: no Qt, no numpy."""
from __future__ import annotations

import math
from dataclasses import dataclass

from larql_desktop.engine.cache.stats import CacheCounts  # noqa: F401  (re-exported: the reply stats carry it)
from larql_desktop.engine.model.generation import TokenStep

# Why a reply ended.
COMPLETE = "complete"   # the model produced a stop token
LENGTH = "length"       # max tokens or the context limit
STOPPED = "stopped"     # the user pressed Stop (or the app closed)
FAILED = "error"        # an exception ended it


@dataclass(frozen=True)
class ReplyStats:
    tokens: int             # reply tokens, the stop token excluded
    prompt_tokens: int      # tokens run in the prefill pass (only the part the KV cache did not hold)
    prefill_seconds: float  # the first forward pass, which also produces the first token
    decode_tokens: int      # tokens after the first, each one forward pass
    decode_seconds: float
    outcome: str
    cache: CacheCounts | None = None   # None when the reply ran without a cache engine

    @property
    def tokens_per_second(self) -> float:
        """Decode rate; NaN until a second token has been generated."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else math.nan


class ReplyStatsBuilder:
    """Accumulates TokenSteps as they stream; `finish` freezes them into a ReplyStats."""

    def __init__(self) -> None:
        self.tokens = 0
        self.prompt_tokens = 0
        self.prefill_seconds = 0.0
        self.decode_tokens = 0
        self.decode_seconds = 0.0
        self.saw_stop = False

    def add(self, step: TokenStep) -> None:
        if step.index == 0:
            self.prompt_tokens = step.prompt_tokens
            self.prefill_seconds = step.seconds
        else:
            self.decode_tokens += 1
            self.decode_seconds += step.seconds
        if step.is_stop:
            self.saw_stop = True
        else:
            self.tokens += 1

    def natural_outcome(self) -> str:
        """How a generator that ran to its end finished."""
        return COMPLETE if self.saw_stop else LENGTH

    def finish(self, outcome: str, cache: CacheCounts | None = None) -> ReplyStats:
        return ReplyStats(self.tokens, self.prompt_tokens, self.prefill_seconds, self.decode_tokens,
                          self.decode_seconds, outcome, cache)


_OUTCOME_NOTES = {COMPLETE: "", LENGTH: " · reached max tokens", STOPPED: " · stopped", FAILED: " · failed"}


def format_reply_stats(stats: ReplyStats) -> str:
    """The lines shown under a reply, e.g. '42 tokens · 28.3 tok/s · prefill 0.12 s (35 prompt tokens)',
    then, when a cache engine ran it, what the FFN cache did (see `format_cache_counts`)."""
    rate = stats.tokens_per_second
    rate_text = f"{rate:.1f} tok/s" if math.isfinite(rate) else "– tok/s"
    noun = "token" if stats.tokens == 1 else "tokens"
    line = (f"{stats.tokens} {noun} · {rate_text} · prefill {stats.prefill_seconds:.2f} s "
            f"({stats.prompt_tokens} prompt tokens){_OUTCOME_NOTES.get(stats.outcome, '')}")
    return line if stats.cache is None else f"{line}\n{format_cache_counts(stats.cache)}"


def format_cache_counts(c: CacheCounts) -> str:
    """E.g. 'FFN cache: L1 0 hits / 330 misses · L2 330 hits / 0 misses · 30 bypasses (prefill 30)'.
    Tiers nothing reached (a disabled one, or one after a tier that hit every time) are left out, except
    that L1 and L2 always show once any lookup happened."""
    parts = []
    if any(h or m for _, h, m in c.tiers):
        parts += [f"{name} {h} hits / {m} misses" for name, h, m in c.tiers if h or m or name in ("L1", "L2")]
    if c.bypasses:
        reasons = ", ".join(f"{reason.replace('_', ' ')} {n}" for reason, n in c.bypasses)
        parts.append(f"{c.bypass_total} bypasses ({reasons})")
    if c.dense_calls and not parts:
        return f"dense FFN: {c.dense_calls} calls, no cache"
    return "FFN cache: " + (" · ".join(parts) if parts else "no calls")


def format_load_progress(message: str, fraction: float) -> str:
    return f"{message} ({max(0.0, min(1.0, fraction)) * 100:.0f}%)"
