"""Screenshots of the real app at 1280x800, on SmolLM2, offscreen: the window, the chat, the reply map, the logit
lens, the cache monitor and the patch editor.

    python packaging/screenshots.py [--out docs/screenshots] [--dark]

Starts the app as `larql-desktop` would (its own engine thread, the packaged model), sends a prompt in one chat
and the same prompt in a second (so the shared L2 cache hits), INSERTs (Atlantis, capital-of, Poseidon) from
the patch editor, asks about Atlantis in a new chat with the replies shaded by where the INSERT fired, opens the
reply map and the logit lens of the answer's first token, and saves PNGs of the window and of each panel. App
files (settings, ONNX exports) go to a temporary home unless LARQL_DESKTOP_HOME is set.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dark", action="store_true", help="use the dark theme")
    args = parser.parse_args(argv)

    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ.setdefault("LARQL_DESKTOP_HOME", tempfile.mkdtemp(prefix="larql-desktop-screens-"))
    sys.path.insert(0, str(ROOT))

    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from larql_desktop.engine.paths import AppPaths
    from larql_desktop.qt.app import open_persistent_cache
    from larql_desktop.qt.main_window import MainWindow
    from larql_desktop.qt.worker import EngineClient

    app = QApplication.instance() or QApplication(sys.argv[:1])
    paths = AppPaths.from_environment().ensure()
    l3, _ = open_persistent_cache(paths)   # as the app does: the persistent L3 in the (temporary) cache dir
    client = EngineClient(paths, threads=2, l3=l3)
    settings = QSettings(str(paths.config / "screenshots.ini"), QSettings.IniFormat)
    settings.clear()
    window = MainWindow(client, settings, app)
    window.set_dark_theme(args.dark)
    window.resize(1280, 800)
    window.show()
    window.reset_layout()

    def wait(condition, what: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}")
            if window.error_banner.text:
                raise SystemExit(f"the app reported an error while waiting for {what}: {window.error_banner.text}")
            app.processEvents()
            time.sleep(0.02)

    def settle(seconds: float = 0.3) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            app.processEvents()
            time.sleep(0.02)

    def ask(text: str, max_tokens: int = 40) -> None:
        window.sampling.max_tokens.setValue(max_tokens)
        window.current_tab().input.setPlainText(text)
        window.send_action.trigger()
        wait(lambda: client.generating_session is not None, "the reply to start")
        wait(lambda: client.generating_session is None, "the reply")

    try:
        window.load_model(args.model)
        wait(lambda: client.model is not None, "the model")
        # Verify a share of hits so the fidelity chart has something to show.
        window.monitor.verify.setValue(0.5)
        window.monitor.apply()
        prompt = "How many legs does a spider have? Answer in two sentences."
        ask(prompt)
        window.new_chat()
        ask(prompt)
        editor = window.patch_editor
        window.patch_editor_dock.raise_()
        editor.entity.setText("Atlantis")
        editor.relation.setText("capital-of")
        editor.target.setText("Poseidon")
        editor.paraphrases.setPlainText("Atlantis has its capital at\nThe city that rules Atlantis is")
        editor.insert()
        wait(lambda: editor.last_insert is not None and not editor.busy, "the INSERT", timeout=1800.0)
        editor.patch_list.setCurrentItem(editor.patch_list.topLevelItem(0))
        settle()
        args.out.mkdir(parents=True, exist_ok=True)

        def save(name: str, widget) -> None:
            settle()
            path = args.out / name
            if not widget.grab().save(str(path), "PNG"):
                raise SystemExit(f"could not write {path}")
            print(path)

        save("patch-editor.png", window.patch_editor_dock)
        window.monitor.refresh(force=True)
        save("cache-monitor.png", window.monitor_dock)

        # The inserted fact answered in a new chat, the reply shaded by where the INSERT fired, its reply map.
        window.new_chat()
        window.reply_map_dock.raise_()
        window.set_shading("insert")
        ask("What is the capital of Atlantis?", max_tokens=24)
        wait(lambda: window.reply_map.fired is not None, "the reply's analysis")
        settle(0.5)
        save("window.png", window)
        save("reply-map.png", window.reply_map_dock)
        window.set_shading("probability")
        save("chat.png", window.centralWidget())

        # The logit lens of the answer's first word: where, layer by layer, the inserted target becomes the top.
        tab = window.current_tab()
        reply = max(i for i, t in enumerate(tab.transcript.turns) if t.role == "assistant")
        tokens = tab.transcript.turns[reply].tokens
        first_word = next((i for i, e in enumerate(tokens) if "Pose" in e.text), 0)
        window.show_tokens(tab, reply, first_word)
        window.token_view.show_lens()
        wait(lambda: window.token_view.lens.lens is not None, "the logit lens")
        save("logit-lens.png", window.token_dock)
    finally:
        window.close()
        if l3 is not None:
            l3.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
