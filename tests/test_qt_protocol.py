"""The Qt layer's plain-Python parts: stats wording, transcripts, stored settings, the request/snapshot types."""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from larql_desktop.engine.generation import SamplingSettings, TokenStep
from larql_desktop.qt.protocol import SendPrompt, TokenEvent
from larql_desktop.qt.reply_stats import (COMPLETE, LENGTH, STOPPED, ReplyStats, ReplyStatsBuilder,
                                          format_load_progress, format_reply_stats)
from larql_desktop.qt.transcript import ASSISTANT, USER, Transcript


def steps(n: int, stop: bool):
    out = [TokenStep(10, "a", 0, 0.5, 12, False)]
    out += [TokenStep(11 + i, "b", i + 1, 0.1, 1, False) for i in range(n - 1)]
    if stop:
        out.append(TokenStep(2, "", n, 0.1, 1, True))
    return out


def test_stats_count_reply_tokens_and_decode_rate():
    builder = ReplyStatsBuilder()
    for step in steps(5, stop=True):
        builder.add(step)
    stats = builder.finish(builder.natural_outcome())
    assert stats.outcome == COMPLETE
    assert stats.tokens == 5 and stats.prompt_tokens == 12 and stats.prefill_seconds == 0.5
    assert stats.decode_tokens == 5 and stats.tokens_per_second == pytest.approx(10.0)
    assert format_reply_stats(stats) == "5 tokens · 10.0 tok/s · prefill 0.50 s (12 prompt tokens)"


def test_stats_without_a_stop_token_hit_the_length_limit():
    builder = ReplyStatsBuilder()
    for step in steps(3, stop=False):
        builder.add(step)
    assert builder.natural_outcome() == LENGTH
    assert format_reply_stats(builder.finish(LENGTH)).endswith("reached max tokens")


def test_a_one_token_reply_has_no_rate():
    stats = ReplyStats(1, 4, 0.2, 0, 0.0, STOPPED)
    assert math.isnan(stats.tokens_per_second)
    assert format_reply_stats(stats) == "1 token · – tok/s · prefill 0.20 s (4 prompt tokens) · stopped"


def test_load_progress_wording_clamps_the_fraction():
    assert format_load_progress("Exporting", 0.256) == "Exporting (26%)"
    assert format_load_progress("Done", 1.7) == "Done (100%)"


def test_transcript_finishing_adds_a_held_back_tail():
    transcript = Transcript()
    transcript.add_user("hi")
    transcript.start_reply()
    assert transcript.streaming and not transcript.can_regenerate
    transcript.append("caf")
    missing = transcript.finish_reply("café", ReplyStats(2, 3, 0.1, 1, 0.1, COMPLETE))
    assert missing == "é" and transcript.last.text == "café"
    assert transcript.can_regenerate and "tok/s" in transcript.last.footer
    transcript.drop_last_reply()
    assert [t.role for t in transcript.turns] == [USER]
    transcript.drop_last_reply()   # only replies are dropped
    assert [t.role for t in transcript.turns] == [USER]
    assert ASSISTANT != USER


def test_requests_and_snapshots_are_frozen():
    request = SendPrompt(1, 2, "hello", SamplingSettings())
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.text = "changed"
    event = TokenEvent.from_step(1, 2, TokenStep(5, "x", 0, 0.1, 3, False))
    assert (event.request_id, event.session_id, event.token_id, event.text) == (1, 2, 5, "x")
    assert SendPrompt(1, 2, "a", SamplingSettings()) == SendPrompt(1, 2, "a", SamplingSettings())   # cancel not compared


def test_plain_modules_of_the_qt_package_do_not_import_qt():
    code = ("import sys; import larql_desktop.qt.protocol, larql_desktop.qt.reply_stats, "
            "larql_desktop.qt.transcript; print(any(m.startswith('PySide6') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_stored_sampling_falls_back_to_defaults():
    pytest.importorskip("PySide6")
    from larql_desktop.qt.qt_sampling_panel import stored_sampling

    assert stored_sampling({"max_tokens": "64", "temperature": "0.7", "top_p": "0.9", "seed": "-1"}) == \
        SamplingSettings(64, 0.7, 0.9, None)
    assert stored_sampling({"max_tokens": "junk", "seed": "5"}) == SamplingSettings(seed=5)
    assert stored_sampling({"top_p": "7"}) == SamplingSettings()
