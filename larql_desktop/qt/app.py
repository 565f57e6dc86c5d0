"""`run_app`: builds the application's objects, wires them together and runs the event loop."""
from __future__ import annotations

import logging
import logging.handlers
import sys

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication

from larql_desktop.engine.cache.l3 import L3Store, open_l3
from larql_desktop.engine.catalog import DEFAULT_MODEL
from larql_desktop.engine.paths import AppPaths
from larql_desktop.engine.patches.insert.capture_store import CaptureStore
from larql_desktop.engine.patches.applied import AppliedPatchStore
from larql_desktop.qt.main_window import MainWindow
from larql_desktop.qt.qt_theme import app_icon
from larql_desktop.qt.worker import EngineClient

log = logging.getLogger(__name__)

LOG_FILE = "larql-desktop.log"
SETTINGS_FILE = "larql-desktop.ini"
GIL_SWITCH_INTERVAL = 0.0005   # seconds (Python's default: 0.005)
APPLIED_PATCHES_DIR = "patches"   # under AppPaths.data: each model's applied patches, restored on launch


def configure_logging(paths: AppPaths, verbose: bool) -> logging.Handler:
    """Log to a rotating file under AppPaths.log (next to the stderr handler the CLI set up)."""
    handler = logging.handlers.RotatingFileHandler(paths.log / LOG_FILE, maxBytes=2_000_000, backupCount=3,
                                                   encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s"))
    level = logging.DEBUG if verbose else logging.INFO
    handler.setLevel(level)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(min(root.level or logging.WARNING, level))
    for handler_ in root.handlers:   # the CLI's stderr handler keeps its own threshold
        if handler_ is not handler and handler_.level == logging.NOTSET:
            handler_.setLevel(logging.DEBUG if verbose else logging.WARNING)
    return handler


def open_settings(paths: AppPaths) -> QSettings:
    """An INI file under AppPaths.config, so LARQL_DESKTOP_HOME redirects settings like everything else."""
    return QSettings(str(paths.config / SETTINGS_FILE), QSettings.IniFormat)


def open_persistent_cache(paths: AppPaths, spec: str = "sqlite") -> tuple[L3Store | None, str | None]:
    """The app's L3 store (by default the SQLite file in the user cache dir) and a warning for the user, if any.

    The store repairs itself (a corrupt file is moved aside and rebuilt, a locked one skipped for a moment); when
    it cannot be opened at all the app runs without L3 and says so."""
    try:
        store = open_l3(spec, paths)
    except Exception as exc:   # noqa: BLE001 - an optimisation must never keep the app from starting
        log.warning("the persistent FFN cache could not be opened (%s); running without it", exc, exc_info=True)
        return None, f"the persistent FFN cache (L3) could not be opened: {exc}. The app runs without it."
    if store is None:
        return None, None
    errors = store.status().get("errors", {})
    if "unrecoverable" in errors:
        return store, (f"the persistent FFN cache (L3) at {store.where} cannot be used; the app runs without it "
                       "this time (details in the log file).")
    if "corrupt" in errors:
        return store, (f"the persistent FFN cache (L3) at {store.where} was damaged: it was moved aside and "
                       "started afresh.")
    if errors:
        return store, (f"the persistent FFN cache (L3) at {store.where} is busy or failing "
                       f"({', '.join(sorted(errors))}); it is skipped while that lasts (details in the log file).")
    return store, None


def build_main_window(app: QApplication, paths: AppPaths, settings: QSettings, threads: int, l3: L3Store | None,
                      serve=None, applied: AppliedPatchStore | None = None,
                      capture_store: CaptureStore | None = None) -> tuple[EngineClient, MainWindow]:
    """The engine client and the window as the app wires them (run_app, and `bench`'s app mode)."""
    # The engine thread gives up the GIL for every onnxruntime call (a few per layer) and needs it back after
    # each; at Python's default 5 ms switch interval a redraw in the GUI thread made it wait up to that long
    # each time. A shorter interval hands the GIL back sooner.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    applied = applied if applied is not None else AppliedPatchStore(paths.data / APPLIED_PATCHES_DIR)
    client = EngineClient(paths, threads=threads, l3=l3, serve=serve, applied=applied,
                          capture_store=capture_store)
    return client, MainWindow(client, settings, app)


def _log_uncaught(exc_type, exc, tb) -> None:
    # PySide prints exceptions raised in slots and carries on; keep them in the log file too.
    log.error("uncaught exception", exc_info=(exc_type, exc, tb))
    sys.__excepthook__(exc_type, exc, tb)


def run_app(args, serve=None) -> int:
    """`serve(engine, host, port)` starts the HTTP API on an engine (None: the app cannot serve)."""
    paths = AppPaths.from_environment().ensure()
    log_handler = configure_logging(paths, getattr(args, "verbose", False))
    previous_hook, sys.excepthook = sys.excepthook, _log_uncaught
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("larql-desktop")
    app.setOrganizationName("larql-desktop")
    app.setWindowIcon(app_icon())
    settings = open_settings(paths)
    l3, warning = open_persistent_cache(paths)
    captures = CaptureStore(paths.insert_captures)     # INSERT's passes between launches
    client, window = build_main_window(app, paths, settings, args.threads, l3, serve, capture_store=captures)
    window.show()
    if warning:
        window.show_warning(warning)
    # An explicit --model wins; otherwise the model the app ran last comes back.
    window.load_model(args.model if args.model != DEFAULT_MODEL else window.last_model(DEFAULT_MODEL))
    log.info("started; settings in %s, logs in %s, L3 %s", settings.fileName(), paths.log,
             l3.where if l3 is not None else "off")
    try:
        return app.exec()
    finally:
        window.server.shutdown()   # closeEvent already did these two unless the loop ended another way
        client.shutdown()
        captures.close()        # as the L3: after the engine thread has ended
        if l3 is not None:
            l3.close()          # after the engine thread has ended: nothing uses it any more
        sys.excepthook = previous_hook
        logging.getLogger().removeHandler(log_handler)
        log_handler.close()
