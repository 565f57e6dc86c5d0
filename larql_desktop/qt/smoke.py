"""The Qt half of `--self-test`: Qt's platform plugin and pyqtgraph load and draw (offscreen unless set)."""
from __future__ import annotations

import os


def qt_smoke_test() -> str:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import pyqtgraph
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])
    plot = pyqtgraph.PlotWidget()
    plot.plot([0, 1, 2], [1, 0, 1])
    plot.show()
    app.processEvents()
    plot.close()
    return app.platformName()
