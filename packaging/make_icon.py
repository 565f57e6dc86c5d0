"""Draws the application icon (larql_desktop/resources/larql-desktop.png): layers of FFN features, one cached cell lit."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QRectF, Qt  # noqa: E402
from PySide6.QtGui import QBrush, QColor, QGuiApplication, QImage, QLinearGradient, QPainter, QPen  # noqa: E402


def draw(size: int = 256) -> QImage:
    image = QImage(size, size, QImage.Format_ARGB32)
    image.fill(Qt.transparent)
    p = QPainter(image)
    p.setRenderHint(QPainter.Antialiasing)
    gradient = QLinearGradient(0, 0, 0, size)
    gradient.setColorAt(0, QColor("#1f2a44"))
    gradient.setColorAt(1, QColor("#0e1424"))
    p.setBrush(QBrush(gradient))
    p.setPen(Qt.NoPen)
    p.drawRoundedRect(QRectF(8, 8, size - 16, size - 16), size * 0.18, size * 0.18)
    rows, cols = 4, 6
    cell = (size - 64) / cols
    for r in range(rows):
        for c in range(cols):
            lit = (r, c) in {(0, 1), (1, 3), (2, 2), (3, 4)}
            hit = (r, c) == (2, 2)
            color = QColor("#ffb547") if hit else QColor("#4fc3f7") if lit else QColor("#2f3d5c")
            p.setBrush(color)
            p.setPen(QPen(QColor("#0e1424"), 2))
            p.drawRoundedRect(QRectF(32 + c * cell, 40 + r * (cell + 10), cell - 6, cell - 6), 6, 6)
    p.end()
    return image


def main() -> int:
    app = QGuiApplication.instance() or QGuiApplication(sys.argv)
    out = Path(__file__).resolve().parents[1] / "larql_desktop" / "resources" / "larql-desktop.png"
    ok = draw().save(str(out))
    del app
    print(out if ok else "failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
