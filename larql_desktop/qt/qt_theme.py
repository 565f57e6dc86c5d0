"""The app's look: dark and light Fusion palettes (headless Qt cannot see the system colour scheme, so the app
picks one) and its icon."""
from __future__ import annotations

from importlib import resources

from PySide6.QtGui import QColor, QIcon, QPalette, QPixmap
from PySide6.QtWidgets import QApplication

_DARK = {
    QPalette.Window: "#2b2b2b", QPalette.WindowText: "#e6e6e6", QPalette.Base: "#1e1e1e",
    QPalette.AlternateBase: "#2f2f2f", QPalette.ToolTipBase: "#3a3a3a", QPalette.ToolTipText: "#e6e6e6",
    QPalette.PlaceholderText: "#8c8c8c", QPalette.Text: "#e6e6e6", QPalette.Button: "#353535",
    QPalette.ButtonText: "#e6e6e6", QPalette.BrightText: "#ff6b6b", QPalette.Link: "#6cb4ff",
    QPalette.Highlight: "#2f6db5", QPalette.HighlightedText: "#ffffff", QPalette.Mid: "#5a5a5a",
}
_LIGHT = {
    QPalette.Window: "#efefef", QPalette.WindowText: "#1a1a1a", QPalette.Base: "#ffffff",
    QPalette.AlternateBase: "#f5f5f5", QPalette.ToolTipBase: "#ffffdc", QPalette.ToolTipText: "#1a1a1a",
    QPalette.PlaceholderText: "#7a7a7a", QPalette.Text: "#1a1a1a", QPalette.Button: "#e8e8e8",
    QPalette.ButtonText: "#1a1a1a", QPalette.BrightText: "#c00000", QPalette.Link: "#0b5cad",
    QPalette.Highlight: "#3a7bd5", QPalette.HighlightedText: "#ffffff", QPalette.Mid: "#b0b0b0",
}
_DISABLED_TEXT = {True: "#7a7a7a", False: "#a0a0a0"}


def fusion_palette(dark: bool) -> QPalette:
    palette = QPalette()
    for role, colour in (_DARK if dark else _LIGHT).items():
        palette.setColor(role, QColor(colour))
    for role in (QPalette.WindowText, QPalette.Text, QPalette.ButtonText):
        palette.setColor(QPalette.Disabled, role, QColor(_DISABLED_TEXT[dark]))
    return palette


def apply_theme(app: QApplication, dark: bool) -> None:
    app.setStyle("Fusion")
    app.setPalette(fusion_palette(dark))


def app_icon() -> QIcon:
    """The application icon, read from the package's own resources (a wheel and the desktop build carry it)."""
    data = resources.files("larql_desktop").joinpath("resources", "larql-desktop.png").read_bytes()
    pixmap = QPixmap()
    pixmap.loadFromData(data, "PNG")
    return QIcon(pixmap)
