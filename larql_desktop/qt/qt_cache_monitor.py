"""The cache monitor: live charts of the FFN cache and, in a tab of their own, the controls that change it.

Stats events only update the MonitorModel; a QTimer copies the model into plot items created once
(`setData`/`setOpts`) at REFRESH_HZ, and only when something changed and the panel is visible.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QSettings, Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QGridLayout, QGroupBox,
                               QHBoxLayout, QLabel, QPushButton, QScrollArea, QSizePolicy, QSpinBox, QTabWidget,
                               QVBoxLayout, QWidget)

from larql_desktop.engine.cache.near_miss import COSINE_EDGES, OVERLAP_EDGES, describe as describe_near_misses
from larql_desktop.engine.cache.keys import default_top_k
from larql_desktop.engine.cache.stats import OUTCOMES, TIERS
from larql_desktop.engine.cache.tiers import POLICIES, TierSettings
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.cache.l3 import L3Settings
from larql_desktop.engine.model.prefix_cache import PrefixCacheStats
from larql_desktop.qt.cache_monitor_model import MonitorModel, stats_csv, stats_json
from larql_desktop.engine.core import CacheSettings
from larql_desktop.qt.protocol import CacheStatsEvent, ClearCaches, ConfigureCache, ModelInfo, ResetStats
from larql_desktop.qt.qt_collapse_lab import CollapseLab
from larql_desktop.qt.qt_frontier import FrontierView
from larql_desktop.qt.worker import EngineClient

REFRESH_HZ = 20
# While a reply streams the charts redraw at this rate: a redraw of the six plots (their axes above all) takes the
# GUI thread tens of ms of Python, which at 20 Hz held the GIL and a core against the decode (the app decoded at
# ~40% of the headless speed; at 1 Hz still ~0.85x).
STREAMING_REFRESH_HZ = 0.5
# ... or less often, where a redraw costs more: while a reply streams, the charts' redraws take at most this share
# of the GUI thread (measured: its CPU from a redraw's start until COST_WINDOW_S later, the setData, the scene's
# update and the paint). On a host where a redraw took 150-250 ms (Gemma's replies lasting 2-3 s), two each
# reply cost the decode 10-15%.
STREAMING_CPU_SHARE = 0.03
COST_WINDOW_S = 0.5
STREAMING_MAX_INTERVAL_S = 10.0   # a long reply still shows its progress on the slowest machine
# L1 (per chat), L2 (per process) and the persistent L3 (when the app has a store: on by default).
CHART_TIERS = tuple(t for t in TIERS if t in ("L1", "L2", "L3"))
TIER_COLOURS = dict(zip(CHART_TIERS, ("#3a7bd5", "#e8871e", "#17a398")))
OUTCOME_COLOURS = {"hit": "#2ca02c", "miss": "#d62728", "bypass": "#9467bd", "dense": "#7f7f7f"}
BAR_COLOURS = {**{f"{t} hits": c for t, c in TIER_COLOURS.items()}, "misses": "#d62728", "bypasses": "#9467bd"}
# Tier names alone (the title says these are hits): the key line then fits a column at the default window size.
# Patched layers are shaded behind their bars; the summary line names them (a sixth key would not fit).
BAR_KEYS = {**TIER_COLOURS, "miss": "#d62728", "bypass": "#9467bd"}
# Near-miss view: per layer the hit rate, and for the explained misses the mean nearest cosine and overlap, the
# share a guard at tau would have served, and the overlap two random K-sets have (K/F).
NEAR_COLOURS = {"hits": "#2ca02c", "cosine": "#3a7bd5", "overlap": "#e8871e", "served": "#9467bd",
                "K/F": "#7f7f7f"}
PATCHED_COLOUR = (255, 200, 0, 70)
# The time charts' x axis: seconds since the model loaded, at least this span (a 7-token reply alone filled the
# axis, which then read "14.6 14.8 15.0 15.2"), at most the last MAX_TIME_SPAN_S (older points scroll out).
MIN_TIME_SPAN_S = 30.0
MAX_TIME_SPAN_S = 600.0
TIME_AXIS_LABEL = "s since the model loaded"


def _settings_value(store: QSettings, key: str, kind, default):
    value = store.value(key)
    if value is None:
        return default
    if kind is bool:
        return str(value).lower() == "true"
    try:
        return kind(value)
    except (TypeError, ValueError):
        return default


class TierControls:
    """One tier's three controls; the panel lays the tiers out side by side."""

    def __init__(self, name: str):
        self.name = name
        self.enabled = QCheckBox("on")
        self.enabled.setAccessibleName(f"{name} cache enabled")
        self.capacity = QSpinBox(minimum=1, maximum=10_000_000, singleStep=256)
        self.capacity.setAccessibleName(f"{name} capacity")
        self.capacity.setToolTip("Keys per layer")
        self.policy = QComboBox()
        self.policy.addItems(POLICIES)
        self.policy.setAccessibleName(f"{name} eviction policy")
        self.policy.setToolTip("drop: a full layer refuses new keys (the seed); lru: evicts the least recently used")
        self.set_settings(TierSettings())

    def settings(self) -> TierSettings:
        return TierSettings(self.enabled.isChecked(), self.capacity.value(), self.policy.currentText())

    def set_settings(self, s: TierSettings) -> None:
        self.enabled.setChecked(s.enabled)
        self.capacity.setValue(s.capacity)
        self.policy.setCurrentText(s.policy)


