"""How a reply's tokens are shaded in the chat: the measures, their colour bins and legends, and each token's
tooltip. Plain data (colours as '#rrggbb'), so the rules are read and tested without a widget.

Shading is applied when a reply has ended (the streaming text stays plain, so it costs the stream nothing) and only
when the user picks a measure (View > Shade replies by, or the toolbar): a shaded reply shows its tokens as text,
not rendered Markdown.
"""
from __future__ import annotations

import html
from typing import Sequence

NONE, PROBABILITY, CACHE, INSERT = "none", "probability", "cache", "insert"
MEASURES = {NONE: "Plain (Markdown)", PROBABILITY: "Probability", CACHE: "Cache hits over layers",
            INSERT: "INSERT fired"}

# (upper bound, colour, legend label), in order: the first bin whose bound exceeds the value.
PROBABILITY_BINS = ((0.1, "#f4a3a3", "P < 0.1"), (0.3, "#f8c9a0", "0.1–0.3"), (0.5, "#f6e7a1", "0.3–0.5"),
                    (0.8, "#cfe8a9", "0.5–0.8"), (float("inf"), "#a5d6a7", "P ≥ 0.8"))
NOT_IN_TOP = ("#e0a0e0", "not in the top 5")       # sampled from outside the top alternatives
CACHE_BINS = ((1e-9, "#e6e6e6", "no hit"), (0.5, "#cfe3f5", "< half the layers hit"),
              (1.0, "#8fc1ec", "half or more"), (float("inf"), "#4f9ad8", "every layer hit"))
FIRED = ("#f5b971", "an INSERTed feature fired")


def chosen_probability(event) -> float | None:
    """The sampled token's probability among the step's top alternatives; None if it was not among them."""
    return next((a.probability for a in event.alternatives if a.token_id == event.token_id), None)


def hit_fraction(event) -> float | None:
    """The share of the pass's layers served from a cache tier (None: no outcomes recorded)."""
    if not event.layers:
        return None
    return sum(o.outcome == "hit" for o in event.layers) / len(event.layers)


def _binned(value: float, bins) -> str:
    return next(colour for bound, colour, _ in bins if value < bound)


def shade(event, measure: str, fired_layers: Sequence[int] = ()) -> str | None:
    """The background of a token under `measure` (None: unshaded)."""
    if measure == PROBABILITY:
        if not event.alternatives:
            return None
        p = chosen_probability(event)
        return NOT_IN_TOP[0] if p is None else _binned(p, PROBABILITY_BINS)
    if measure == CACHE:
        fraction = hit_fraction(event)
        return None if fraction is None else _binned(fraction, CACHE_BINS)
    if measure == INSERT:
        return FIRED[0] if fired_layers else None
    return None


def legend(measure: str) -> tuple[tuple[str, str], ...]:
    """(colour, label) of each shade `measure` uses."""
    if measure == PROBABILITY:
        return tuple((c, label) for _, c, label in PROBABILITY_BINS) + (NOT_IN_TOP,)
    if measure == CACHE:
        return tuple((c, label) for _, c, label in CACHE_BINS)
    if measure == INSERT:
        return (FIRED, ("#ffffff", "no INSERT fired"))
    return ()


def legend_html(measure: str) -> str:
    return " ".join(f"<span style='background:{c}; color:black'>&nbsp;{html.escape(label)}&nbsp;</span>"
                    for c, label in legend(measure))


def visible(text: str) -> str:
    return text.replace("\n", "\\n").replace("\t", "\\t") if text.strip() else repr(text)


def token_tooltip(event, fired_layers: Sequence[int] = ()) -> str:
    """The token, its probability, the top alternatives and what the cache did (rich text)."""
    p = chosen_probability(event)
    lines = [f"<b>{html.escape(visible(event.text))}</b> [{event.token_id}]"
             + (f" · P = {p:.3f}" if p is not None else " · not in the top 5" if event.alternatives else "")]
    for a in event.alternatives:
        mark = "▶ " if a.token_id == event.token_id else "&nbsp;&nbsp;&nbsp;"
        lines.append(f"{mark}{html.escape(visible(a.text))} &nbsp;{a.probability:.3f}")
    fraction = hit_fraction(event)
    if fraction is not None:
        lines.append(f"cache: {round(fraction * len(event.layers))} of {len(event.layers)} layers hit")
    if fired_layers:
        lines.append(f"INSERT fired at layer{'s' if len(fired_layers) > 1 else ''} "
                     f"{', '.join(map(str, fired_layers))}")
    lines.append("<i>click: inspect in the token view</i>")
    return "<br>".join(lines)
