"""`run_app`: builds the application's objects, wires them together and runs the event loop."""
from __future__ import annotations

import logging
import logging.handlers
import sys

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication

from ..engine.paths import AppPaths
from .main_window import MainWindow
from .worker import EngineClient

log = logging.getLogger(__name__)

LOG_FILE = "larql-desktop.log"
SETTINGS_FILE = "larql-desktop.ini"


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


def _log_uncaught(exc_type, exc, tb) -> None:
    # PySide prints exceptions raised in slots and carries on; keep them in the log file too.
    log.error("uncaught exception", exc_info=(exc_type, exc, tb))
    sys.__excepthook__(exc_type, exc, tb)


def run_app(args) -> int:
    paths = AppPaths.from_environment().ensure()
    log_handler = configure_logging(paths, getattr(args, "verbose", False))
    previous_hook, sys.excepthook = sys.excepthook, _log_uncaught
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("larql-desktop")
    app.setOrganizationName("larql-desktop")
    settings = open_settings(paths)
    client = EngineClient(paths, threads=args.threads)
    window = MainWindow(client, settings, app)
    window.show()
    window.load_model(args.model)
    log.info("started; settings in %s, logs in %s", settings.fileName(), paths.log)
    try:
        return app.exec()
    finally:
        client.shutdown()   # closeEvent already did this unless the loop ended another way
        sys.excepthook = previous_hook
        logging.getLogger().removeHandler(log_handler)
        log_handler.close()
