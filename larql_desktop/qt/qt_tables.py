"""The read-only result tables the panels share (token view, feature view, collapse lab, frontier)."""
from __future__ import annotations

from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget


def read_only_table(headers: list[str], name: str, *, stretch: bool = True,
                    row_height: int | None = None) -> QTableWidget:
    """An empty table with these column headers, no row numbers and no editing; `stretch` shares the width
    among the columns, `row_height` makes rows compact (more of them in view)."""
    table = QTableWidget(0, len(headers))
    table.setHorizontalHeaderLabels(headers)
    table.setAccessibleName(name)
    table.setEditTriggers(QAbstractItemView.NoEditTriggers)
    table.verticalHeader().hide()
    if row_height is not None:
        table.verticalHeader().setDefaultSectionSize(row_height)
    if stretch:
        table.horizontalHeader().setSectionResizeMode(QHeaderView.Stretch)
    return table
