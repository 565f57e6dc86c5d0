"""`bench`'s `app` mode: the real window, offscreen, decoding as the user sees it.

The window and the engine thread are wired as run_app wires them (build_main_window), with the app's default
cache settings (walk FFN, L1 + L2 + a persistent SQLite L3), a fresh settings file, patch store and L3 file in a
temporary directory, and the cache monitor shown and redrawing. Every run starts from cold caches (L1, L2 and L3
cleared), opens a new chat, types the prompt and sends it; the figures are taken in the GUI thread when each
TokenEvent arrives there (what the user sees), beside the engine's own per-step forward times.

After each app run, the same generation runs headless (the `cold` mode's engine, without L3) in this process
while the window idles: `paired_cold` gives each app run's decode over its neighbour's, which a machine whose
load moves between the bench's processes cannot blur as much; and once more with an emptied SQLite L3 of its
own (the app's tiers, without the window), which separates what the window costs from what the L3 costs.

One untimed round comes first (a reply and its two neighbours; figures in `first_reply`): the process's first
reply pays one-time costs its neighbours would not.

The chat honours stop tokens, so a run may decode fewer than `tokens - 1` steps; its tok/s counts the steps it
decoded.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from larql_desktop.tools.bench import RunTiming, engine_for, greedy_run, peak_rss_bytes, summarise, worker_main

REPLY_TIMEOUT_S = 600.0
# The first reply of the process pays one-time costs (the engine thread's first bindings and arena growth, the
# window's first paints of a reply) that the headless runs after it do not: it ran at ~0.6x its neighbours where
# later replies ran at ~0.9-1.0x. So one round (a reply and its two headless neighbours) runs first and is
# reported apart, as `first_reply`.
# After each reply the window re-renders the chat, fills the token view and redraws the monitor: the headless
# neighbours start once that is done, so they do not pay for the window's work either.
SETTLE_S = 0.3


def _thread_cpu_seconds(name: str) -> float | None:
    """CPU time of the live thread called `name` (None where the platform cannot tell)."""
    thread = next((t for t in threading.enumerate() if t.name == name), None)
    if thread is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, OverflowError):
        return None


def run_app_worker(spec: dict) -> dict:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QEventLoop, QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from larql_desktop.engine.cache.l3 import SqliteL3
    from larql_desktop.engine.model.generation import SamplingSettings
    from larql_desktop.engine.patches.applied import AppliedPatchStore
    from larql_desktop.engine.paths import AppPaths
    from larql_desktop.qt.app import build_main_window
    from larql_desktop.qt.protocol import ClearCaches

    tokens, runs, prompt = spec["tokens"], spec["runs"], spec["prompt"]
    app = QApplication.instance() or QApplication(["larql-desktop-bench"])
    user_paths = AppPaths.from_environment().ensure()
    with tempfile.TemporaryDirectory(prefix="larql-bench-app-") as tmp:
        tmp_dir = Path(tmp)
        # The user's models and exported graphs; a data dir of its own (saved chats, patches), logs and config.
        paths = dataclasses.replace(user_paths, data=tmp_dir / "data", log=tmp_dir / "log",
                                    config=tmp_dir / "config").ensure()
        paths.models_dir.symlink_to(user_paths.models_dir.resolve(), target_is_directory=True)
        l3 = SqliteL3(tmp_dir / "l3.sqlite3")
        settings = QSettings(str(tmp_dir / "settings.ini"), QSettings.IniFormat)
        client, window = build_main_window(app, paths, settings, spec["threads"], l3,
                                           applied=AppliedPatchStore(tmp_dir / "patches"))
        try:
            window.show()

            def settle(seconds: float) -> None:
                """Run the event loop for `seconds`: the window finishes what a reply's end set off."""
                loop = QEventLoop()
                QTimer.singleShot(int(seconds * 1000), loop.quit)
                loop.exec()

            def wait_for(signal, what: str):
                """Run the event loop until `signal` fires; returns its argument."""
                loop, got = QEventLoop(), []

                def on_signal(*args):
                    got.append(args[0] if args else None)
                    loop.quit()
                signal.connect(on_signal)
                timer = QTimer()
                timer.setSingleShot(True)
                timer.timeout.connect(loop.quit)
                timer.start(int(REPLY_TIMEOUT_S * 1000))
                try:
                    loop.exec()
                finally:
                    signal.disconnect(on_signal)
                    timer.stop()
                if not got:
                    raise TimeoutError(f"the app did not {what} within {REPLY_TIMEOUT_S:.0f} s")
                return got[0]

            errors = []
            client.error.connect(lambda report: errors.append(report.describe()))
            window.load_model(spec["model"])
            info = wait_for(client.model_loaded, "load the model")
            loaded_at = time.time()
            rss_after_load = peak_rss_bytes()
            window.sampling.set_settings(SamplingSettings(max_tokens=tokens))   # greedy
            timings: list[RunTiming] = []
            engine_decode: list[float] = []
            all_tokens: list[list[int]] = []
            process_first_token = None
            cpu_ms: dict[str, list[float]] = {"gui": [], "gui-decoding": [], "engine": [], "l3-writer": []}
            paired: list[dict] = []
            paired_l3: list[dict] = []
            headless_l3 = SqliteL3(tmp_dir / "headless-l3.sqlite3")
            for _ in range(runs + 1):   # the first round warms up (see WARM_UP) and is reported apart
                client.submit(ClearCaches(client.next_request_id(), persistent=True))
                wait_for(client.stats, "clear its caches")
                tab = window.new_chat()
                wait_for(client.stats, "switch to the new chat")
                tab.input.setPlainText(prompt)
                arrivals: list[tuple[float, object]] = []
                gui_cpu_at: list[float] = []   # the GUI thread's CPU time at each token's arrival

                def on_token(event, arrivals=arrivals, gui_cpu_at=gui_cpu_at):
                    arrivals.append((time.perf_counter(), event))
                    gui_cpu_at.append(time.thread_time())
                client.token.connect(on_token)
                cpu_before = {"gui": time.thread_time(), "engine": _thread_cpu_seconds("engine"),
                              "l3-writer": _thread_cpu_seconds("l3-writer")}
                submitted = time.perf_counter()
                window.send()
                try:
                    finished = wait_for(client.reply_finished, "finish a reply")
                finally:
                    client.token.disconnect(on_token)
                cpu_after = {"gui": time.thread_time(), "engine": _thread_cpu_seconds("engine"),
                             "l3-writer": _thread_cpu_seconds("l3-writer")}
                if errors:
                    raise RuntimeError(f"the app reported: {errors[0]}")
                events = [e for _, e in arrivals if not e.is_stop]
                if len(events) < 2:
                    raise RuntimeError(f"the reply had {len(events)} token(s); the bench needs a prompt with a "
                                       "longer answer")
                first, last = arrivals[0][0], arrivals[len(events) - 1][0]
                # What the GUI thread spent while the reply decoded (first to last token): the part of its work
                # that competes with the decode, apart from the reply's start and end.
                cpu_ms["gui-decoding"].append(1000 * (gui_cpu_at[len(events) - 1] - gui_cpu_at[0])
                                              / max(1, len(events) - 1))
                if process_first_token is None:
                    process_first_token = time.time() - (time.perf_counter() - first) - spec["spawned_at"]
                decode_steps = len(events) - 1
                timings.append(RunTiming(events[0].prompt_tokens, events[0].seconds, first - submitted,
                                         decode_steps, last - first, [e.token_id for e in events], 0.0))
                engine_decode.append(decode_steps / sum(e.seconds for e in events[1:]))
                all_tokens.append([e.token_id for e in events])
                for name, after in cpu_after.items():   # CPU per generated token: what the load cannot blur
                    if after is not None:
                        cpu_ms[name].append(1000 * (after - (cpu_before[name] or 0.0)) / len(events))
                del finished
                settle(SETTLE_S)
                # The reply's queued L3 writes land between replies (SqliteL3 waits for a quiet moment): let
                # them finish before the headless runs, as a user's next question would.
                l3.flush(REPLY_TIMEOUT_S)
                # The headless `cold` run beside it, in this process on the same loaded model while the window
                # idles: on a machine whose load moves, a ratio of neighbours is what can be compared.
                model = client.worker.model
                engine = engine_for(model, "cold")
                session = engine.new_session()
                paired.append(greedy_run(model, session.kv, session.ffn, prompt, len(events)).to_dict())
                engine.close_session(session)
                # And with a persistent tier as the app's (emptied): what the L3 itself costs, apart from the GUI.
                headless_l3.clear()
                engine = engine_for(model, "cold", l3=headless_l3)
                session = engine.new_session()
                paired_l3.append(greedy_run(model, session.kv, session.ffn, prompt, len(events)).to_dict())
                engine.close_session(session)
                headless_l3.flush(REPLY_TIMEOUT_S)
            first_reply = {"decode_tok_s": timings[0].decode_steps / timings[0].decode_seconds,
                           "engine_decode_tok_s": engine_decode[0], "paired_cold_decode_tok_s": paired[0]["decode_tok_s"],
                           "paired_cold_l3_decode_tok_s": paired_l3[0]["decode_tok_s"]}
            for figures in (timings, engine_decode, all_tokens, paired, paired_l3, *cpu_ms.values()):
                del figures[0]
            result = {"mode": "app", "load_seconds": info.load_seconds,
                      "load_from_process_start_s": loaded_at - spec["spawned_at"], "first_reply": first_reply}
            result.update(summarise(timings))
            result["engine_decode_tok_s"] = sorted(engine_decode)[len(engine_decode) // 2]
            result["engine_decode_tok_s_runs"] = engine_decode   # in run order, beside the runs' own
            ratios = sorted(t.decode_steps / t.decode_seconds / p["decode_tok_s"] for t, p in zip(timings, paired))
            ratios_l3 = sorted(t.decode_steps / t.decode_seconds / p["decode_tok_s"]
                               for t, p in zip(timings, paired_l3))
            headless_l3.close()
            result["paired_cold"] = {"decode_tok_s": [p["decode_tok_s"] for p in paired],
                                     "app_over_cold_median": ratios[len(ratios) // 2],
                                     "app_over_cold": ratios,
                                     "decode_tok_s_l3": [p["decode_tok_s"] for p in paired_l3],
                                     "app_over_cold_l3_median": ratios_l3[len(ratios_l3) // 2],
                                     "app_over_cold_l3": ratios_l3}
            result["cpu_ms_per_token"] = {name: sorted(v)[len(v) // 2] for name, v in cpu_ms.items() if v}
            result["ttft_process_s"] = process_first_token
            result["tokens"] = all_tokens[0]
            result["identical_runs"] = all(t == all_tokens[0] for t in all_tokens)
            stats = client.worker.engine.snapshot() if client.worker.engine is not None else None
            if stats is not None:
                result["cache"] = {"lookups": int(stats.lookups), "hits": int(stats.hits),
                                   "hit_rate": stats.hits / stats.lookups if stats.lookups else None}
            result["l3_status"] = {k: v for k, v in l3.status().items() if k in ("errors", "enabled")}
            result["rss_after_load_mb"] = rss_after_load / 2**20 if rss_after_load else None
            peak = peak_rss_bytes()
            result["peak_rss_mb"] = peak / 2**20 if peak else None
            return result
        finally:
            window.close()      # saves settings (into the temporary file), ends the engine thread
            l3.close()


if __name__ == "__main__":   # python -m larql_desktop.qt.bench_app SPEC.json OUT.json (run by `bench`)
    sys.exit(worker_main(sys.argv[1:], {"app": run_app_worker}))