class CacheMonitor(QWidget):
    """Chart views in tabs, the last tab the settings and actions; the summary under them. `model` holds the
    data the charts show."""

    error = Signal(str)   # a message for the window's error banner

    def __init__(self, client: EngineClient, parent: QWidget | None = None):
        super().__init__(parent)
        self.client = client
        self.model = MonitorModel()
        # Per plot its title, colour key and the title markup last set; per bar item the (x, y0, height) last
        # drawn: kept here rather than as attributes put on pyqtgraph's objects.
        self._titles: dict[pg.PlotItem, tuple[str, str]] = {}
        self._title_html: dict[pg.PlotItem, str] = {}
        self._shown: dict[pg.BarGraphItem, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._drawn = -1
        self._refreshed_at = 0.0
        self._redraw_cpu_from: float | None = None   # the GUI thread's CPU time when a streaming redraw began
        self.redraw_cost = 0.0                       # the last streaming redraw's, in CPU seconds
        self._last_dir = str(Path.home())
        self._time_range: tuple[float, float] | None = None   # the time charts' x range, last set
        self._build_charts()
        self._build_controls()
        # The settings and actions are a tab beside the chart views: as a column beside the charts they took a
        # third of the dock, and at 1280x800 each of the six charts was ~160 px wide.
        self.settings_page = QWidget()
        self.settings_page.setAccessibleName("Cache settings and actions")
        page = QVBoxLayout(self.settings_page)
        page.setContentsMargins(0, 4, 0, 0)
        page.addWidget(self.controls_area, 1)
        page.addWidget(self.buttons)
        self.chart_tabs.addTab(self.settings_page, "Settings")
        self.chart_view = self.charts   # the chart view shown last: what "Export charts" saves
        self.chart_tabs.currentChanged.connect(self._on_tab_change)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.chart_tabs, 1)
        layout.addWidget(self.summary)
        client.stats.connect(self._on_stats)
        client.model_loaded.connect(self._on_model_loaded)
        client.busy_changed.connect(self._update_enabled)
        self.timer = QTimer(self)
        self.timer.setInterval(1000 // REFRESH_HZ)
        self.timer.timeout.connect(self._on_timer)
        self.timer.start()
        self._update_enabled()

    # --- construction ---

    def _plot(self, row: int, col: int, title: str, left: str, bottom: str, keys: dict[str, str],
              charts: pg.GraphicsLayoutWidget | None = None) -> pg.PlotItem:
        """A plot whose title carries its colour key (a legend would cover the data in plots this small)."""
        plot = (charts if charts is not None else self.charts).addPlot(row=row, col=col)
        plot.setLabel("left", left)
        plot.setLabel("bottom", bottom)
        plot.showGrid(x=True, y=True, alpha=0.25)
        plot.setMenuEnabled(False)
        for axis in ("left", "bottom"):
            # An axis that shrinks back whenever its longest tick label gets shorter re-lays out the whole chart
            # view, and each relayout is another paint of all six charts (tens of ms of the GUI thread, taken
            # from a decode that shares its two cores): grown once, an axis keeps its room.
            plot.getAxis(axis).setStyle(autoReduceTextSpace=False)
        label = plot.titleLabel
        # LabelItem makes its text's width the column's minimum on every change; in a panel this narrow a long
        # title would push the last column out of view, so only the height is kept as a minimum.
        label.updateMin = lambda: label.setMinimumHeight(label.item.boundingRect().height())
        self._titles[plot] = (title, " ".join(f"<span style='color:{colour}'>&#9632;&nbsp;{name}</span>"
                                              for name, colour in keys.items()))
        self._set_title(plot, title)
        return plot

    def _set_title(self, plot: pg.PlotItem, title: str) -> None:
        keys = self._titles[plot][1]
        self._titles[plot] = (title, keys)
        html = (f"<span style='color:{self._text_colour}'>{title}</span><br>"
                f"<span style='font-size:7.5pt'>{keys}</span>")
        if self._title_html.get(plot) != html:   # a new title re-lays out (and repaints) every plot
            self._title_html[plot] = html
            plot.setTitle(html, size="10pt")

    def _line(self, plot: pg.PlotItem, name: str, colour: str, width: float = 2) -> pg.PlotDataItem:
        # Small dots as well as lines: an interval with data between two without shows as a point.
        item = plot.plot([], [], name=name, pen=pg.mkPen(colour, width=width), connect="finite",
                         symbol="o", symbolSize=4, symbolPen=None, symbolBrush=colour)
        item.setDownsampling(auto=True, method="peak")
        item.setClipToView(True)
        return item

    def _bar_stack(self, plot: pg.PlotItem, colours: dict[str, str]) -> dict[str, pg.BarGraphItem]:
        """One stacked bar per layer, a segment per series (bottom to top in the order given)."""
        stack = {}
        for name, colour in colours.items():
            item = pg.BarGraphItem(x=np.zeros(0), height=np.zeros(0), width=0.75, brush=colour, pen=None)
            plot.addItem(item)
            stack[name] = item
        return stack

    def _set_stack(self, plot: pg.PlotItem, stack: dict[str, pg.BarGraphItem], x: np.ndarray,
                   heights: dict[str, np.ndarray]) -> float:
        base = np.zeros_like(x)
        for name, bars in stack.items():
            h = np.asarray(heights[name], dtype=float)
            shown = self._shown.get(bars)   # (x, y0, height) last drawn: only what changed is repainted
            if shown is None or not all(np.array_equal(a, b) for a, b in zip(shown, (x, base, h))):
                bars.setOpts(x=x, y0=base.copy(), height=h)
                self._shown[bars] = (x.copy(), base.copy(), h.copy())
            base = base + h
        top = max(float(base.max(initial=0.0)), 1.0)
        plot.setYRange(0, top * 1.08, padding=0)
        return top

    def _build_charts(self) -> None:
        self._text_colour = "#1a1a1a"
        self.charts = pg.GraphicsLayoutWidget()
        self.charts.setAccessibleName("Cache charts")
        # With the view tabs above them the charts keep the panel's minimum height as it was without tabs.
        self.charts.setMinimumSize(240, 72)
        self.charts.ci.setSpacing(4)
        self.hit_plot = self._plot(0, 0, "Hit rate", "hit rate", TIME_AXIS_LABEL, TIER_COLOURS)
        self.hit_plot.setYRange(0, 1.15, padding=0)
        self.hit_lines = {t: self._line(self.hit_plot, t, TIER_COLOURS[t]) for t in CHART_TIERS}
        self.latency_plot = self._plot(0, 1, "FFN latency (median)", "µs", TIME_AXIS_LABEL, OUTCOME_COLOURS)
        self.latency_plot.setLogMode(y=True)   # hits take tens of µs, prefill calls tens of ms
        # Decades only (pyqtgraph's minor log labels pile up in a plot this small).
        self.latency_plot.getAxis("left").setTicks(
            [[(k, f"{10 ** k:,.0f}") for k in range(0, 8)], []])
        self.latency_lines = {o: self._line(self.latency_plot, o, OUTCOME_COLOURS.get(o, "#7f7f7f"))
                              for o in OUTCOMES}
        self.fidelity_plot = self._plot(0, 2, "Hit fidelity (verify)", "cosine", TIME_AXIS_LABEL,
                                        {"mean": "#2ca02c", "min": "#d62728"})
        self.fidelity_lines = {"mean_cosine": self._line(self.fidelity_plot, "mean", "#2ca02c"),
                               "min_cosine": self._line(self.fidelity_plot, "min", "#d62728", 1)}
        # One time range for the three time charts (refresh sets it on the hit rate's).
        for plot in (self.latency_plot, self.fidelity_plot):
            plot.setXLink(self.hit_plot)
        self._set_time_range(np.zeros(0))
        self.layer_plot = self._plot(1, 0, "Calls per layer", "calls", "layer", BAR_KEYS)
        # Patched layers: a shaded column behind their bars, drawn first so the counts stay on top.
        self.patched_bars = pg.BarGraphItem(x=np.zeros(0), height=np.zeros(0), width=0.95,
                                            brush=pg.mkBrush(PATCHED_COLOUR), pen=pg.mkPen("#c89600", width=1.5))
        self.layer_plot.addItem(self.patched_bars)
        self.layer_bars = self._bar_stack(self.layer_plot, BAR_COLOURS)
        self.entries_plot = self._plot(1, 1, "Entries per layer", "entries", "layer", TIER_COLOURS)
        self.entry_bars = self._bar_stack(self.entries_plot, TIER_COLOURS)
        self.memory_plot = self._plot(1, 2, "Bytes per layer", "KiB", "layer", TIER_COLOURS)
        self.memory_bars = self._bar_stack(self.memory_plot, TIER_COLOURS)
        self._build_near_miss_charts()
        self.chart_tabs = QTabWidget()
        self.chart_tabs.setAccessibleName("Cache chart views")
        self.chart_tabs.setDocumentMode(True)
        self.chart_tabs.addTab(self.charts, "Live")
        self.chart_tabs.addTab(self.near_view, "Near misses per layer")
        self.frontier = FrontierView(self.client)
        self.frontier.error.connect(self.error)
        self.chart_tabs.addTab(self.frontier, "Frontier")
        # The lab sits with the monitor's views: a dock of its own would add a tab bar to the bottom area and
        # raise the window's minimum height.
        self.collapse_lab = CollapseLab(self.client)
        self.collapse_lab.error.connect(self.error)
        self.chart_tabs.addTab(self.collapse_lab, "Collapse lab")
        self.summary = QLabel("No statistics yet: load a model and send a prompt.")
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.summary.setAccessibleName("Cache summary")

    def _heatmap(self, plot: pg.PlotItem) -> pg.ImageItem:
        image = pg.ImageItem(axisOrder="row-major")
        image.setColorMap(pg.colormap.get("viridis"))
        plot.addItem(image)
        return image

    def _build_near_miss_charts(self) -> None:
        """Per layer, next to the hit rate: how near the explained misses came to a stored entry."""
        self.near_charts = pg.GraphicsLayoutWidget()
        self.near_charts.setAccessibleName("Near-miss charts")
        self.near_charts.setMinimumSize(240, 72)
        self.near_charts.ci.setSpacing(4)
        self.near_plot = self._plot(0, 0, "Hits · nearest entry of misses", "share", "layer",
                                    NEAR_COLOURS, charts=self.near_charts)
        self.near_plot.setYRange(0, 1.05, padding=0)
        self.near_lines = {name: self._line(self.near_plot, name, colour) for name, colour in NEAR_COLOURS.items()
                           if name != "K/F"}
        self.near_baseline = pg.InfiniteLine(angle=0, pen=pg.mkPen(NEAR_COLOURS["K/F"], width=1.5,
                                                                   style=Qt.DashLine))
        self.near_plot.addItem(self.near_baseline)
        self.overlap_map_plot = self._plot(0, 1, "Nearest overlap", "|A∩B|/K", "layer", {},
                                           charts=self.near_charts)
        self.overlap_map = self._heatmap(self.overlap_map_plot)
        self.cosine_map_plot = self._plot(0, 2, "Nearest cosine", "cosine ≥", "layer", {},
                                          charts=self.near_charts)
        self.cosine_map = self._heatmap(self.cosine_map_plot)
        # Cosine bins are finer near 1: rows are bins, each labelled by its lower edge.
        self.cosine_map_plot.getAxis("left").setTicks([[(i, f"{edge:g}") for i, edge in enumerate(COSINE_EDGES[:-1])],
                                                       []])
        self.near_charts.ci.layout.setColumnStretchFactor(0, 3)
        for col in (1, 2):
            self.near_charts.ci.layout.setColumnStretchFactor(col, 2)
        self.near_summary = QLabel("No statistics yet: load a model and send a prompt.")
        self.near_summary.setWordWrap(True)
        self.near_summary.setAccessibleName("Near-miss summary")
        self.near_view = QWidget()
        column = QVBoxLayout(self.near_view)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.near_charts, 1)
        column.addWidget(self.near_summary)

    def _build_controls(self) -> None:
        self.l1 = TierControls("L1")
        self.l2 = TierControls("L2")
        # The persistent L3 is the tier grid's third column: enabled, size cap (it evicts least recently used
        # entries by bytes, not keys per layer) and fp16 storage.
        self.l3_enabled = QCheckBox("on")
        self.l3_enabled.setAccessibleName("L3 cache enabled")
        self.l3_enabled.setToolTip("Consult and fill the persistent cache after L2 (it survives restarts)")
        self.l3_max_mb = QSpinBox(minimum=1, maximum=1 << 24, singleStep=64, suffix=" MiB")
        self.l3_max_mb.setAccessibleName("L3 size cap")
        self.l3_max_mb.setToolTip("L3 size cap: least recently used entries are evicted beyond it")
        self.l3_fp16 = QCheckBox("fp16")
        self.l3_fp16.setAccessibleName("L3 stores fp16")
        self.l3_fp16.setToolTip("L3 evicts least recently used entries; fp16 values take half the bytes, "
                                "at a small rounding error")
        self.l3_where = QLabel()
        self.l3_where.setAccessibleName("L3 location")
        self.l3_where.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.clear_l3_button = QPushButton("Clear L3")
        self.clear_l3_button.setAccessibleName("Clear persistent cache")
        self.clear_l3_button.setToolTip("Clear the persistent cache: empty the L3 store on disk (and L1, L2)")
        self.clear_l3_button.clicked.connect(self.clear_persistent)
        self._set_l3_settings(L3Settings())
        walk = QGroupBox("Walk FFN")
        self.dense = QCheckBox("Dense FFN (no walk, no cache)")
        self.dense.setAccessibleName("Dense FFN")
        self.top_k = QSpinBox(minimum=0, maximum=1_000_000, singleStep=64)
        self.top_k.setSpecialValueText("79% (seed)")
        self.top_k.setAccessibleName("K")
        self.top_k.setToolTip("Features per layer in the walk; K at 80% or more of the layer runs dense")
        self.key_width = QSpinBox(minimum=0, maximum=1_000_000)
        self.key_width.setSpecialValueText("= K")
        self.key_width.setAccessibleName("Key width")
        self.key_width.setToolTip("k': how many of the strongest selected features make the cache key")
        self.guard = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.001, decimals=4)
        self.guard.setSpecialValueText("off")
        self.guard.setAccessibleName("Cosine guard")
        self.guard.setToolTip("Approximate hits: this cosine between the stored and the current FFN input, and "
                              "norms within 5%. Off: a hit needs the same input (within 0.1%)")
        self.verify = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.05, decimals=2)
        self.verify.setAccessibleName("Verify fraction")
        self.verify.setToolTip("Share of hits recomputed to measure the error a hit carries")
        form = QFormLayout(walk)
        form.addRow(self.dense)
        form.addRow("K", self.top_k)
        form.addRow("Key width k'", self.key_width)
        form.addRow("Cosine guard", self.guard)
        form.addRow("Verify fraction", self.verify)
        self.near_fraction = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.05, decimals=2)
        self.near_fraction.setSpecialValueText("off")
        self.near_fraction.setAccessibleName("Explain misses")
        self.near_fraction.setToolTip("Share of misses compared with every stored entry of their layer (nearest by "
                                      "feature overlap and by cosine); its time is capped at 5% of the misses'")
        self.near_tau = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.001, decimals=4)
        self.near_tau.setValue(WalkSettings().near_miss_tau)
        self.near_tau.setAccessibleName("Near-miss tau")
        self.near_tau.setToolTip("Would a cosine guard at this tau have served the miss? (the cosine guard's "
                                 "own tau when it is on)")
        form.addRow("Explain misses", self.near_fraction)
        form.addRow("Near-miss tau", self.near_tau)
        self.apply_button = QPushButton("Apply settings")
        self.apply_button.setAccessibleName("Apply cache settings")
        self.apply_button.clicked.connect(self.apply)
        self.clear_button = QPushButton("Clear caches")
        self.clear_button.setAccessibleName("Clear caches")
        self.clear_button.clicked.connect(self.clear_caches)
        self.reset_button = QPushButton("Reset stats")
        self.reset_button.setAccessibleName("Reset statistics")
        self.reset_button.clicked.connect(self.reset_stats)
        self.export_stats_button = QPushButton("Export stats…")
        self.export_stats_button.setAccessibleName("Export statistics")
        self.export_stats_button.setToolTip("JSON (everything) or CSV (one row per layer)")
        self.export_stats_button.clicked.connect(self._on_export_stats)
        self.export_charts_button = QPushButton("Export charts…")
        self.export_charts_button.setAccessibleName("Export charts")
        self.export_charts_button.setToolTip("A PNG image of the charts")
        self.export_charts_button.clicked.connect(self._on_export_charts)
        tiers = QGroupBox("Cache tiers")
        grid = QGridLayout(tiers)
        for col, tier in enumerate((self.l1, self.l2), start=1):
            grid.addWidget(QLabel(f"<b>{tier.name}</b>"), 0, col, Qt.AlignHCenter)
            grid.addWidget(tier.enabled, 1, col)
            grid.addWidget(tier.capacity, 2, col)
            grid.addWidget(tier.policy, 3, col)
        for row, text in enumerate(("Enabled", "Capacity", "Eviction"), start=1):
            grid.addWidget(QLabel(text), row, 0)
        # The persistent L3 under them: it has no per-layer capacity (a size cap, least recently used evicted).
        self.l3_header = QLabel("<b>L3</b> disk")
        self.l3_header.setToolTip("Persistent cache on disk, shared by every run of the app")
        grid.addWidget(self.l3_header, 4, 0)
        grid.addWidget(self.l3_enabled, 4, 1)
        grid.addWidget(self.l3_fp16, 4, 2)
        grid.addWidget(QLabel("Size cap"), 5, 0)
        grid.addWidget(self.l3_max_mb, 5, 1, 1, 2)
        grid.addWidget(self.l3_where, 6, 0, 1, 3)
        # Two rows of three: a column of six would raise the dock's (and so the window's) minimum height.
        buttons = QGridLayout()
        for i, button in enumerate((self.apply_button, self.reset_button, self.clear_button, self.clear_l3_button,
                                    self.export_stats_button, self.export_charts_button)):
            buttons.addWidget(button, i // 3, i % 3)
        # The walk and the tiers side by side: the tab has the dock's width, and its height is the charts'.
        box = QWidget()
        row = QHBoxLayout(box)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(walk, 0, Qt.AlignTop)
        row.addWidget(tiers, 0, Qt.AlignTop)
        row.addStretch(1)
        self.controls_area = QScrollArea()
        self.controls_area.setWidget(box)
        self.controls_area.setWidgetResizable(True)
        self.controls_area.setFrameShape(QScrollArea.NoFrame)
        self.controls_area.setAccessibleName("Cache settings")
        # The settings scroll: their tab (with the actions under them) is then no taller at its smallest than the
        # near-miss charts, and the window's minimum height stays as it was with the settings beside the charts.
        self.controls_area.setMinimumHeight(32)
        # The actions stay in view under the (scrolling) settings.
        self.buttons = QWidget()
        self.buttons.setLayout(buttons)
        buttons.setContentsMargins(0, 0, 0, 0)
        self.buttons.setSizePolicy(QSizePolicy.Preferred, QSizePolicy.Fixed)

    # --- settings ---

    def cache_settings(self) -> CacheSettings:
        """Raises ValueError for values the engine refuses."""
        walk = WalkSettings(top_k=self.top_k.value() or None, dense=self.dense.isChecked(),
                            key_width=self.key_width.value() or None,
                            cosine_guard=self.guard.value() or None, verify_fraction=self.verify.value(),
                            near_miss_fraction=self.near_fraction.value(), near_miss_tau=self.near_tau.value())
        l3 = L3Settings(self.l3_enabled.isChecked(), self.l3_max_mb.value() << 20,
                        "float16" if self.l3_fp16.isChecked() else "float32")
        return CacheSettings(walk, self.l1.settings(), self.l2.settings(), l3)

    def _set_l3_settings(self, s: L3Settings) -> None:
        self.l3_enabled.setChecked(s.enabled)
        self.l3_max_mb.setValue(max(1, s.max_bytes >> 20))
        self.l3_fp16.setChecked(s.dtype == "float16")

    def set_cache_settings(self, c: CacheSettings) -> None:
        w = c.walk
        self.dense.setChecked(w.dense)
        self.top_k.setValue(w.top_k or 0)
        self.key_width.setValue(w.key_width or 0)
        self.guard.setValue(w.cosine_guard or 0.0)
        self.verify.setValue(w.verify_fraction)
        self.near_fraction.setValue(w.near_miss_fraction)
        self.near_tau.setValue(w.near_miss_tau)
        self.l1.set_settings(c.l1)
        self.l2.set_settings(c.l2)
        self._set_l3_settings(c.l3)

    def save(self, store: QSettings, group: str = "cache") -> None:
        c = self.cache_settings()
        store.beginGroup(group)
        for key, value in (("dense", c.walk.dense), ("top_k", c.walk.top_k or 0), ("key_width", c.walk.key_width or 0),
                           ("cosine_guard", c.walk.cosine_guard or 0.0), ("verify", c.walk.verify_fraction),
                           ("near_miss", c.walk.near_miss_fraction), ("near_miss_tau", c.walk.near_miss_tau)):
            store.setValue(key, value)
        for name, t in (("l1", c.l1), ("l2", c.l2)):
            store.setValue(f"{name}_enabled", t.enabled)
            store.setValue(f"{name}_capacity", t.capacity)
            store.setValue(f"{name}_policy", t.policy)
        store.setValue("l3_enabled", c.l3.enabled)
        store.setValue("l3_max_mb", c.l3.max_bytes >> 20)
        store.setValue("l3_fp16", c.l3.dtype == "float16")
        store.setValue("last_dir", self._last_dir)
        store.endGroup()

    def restore(self, store: QSettings, group: str = "cache") -> None:
        store.beginGroup(group)
        try:
            walk = WalkSettings(top_k=_settings_value(store, "top_k", int, 0) or None,
                                dense=_settings_value(store, "dense", bool, False),
                                key_width=_settings_value(store, "key_width", int, 0) or None,
                                cosine_guard=_settings_value(store, "cosine_guard", float, 0.0) or None,
                                verify_fraction=_settings_value(store, "verify", float, 0.0),
                                near_miss_fraction=_settings_value(store, "near_miss", float, 0.0),
                                near_miss_tau=_settings_value(store, "near_miss_tau", float,
                                                              WalkSettings().near_miss_tau))
            tiers = [TierSettings(_settings_value(store, f"{n}_enabled", bool, True),
                                  _settings_value(store, f"{n}_capacity", int, TierSettings().capacity),
                                  _settings_value(store, f"{n}_policy", str, "drop")) for n in ("l1", "l2")]
            l3 = L3Settings(_settings_value(store, "l3_enabled", bool, True),
                            _settings_value(store, "l3_max_mb", int, L3Settings().max_bytes >> 20) << 20,
                            "float16" if _settings_value(store, "l3_fp16", bool, False) else "float32")
            self.set_cache_settings(CacheSettings(walk, *tiers, l3))
        except ValueError:
            self.set_cache_settings(CacheSettings())   # stored values the engine refuses: defaults
        self._last_dir = str(store.value("last_dir", self._last_dir))
        store.endGroup()

    # --- actions ---

    @Slot()
    def apply(self) -> None:
        try:
            settings = self.cache_settings()
        except ValueError as exc:
            self.error.emit(f"Cache settings: {exc}")
            return
        self.client.submit(ConfigureCache(self.client.next_request_id(), settings))

    @Slot()
    def clear_caches(self) -> None:
        self.client.submit(ClearCaches(self.client.next_request_id()))

    @Slot()
    def clear_persistent(self) -> None:
        self.client.submit(ClearCaches(self.client.next_request_id(), persistent=True))

    @Slot()
    def reset_stats(self) -> None:
        self.client.submit(ResetStats(self.client.next_request_id()))

    def export_stats(self, path: str | Path) -> Path:
        """JSON for a .json path, CSV (one row per layer) otherwise. Raises OSError or ValueError."""
        event = self.model.latest
        if event is None:
            raise ValueError("there are no statistics to export yet")
        path = Path(path)
        path.write_text(stats_json(event) if path.suffix.lower() == ".json" else stats_csv(event), encoding="utf-8")
        return path

    def export_charts(self, path: str | Path) -> Path:
        """A PNG of the chart view shown last (pyqtgraph's SVG export is broken on Qt 6.11+)."""
        self.refresh(force=True)
        path = Path(path)
        if not self.chart_view.grab().save(str(path), "PNG"):
            raise OSError(f"could not write {path}")
        return path

    def _ask_path(self, title: str, name: str, filters: str) -> str:
        path, _ = QFileDialog.getSaveFileName(self, title, str(Path(self._last_dir) / name), filters)
        if path:
            self._last_dir = str(Path(path).parent)
        return path

    @Slot()
    def _on_export_stats(self) -> None:
        path = self._ask_path("Export cache statistics", "cache-stats.json", "JSON (*.json);;CSV per layer (*.csv)")
        if path:
            try:
                self.export_stats(path)
            except (OSError, ValueError) as exc:
                self.error.emit(f"Exporting statistics: {exc}")

    @Slot()
    def _on_export_charts(self) -> None:
        path = self._ask_path("Export cache charts", "cache-charts.png", "PNG image (*.png)")
        if path:
            try:
                self.export_charts(path)
            except OSError as exc:
                self.error.emit(f"Exporting charts: {exc}")

    # --- updates ---

    @Slot(int)
    def _on_tab_change(self, index: int) -> None:
        if self.chart_tabs.widget(index) is not self.settings_page:
            self.chart_view = self.chart_tabs.widget(index)
        self.refresh(force=True)

    @Slot(object)
    def _on_model_loaded(self, info: ModelInfo) -> None:
        if info.intermediate:
            self.top_k.setMaximum(info.intermediate)
            self.key_width.setMaximum(info.intermediate)
        self.apply()   # the worker builds each new engine with the last settings; send the panel's own
        self._update_enabled()

    @Slot(object)
    def _on_stats(self, event: CacheStatsEvent) -> None:
        self.model.ingest(event)

    @Slot()
    def _update_enabled(self) -> None:
        loaded = self.client.model is not None
        for button in (self.clear_button, self.reset_button):
            button.setEnabled(loaded)
        has_l3 = self.client.l3 is not None
        for widget in (self.l3_enabled, self.l3_max_mb, self.l3_fp16, self.clear_l3_button):
            widget.setEnabled(has_l3)
        if not has_l3:
            self.l3_where.setText("L3: none in this run")
            self.l3_where.setToolTip("The app runs without a persistent cache (see the log file)")
        elif not self.l3_where.text():
            self._show_l3_status(self.client.l3.status())

    def _show_l3_status(self, status: dict) -> None:
        errors = status.get("errors") or {}
        name = Path(str(status.get("where", ""))).name or status.get("where", "")
        self.l3_where.setText(f"L3: {status.get('backend', '?')} · {name}" + (" · problems" if errors else ""))
        self.l3_where.setToolTip(_l3_where(status))

    @Slot()
    def _on_timer(self) -> None:
        if not self.isVisible():
            return
        now = time.monotonic()
        if self._redraw_cpu_from is not None and now - self._refreshed_at >= COST_WINDOW_S:
            self.redraw_cost = time.thread_time() - self._redraw_cpu_from
            self._redraw_cpu_from = None
        if self.model.version == self._drawn:
            return                                   # nothing new to draw
        streaming = self.client.generating_session is not None
        if streaming and (self._redraw_cpu_from is not None or now - self._refreshed_at < self.streaming_interval()):
            return
        self._refreshed_at = now
        if streaming:
            self._redraw_cpu_from = time.thread_time()
        self.refresh()

    def streaming_interval(self) -> float:
        """Seconds between the charts' redraws while a reply streams."""
        return min(STREAMING_MAX_INTERVAL_S, max(1 / STREAMING_REFRESH_HZ, self.redraw_cost / STREAMING_CPU_SHARE))

    def set_dark(self, dark: bool) -> None:
        self.charts.setBackground("#1e1e1e" if dark else "#ffffff")
        pen = pg.mkPen("#d0d0d0" if dark else "#303030")
        self.near_charts.setBackground("#1e1e1e" if dark else "#ffffff")
        for plot in self._all_plots():
            for axis in ("left", "bottom"):
                plot.getAxis(axis).setPen(pen)
                plot.getAxis(axis).setTextPen(pen)
        self._text_colour = "#e6e6e6" if dark else "#1a1a1a"
        for plot in self._all_plots():
            self._set_title(plot, self._titles[plot][0])
        self._drawn = -1

    def _all_plots(self) -> tuple:
        return (self.hit_plot, self.latency_plot, self.fidelity_plot, self.layer_plot, self.entries_plot,
                self.memory_plot, self.near_plot, self.overlap_map_plot, self.cosine_map_plot)

    def refresh(self, force: bool = False) -> None:
        """Copy the model into the plot items (a no-op if nothing changed since the last call)."""
        m = self.model
        if m.version == self._drawn and not force:
            return
        self._drawn = m.version
        for lines, history in ((self.hit_lines, m.hit_rate), (self.latency_lines, m.latency_us),
                               (self.fidelity_lines, m.fidelity)):
            for name, line in lines.items():
                y = history.column(name)
                if np.isfinite(y).any():
                    line.setData(history.t, y)
                elif line.xData is not None and len(line.xData):
                    line.setData([], [])   # an all-NaN series makes pyqtgraph warn about its bounds
        self._set_time_range(m.hit_rate.t)
        lowest = m.fidelity.column("min_cosine")
        lowest = float(np.nanmin(lowest)) if np.isfinite(lowest).any() else 1.0
        self.fidelity_plot.setYRange(min(0.99, lowest - 0.005), 1.004, padding=0)
        layers = m.per_layer()
        event = m.latest
        if event is None:
            return
        x = np.arange(event.n_layers, dtype=float)
        zeros = np.zeros(event.n_layers)
        top = self._set_stack(self.layer_plot, self.layer_bars, x,
                              {name: layers.get(name, zeros) for name in self.layer_bars})
        patched = np.array(event.patched_layers, dtype=float)
        self.patched_bars.setOpts(x=patched, height=np.full(patched.size, top * 1.08))
        self._set_stack(self.entries_plot, self.entry_bars, x,
                        {name: layers.get(f"{name} entries", zeros) for name in self.entry_bars})
        self._set_stack(self.memory_plot, self.memory_bars, x,
                        {name: layers.get(f"{name} KiB", zeros) for name in self.memory_bars})
        self._update_titles(event)
        self._refresh_near_misses(event)
        # pyqtgraph fits auto ranges (and so the axes' ticks) while it paints, which marks the axes for another
        # paint; settled here, the changes of this refresh reach the screen in one paint of each view.
        for view in (self.charts, self.near_charts):
            view.scene().prepareForPaint()

    def _set_time_range(self, t: np.ndarray) -> None:
        """Seconds since the model loaded, from 0 (or the last MAX_TIME_SPAN_S) to the newest point: at least
        MIN_TIME_SPAN_S wide, so the ticks are whole seconds even for one short reply."""
        end = max(float(t[-1]) if len(t) else 0.0, MIN_TIME_SPAN_S)
        shown = (max(0.0, end - MAX_TIME_SPAN_S), end)
        if self._time_range != shown:   # an unchanged range is not set again (a relayout)
            self._time_range = shown
            self.hit_plot.setXRange(*shown, padding=0.02)

    def _random_overlap(self, event: CacheStatsEvent) -> float | None:
        info = self.client.model
        if info is None or not info.intermediate or event.settings.walk.dense:
            return None
        k = event.settings.walk.top_k or default_top_k(info.intermediate)
        return min(k, info.intermediate) / info.intermediate

    def _refresh_near_misses(self, event: CacheStatsEvent) -> None:
        near = self.model.near_misses()
        if near is None:
            return
        x = np.arange(event.n_layers, dtype=float)
        for name, key in (("hits", "hit_rate"), ("cosine", "mean_cosine"), ("overlap", "mean_overlap"),
                          ("served", "served_rate")):
            y = np.asarray(near[key], dtype=float)
            if np.isfinite(y).any():
                self.near_lines[name].setData(x, y)
            else:
                self.near_lines[name].setData([], [])   # all-NaN series make pyqtgraph warn about bounds
        baseline = self._random_overlap(event)
        self.near_baseline.setVisible(baseline is not None)
        if baseline is not None:
            self.near_baseline.setValue(baseline)
        self.near_plot.setXRange(-0.5, event.n_layers - 0.5, padding=0)
        for image, plot, hist, edges in ((self.overlap_map, self.overlap_map_plot, near["overlap_hist"], OVERLAP_EDGES),
                                         (self.cosine_map, self.cosine_map_plot, near["cosine_hist"], COSINE_EDGES)):
            counts = np.asarray(hist, dtype=float).T               # (bins, layers)
            totals = counts.sum(axis=0, keepdims=True)
            share = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
            if image is self.overlap_map:                          # overlap rows sit at their value
                image.setImage(share, autoLevels=False, levels=(0, 1))
                image.setRect(-0.5, 0.0, event.n_layers, 1.0)
                plot.setRange(xRange=(-0.5, event.n_layers - 0.5), yRange=(0, 1), padding=0)
            else:                                                  # cosine rows are bins (finer near 1)
                image.setImage(share, autoLevels=False, levels=(0, 1))
                image.setRect(-0.5, -0.5, event.n_layers, len(edges) - 1)
                plot.setRange(xRange=(-0.5, event.n_layers - 0.5), yRange=(-0.5, len(edges) - 1.5), padding=0)
        self.near_summary.setText(describe_near_misses(event.process.near_miss, baseline))

    def _update_titles(self, event: CacheStatsEvent) -> None:
        # The byte totals go in the summary: in the chart's title they were cut at the default window size.
        text = summary_text(event)
        if text != self.summary.text():   # an unchanged text is not set again (it would re-lay out the panel)
            self.summary.setText(text)
            # Its lines come and go with the text (a new chat has no line of its own yet, numbers grow a digit):
            # a summary that got shorter would hand its room to the charts, a relayout that repaints them all.
            # It keeps the most room it has needed at its width.
            if self.summary.isVisible() and self.summary.width() > 0:
                needed = self.summary.heightForWidth(self.summary.width())
                if needed > self.summary.minimumHeight():
                    self.summary.setMinimumHeight(needed)
        if event.l3_status is not None:
            self._show_l3_status(event.l3_status)


def _scope_text(label: str, snap) -> str:
    tiers = " · ".join(f"{name} {100 * snap.tiers[name].hit_rate:.0f}% of "
                       f"{int(snap.tiers[name].hits.sum() + snap.tiers[name].misses.sum())}"
                       + ("" if snap.tiers[name].enabled else " (off)")
                       for name in snap.tiers if snap.tiers[name].enabled or name in CHART_TIERS)
    return (f"<b>{label}</b>: {snap.calls} FFN calls · {snap.lookups} decode lookups · hit rate {tiers} · "
            f"{snap.bypass_total} bypasses")


def _l3_where(status: dict) -> str:
    errors = status.get("errors") or {}
    problems = f" · problems: {', '.join(f'{k} ×{n}' for k, n in sorted(errors.items()))}" if errors else ""
    return f"{status.get('backend', '?')}: {status.get('where', '')}{problems}"


def summary_text(event: CacheStatsEvent) -> str:
    w = event.settings.walk
    mode = "dense FFN" if w.dense else (f"walk K={w.top_k or '79%'}" + (f", k'={w.key_width}" if w.key_width else "")
                                        + (f", guard {w.cosine_guard}" if w.cosine_guard else ""))
    lines = [_scope_text("All chats", event.process)]
    if event.session is not None:
        lines.append(_scope_text(f"Chat {event.session_id}", event.session))
    patched = ", ".join(map(str, event.patched_layers)) or "none"
    f = event.process.fidelity
    fidelity = (f"verified {f.checked} hits: cosine mean {f.mean_cosine:.6f}, min {f.min_cosine:.6f}, "
                f"max |error| {f.max_abs_error:.3g}, stale {f.max_stale_error:.3g}" if f.checked
                else "no hits verified (set a verify fraction)")
    tiers = event.process.tiers
    ram = sum(float(tiers[t].bytes.sum()) for t in ("L1", "L2") if t in tiers) / (1 << 20)
    lines.append(f"{mode} · RAM {ram:.1f} MiB · patched layers (shaded): {patched} · {fidelity}")
    l3 = event.process.tiers.get("L3")
    if event.l3_status is None:
        lines.append("L3: no persistent cache in this run")
    elif l3 is not None:
        state = "on" if event.l3_status.get("enabled") else "off"
        lines.append(f"L3 ({state}, {event.l3_status.get('backend', '?')}): {int(l3.entries.sum())} entries, "
                     f"{l3.bytes.sum() / (1 << 20):.1f} MiB on disk (every model's)")
    if event.prefix_cache is not None:
        lines.append(prefix_cache_text(event.prefix_cache))
    return "<br>".join(lines)


def prefix_cache_text(p: PrefixCacheStats) -> str:
    """The KV prefix cache's line: attention KV of prompts already run, which a prompt with the same start reuses
    instead of prefilling (beside the FFN tiers: it saves whole positions, not FFN calls)."""
    if p.max_bytes == 0:
        return "KV prefix cache: off"
    rate = f" ({100 * p.hits / p.lookups:.0f}% of {p.lookups} prompts)" if p.lookups else ""
    return (f"KV prefix cache: {_count(p.hits, 'hit')}, {_count(p.misses, 'miss', 'misses')}{rate} · "
            f"{_count(p.reused_tokens, 'token')} reused (not prefilled) · {_count(p.entries, 'entry', 'entries')}, "
            f"{p.bytes / (1 << 20):.1f} of {p.max_bytes / (1 << 20):.0f} MiB · {p.evictions} evicted")


def _count(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"
