"""The main window: chat tabs, model picker, the tool panels (sampling, cache monitor, patch editor), status.
Wiring and layout; the engine is elsewhere."""
from __future__ import annotations

import itertools
import logging
from pathlib import Path

from PySide6.QtCore import QSettings, Qt, Slot
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (QApplication, QCheckBox, QComboBox, QDockWidget, QFileDialog, QFrame, QHBoxLayout,
                               QLabel, QMainWindow, QProgressBar, QPushButton, QSpinBox, QTabWidget, QToolButton,
                               QVBoxLayout, QWidget)

from larql_desktop.engine.catalog import PACKAGED_MODELS
from larql_desktop.qt.protocol import (EngineActivity, ErrorReport, ModelInfo, ReplyFinished, ReplyStarted, RequestStats,
                                       TokenEvent)
from larql_desktop.qt.qt_cache_monitor import CacheMonitor
from larql_desktop.qt.qt_chat_tab import ChatTab
from larql_desktop.qt.qt_collapse_lab import CollapseLab
from larql_desktop.qt.qt_patch_editor import PatchEditor
from larql_desktop.qt.qt_sampling_panel import SamplingPanel
from larql_desktop.qt.qt_theme import app_icon, apply_theme
from larql_desktop.qt.reply_stats import format_load_progress, format_reply_stats
from larql_desktop.engine.services import DEFAULT_API_HOST, DEFAULT_API_PORT
from larql_desktop.qt.server_control import ServerController
from larql_desktop.qt.worker import EngineClient


log = logging.getLogger(__name__)

OPEN_GGUF = "__open_gguf__"   # the model picker's "Open GGUF file…" entry


class ErrorBanner(QFrame):
    """A dismissable line above the chats: errors stay visible until read, without a modal dialog."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("errorBanner")
        self.setStyleSheet("#errorBanner { background: #8b1e1e; border-radius: 3px; } "
                           "#errorBanner QLabel { color: white; }")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.label.setAccessibleName("Error message")
        dismiss = QPushButton("Dismiss")
        dismiss.setAccessibleName("Dismiss error")
        dismiss.clicked.connect(self.clear)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(8, 4, 4, 4)
        layout.addWidget(self.label, 1)
        layout.addWidget(dismiss)
        self.hide()

    @property
    def text(self) -> str:
        return self.label.text() if not self.isHidden() else ""

    def show_message(self, text: str) -> None:
        self.label.setText(text)
        self.show()

    def clear(self) -> None:
        self.label.clear()
        self.hide()


class MainWindow(QMainWindow):
    def __init__(self, client: EngineClient, settings: QSettings, app: QApplication):
        super().__init__()
        self.client = client
        self.settings = settings
        self.app = app
        self._session_ids = itertools.count(1)
        self._closed = False
        self.setWindowTitle("larql-desktop")
        self.setWindowIcon(app_icon())
        self.setObjectName("mainWindow")

        self._build_actions()
        self._build_menus()
        self.sampling = SamplingPanel()
        self.sampling_dock = self.add_panel("Sampling", self.sampling, shortcut="Ctrl+Shift+S")
        self.patch_editor = PatchEditor(client)
        self.patch_editor_dock = self.add_panel("Patch editor", self.patch_editor, shortcut="Ctrl+Shift+P")
        self.monitor = CacheMonitor(client)
        self.monitor_dock = self.add_panel("Cache monitor", self.monitor, Qt.BottomDockWidgetArea,
                                           shortcut="Ctrl+Shift+M")
        self.collapse_lab = CollapseLab(client)
        self.collapse_lab_dock = self.add_panel("Collapse lab", self.collapse_lab, Qt.BottomDockWidgetArea)
        self.monitor_dock.raise_()   # the monitor stays the bottom area's first view
        for panel in (self.patch_editor, self.monitor, self.collapse_lab):
            panel.error.connect(self.show_error)
        # The right-hand panels run the full height; the monitor sits under the chats.
        self.setCorner(Qt.BottomRightCorner, Qt.RightDockWidgetArea)
        self._build_model_picker()
        self._build_central()
        self._build_status_bar()
        self.server = ServerController(client, parent=self)
        self.server.changed.connect(self._on_server_changed)
        self.serve_action.toggled.connect(self._on_serve_toggled)
        # HTTP clients move the statistics while the window sits idle: the worker forwards the engine's events
        # and the window asks for one snapshot at a time (patch changes arrive as events of their own).
        self._stats_outstanding = False
        client.event.connect(self._on_engine_activity)
        client.stats.connect(self._on_stats_arrived)

        client.model_loaded.connect(self._on_model_loaded)
        client.load_progress.connect(self._on_load_progress)
        client.reply_started.connect(self._on_reply_started)
        client.token.connect(self._on_token)
        client.reply_finished.connect(self._on_reply_finished)
        client.error.connect(self._on_error)
        client.busy_changed.connect(self._update_actions)

        self._restore_settings()
        self.new_chat()
        self._update_actions()

    # --- construction ---

    def _action(self, text: str, slot, shortcuts=(), tip: str = "") -> QAction:
        action = QAction(text, self)
        if shortcuts:
            action.setShortcuts([QKeySequence(s) for s in shortcuts])
        action.setToolTip(f"{tip or text.replace('&', '').rstrip('…')}"
                          + (f" ({QKeySequence(shortcuts[0]).toString()})" if shortcuts else ""))
        action.triggered.connect(slot)
        self.addAction(action)   # shortcuts work whether or not a menu bar is shown
        return action

    def _build_actions(self) -> None:
        self.new_chat_action = self._action("&New chat", self.new_chat, ["Ctrl+N"])
        self.close_chat_action = self._action("&Close chat", lambda: self.close_chat(self.tabs.currentIndex()),
                                              ["Ctrl+W"])
        self.open_gguf_action = self._action("&Open GGUF file…", self.open_gguf, ["Ctrl+O"])
        # QKeySequence.Quit is empty on some platforms (offscreen among them): bind Ctrl+Q explicitly.
        self.quit_action = self._action("&Quit", self.close, ["Ctrl+Q"])
        self.send_action = self._action("&Send", self.send, ["Ctrl+Return", "Ctrl+Enter"], "Send the message")
        self.stop_action = self._action("S&top", self.stop, ["Esc"], "Stop the reply")
        self.regenerate_action = self._action("&Regenerate", self.regenerate, ["Ctrl+R"],
                                              "Generate the last reply again")
        self.dark_theme_action = self._action("&Dark theme", self.set_dark_theme)
        self.dark_theme_action.setCheckable(True)
        # Connected to _on_serve_toggled once the controller exists (restoring the setting may check it).
        self.serve_action = self._action(f"Serve HTTP &API on {DEFAULT_API_HOST}", lambda: None,
                                         tip="Serve the loaded model's walk FFN, cache statistics and patches "
                                             "over HTTP (the same L2 cache as the chats)")
        self.serve_action.setCheckable(True)

    def _build_menus(self) -> None:
        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        for action in (self.new_chat_action, self.close_chat_action, self.open_gguf_action):
            file_menu.addAction(action)
        file_menu.addSeparator()
        file_menu.addAction(self.quit_action)
        chat_menu = bar.addMenu("&Chat")
        for action in (self.send_action, self.stop_action, self.regenerate_action):
            chat_menu.addAction(action)
        view_menu = bar.addMenu("&View")
        view_menu.addAction(self.dark_theme_action)
        self.panels_menu = view_menu.addMenu("&Panels")
        server_menu = bar.addMenu("&Server")
        server_menu.addAction(self.serve_action)

    def _build_model_picker(self) -> None:
        toolbar = self.addToolBar("Model")
        toolbar.setObjectName("modelToolbar")
        label = QLabel("Model: ")
        self.model_picker = QComboBox()
        self.model_picker.setAccessibleName("Model")
        self.model_picker.setToolTip("The model the chats run on")
        label.setBuddy(self.model_picker)
        for key, spec in PACKAGED_MODELS.items():
            self.model_picker.addItem(spec.display_name, key)
        self.model_picker.insertSeparator(self.model_picker.count())
        self.model_picker.addItem("Open GGUF file…", OPEN_GGUF)
        self.model_picker.setCurrentIndex(-1)
        self.model_picker.activated.connect(self._on_model_picked)   # user choices only, not setCurrentIndex
        toolbar.addWidget(label)
        toolbar.addWidget(self.model_picker)

    def _build_central(self) -> None:
        self.error_banner = ErrorBanner()
        self.tabs = QTabWidget()
        self.tabs.setAccessibleName("Chats")
        self.tabs.setTabsClosable(True)
        self.tabs.setMovable(True)
        self.tabs.setDocumentMode(True)
        self.tabs.tabCloseRequested.connect(self.close_chat)
        self.tabs.currentChanged.connect(self._update_actions)
        self.tabs.currentChanged.connect(self._on_current_chat_changed)
        plus = QToolButton()
        plus.setDefaultAction(self.new_chat_action)
        plus.setText("+")
        plus.setAccessibleName("New chat")
        self.tabs.setCornerWidget(plus, Qt.TopRightCorner)
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.error_banner)
        layout.addWidget(self.tabs, 1)
        self.setCentralWidget(central)

    def _build_status_bar(self) -> None:
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setMaximumWidth(220)
        self.progress.setAccessibleName("Model loading progress")
        self.progress.hide()
        self.model_label = QLabel("No model loaded")
        self.model_label.setAccessibleName("Loaded model")
        self.statusBar().addPermanentWidget(self.progress)
        self.statusBar().addPermanentWidget(self.model_label)
        # The HTTP API toggle (the same state as Server > Serve HTTP API), its port and where it answers.
        self.serve_box = QCheckBox(f"Serve HTTP API on {DEFAULT_API_HOST}")
        self.serve_box.setAccessibleName("Serve HTTP API")
        self.serve_box.setToolTip(self.serve_action.toolTip())
        self.serve_box.toggled.connect(self.serve_action.setChecked)
        self.serve_action.toggled.connect(self.serve_box.setChecked)
        self.server_port = QSpinBox(minimum=0, maximum=65535)
        self.server_port.setValue(DEFAULT_API_PORT)
        self.server_port.setSpecialValueText("any port")
        self.server_port.setPrefix("port ")
        self.server_port.setAccessibleName("HTTP API port")
        self.server_port.setToolTip("TCP port on 127.0.0.1 (0: any free port); fixed while serving")
        self.server_label = QLabel("")
        self.server_label.setAccessibleName("HTTP API address")
        self.server_label.setTextInteractionFlags(Qt.TextBrowserInteraction)
        self.server_label.setOpenExternalLinks(True)
        for widget in (self.serve_box, self.server_port, self.server_label):
            self.statusBar().addPermanentWidget(widget)

    def add_panel(self, title: str, widget: QWidget, area: Qt.DockWidgetArea = Qt.RightDockWidgetArea,
                  shortcut: str | None = None) -> QDockWidget:
        """Extension point for tool panels (cache monitor, patch editor…): a dock, tabbed with the others in
        its area, listed under View > Panels (with an optional shortcut to show/hide it), its place remembered
        with the window state."""
        dock = QDockWidget(title, self)
        dock.setObjectName(f"panel:{title}")
        dock.setWidget(widget)
        widget.setAccessibleName(f"{title} panel")
        existing = [d for d in self.findChildren(QDockWidget) if d is not dock and self.dockWidgetArea(d) == area]
        self.addDockWidget(area, dock)
        if existing:
            self.tabifyDockWidget(existing[-1], dock)
        toggle = dock.toggleViewAction()
        if shortcut:
            toggle.setShortcut(QKeySequence(shortcut))
            self.addAction(toggle)
        self.panels_menu.addAction(toggle)
        return dock

    # --- chats ---

    def chat_tabs(self) -> list[ChatTab]:
        return [self.tabs.widget(i) for i in range(self.tabs.count())]

    def current_tab(self) -> ChatTab | None:
        return self.tabs.currentWidget()

    def tab_for(self, session_id: int) -> ChatTab | None:
        return next((tab for tab in self.chat_tabs() if tab.session_id == session_id), None)

    @Slot()
    def new_chat(self) -> ChatTab:
        session_id = next(self._session_ids)
        tab = ChatTab(session_id, f"Chat {session_id}", [self.send_action, self.stop_action, self.regenerate_action])
        self.tabs.setCurrentIndex(self.tabs.addTab(tab, tab.title))
        tab.input.setFocus()
        return tab

    @Slot(int)
    def close_chat(self, index: int) -> None:
        tab = self.tabs.widget(index)
        if tab is None:
            return
        self.client.close_session(tab.session_id)
        self.tabs.removeTab(index)
        tab.deleteLater()
        if self.tabs.count() == 0:
            self.new_chat()

    @Slot()
    def _on_current_chat_changed(self) -> None:
        """The monitor's 'this chat' line follows the chat in front."""
        tab = self.current_tab()
        if tab is not None and self.client.model is not None and self.client.is_running():
            self.client.submit(RequestStats(self.client.next_request_id(), tab.session_id))

    def _sampling_settings(self):
        """The panel's settings, or None after showing why they were refused."""
        try:
            return self.sampling.settings()
        except ValueError as exc:
            self.show_error(f"Sampling settings: {exc}")
            return None

    @Slot()
    def send(self) -> None:
        tab = self.current_tab()
        if tab is None or not self.client.ready:
            return
        settings = self._sampling_settings()
        if settings is not None:
            self.client.send_prompt(tab.session_id, tab.input.toPlainText(), settings)

    @Slot()
    def regenerate(self) -> None:
        tab = self.current_tab()
        if tab is None or not self.client.ready or not tab.transcript.can_regenerate:
            return
        settings = self._sampling_settings()
        if settings is not None:
            self.client.regenerate(tab.session_id, settings)

    @Slot()
    def stop(self) -> None:
        self.client.stop()

    # --- models ---

    def load_model(self, name_or_path: str) -> None:
        self._select_model_item(name_or_path)
        self.progress.setValue(0)
        self.progress.show()
        self.statusBar().showMessage(f"Loading {name_or_path}…")
        self.client.load_model(name_or_path)

    @Slot()
    def open_gguf(self) -> None:
        start = str(self.settings.value("models/last_gguf_dir", str(Path.home())))
        path, _ = QFileDialog.getOpenFileName(self, "Open GGUF file", start, "GGUF models (*.gguf);;All files (*)")
        if path:
            self.settings.setValue("models/last_gguf_dir", str(Path(path).parent))
            self.load_model(path)
        else:
            self._select_model_item(self.client.model.key if self.client.model else None)

    @Slot(int)
    def _on_model_picked(self, index: int) -> None:
        choice = self.model_picker.itemData(index)
        if choice == OPEN_GGUF:
            self.open_gguf()
        elif choice and (self.client.model is None or choice != self._model_choice(self.client.model)):
            self.load_model(choice)

    @staticmethod
    def _model_choice(info: ModelInfo) -> str:
        return info.key if info.packaged else str(info.path)

    def _select_model_item(self, choice: str | None) -> None:
        if choice is None:
            self.model_picker.setCurrentIndex(-1)
            return
        index = self.model_picker.findData(choice)
        if index < 0:   # a GGUF file: listed above the separator from now on
            index = self.model_picker.count() - 2
            self.model_picker.insertItem(index, Path(choice).name, choice)
            self.model_picker.setItemData(index, choice, Qt.ToolTipRole)
        self.model_picker.setCurrentIndex(index)

    @Slot(object)
    def _on_model_loaded(self, info: ModelInfo) -> None:
        had_chats = any(tab.transcript.turns for tab in self.chat_tabs())
        self.progress.hide()
        self.error_banner.clear()
        self._select_model_item(self._model_choice(info))
        self.model_label.setText(f"{info.display_name} · {info.n_layers} layers · {info.threads} threads")
        self.statusBar().showMessage(f"Loaded {info.display_name} in {info.load_seconds:.2f} s", 10_000)
        if had_chats:
            # The worker dropped the old model's sessions; say so where the conversation is.
            for tab in self.chat_tabs():
                if tab.transcript.turns:
                    tab.transcript.add_notice(f"Model changed to {info.display_name}: "
                                              "the conversation starts afresh here.")
                    tab.render()
        tab = self.current_tab()
        if tab is not None:
            tab.input.setFocus()
        self._on_current_chat_changed()

    @Slot(str, float)
    def _on_load_progress(self, message: str, fraction: float) -> None:
        self.progress.show()
        self.progress.setValue(round(max(0.0, min(1.0, fraction)) * 1000))
        self.statusBar().showMessage(format_load_progress(message, fraction))

    # --- replies ---

    @Slot(object)
    def _on_reply_started(self, started: ReplyStarted) -> None:
        tab = self.tab_for(started.session_id)
        if tab is None:
            return
        self.error_banner.clear()
        if started.prompt is None:
            tab.transcript.drop_last_reply()
        else:
            tab.transcript.add_user(started.prompt)
            if tab.input.toPlainText() == started.prompt:
                tab.input.clear()
        tab.transcript.start_reply()
        tab.render()
        self._set_tab_busy(tab, True)
        self.statusBar().showMessage(f"Generating in {tab.title}…")

    @Slot(object)
    def _on_token(self, event: TokenEvent) -> None:
        tab = self.tab_for(event.session_id)
        if tab is not None and event.text:
            tab.append(event.text)

    @Slot(object)
    def _on_reply_finished(self, finished: ReplyFinished) -> None:
        tab = self.tab_for(finished.session_id)
        if tab is None:
            return
        tab.transcript.finish_reply(finished.text, finished.stats)
        tab.render()
        self._set_tab_busy(tab, False)
        stats_line = format_reply_stats(finished.stats).replace("\n", " · ")
        self.statusBar().showMessage(f"{tab.title}: {stats_line}", 15_000)
        self._update_actions()

    def _set_tab_busy(self, tab: ChatTab, busy: bool) -> None:
        index = self.tabs.indexOf(tab)
        if index >= 0:
            self.tabs.setTabText(index, f"{tab.title} …" if busy else tab.title)

    # --- HTTP API ---

    @Slot(bool)
    def _on_serve_toggled(self, on: bool) -> None:
        if on and not (self.server.running or self.server.starting):
            self.server.start(self.server_port.value())   # the worker serves once a model is loaded
        elif not on and (self.server.running or self.server.starting):
            self.server.stop()
            self.statusBar().showMessage("HTTP API stopped", 10_000)
        self._on_server_changed()

    @Slot(object)
    def _on_engine_activity(self, event) -> None:
        if isinstance(event, EngineActivity) and not self._stats_outstanding and self.client.ready:
            self._stats_outstanding = True
            self._on_current_chat_changed()

    @Slot(object)
    def _on_stats_arrived(self, _event) -> None:
        self._stats_outstanding = False

    @Slot()
    def _on_server_changed(self) -> None:
        server = self.server
        self.server_port.setEnabled(not (server.running or server.starting))
        if server.url:
            self.server_label.setText(f"<a href='{server.url}/docs'>{server.url}</a>")
            self.server_label.setToolTip(f"The HTTP API of {self.client.model.display_name if self.client.model else ''}"
                                         f"; API description at {server.url}/openapi.json")
            self.statusBar().showMessage(f"Serving the HTTP API on {server.url}", 10_000)
        elif server.starting:
            self.server_label.setText("starting…")
        elif self.serve_action.isChecked() and server.error:
            port = self.server_port.value()
            self.server_label.setText("")
            self.serve_action.setChecked(False)
            self.show_error(f"HTTP API: could not serve on {DEFAULT_API_HOST}:{port or 'any port'}: {server.error}")
        elif self.serve_action.isChecked() and self.client.model is None:
            self.server_label.setText("waits for a model")
        else:
            self.server_label.setText("")

    # --- errors and state ---

    def show_error(self, text: str) -> None:
        log.info("shown to the user: %s", text)
        self.error_banner.show_message(text)
        self.statusBar().showMessage(text, 15_000)

    def show_warning(self, text: str) -> None:
        """Something the app works around (e.g. no persistent cache): the banner, as errors, so it is read."""
        log.warning("shown to the user: %s", text)
        self.error_banner.show_message(f"Warning: {text}")
        self.statusBar().showMessage(text, 15_000)

    @Slot(object)
    def _on_error(self, report: ErrorReport) -> None:
        self.show_error(report.describe())
        if not self.client.loading:
            self.progress.hide()
            self._select_model_item(self._model_choice(self.client.model) if self.client.model else None)

    @Slot()
    def _update_actions(self) -> None:
        client = self.client
        tab = self.current_tab()
        self.send_action.setEnabled(client.ready)
        self.stop_action.setEnabled(client.generating_session is not None)
        self.regenerate_action.setEnabled(client.ready and tab is not None and tab.transcript.can_regenerate)
        self.model_picker.setEnabled(not client.loading)
        self.open_gguf_action.setEnabled(not client.loading)

    # --- theme, settings, closing ---

    @Slot(bool)
    def set_dark_theme(self, dark: bool) -> None:
        self.dark_theme_action.setChecked(dark)
        apply_theme(self.app, dark)
        self.monitor.set_dark(dark)
        for tab in self.chat_tabs():
            tab.render()   # footers take their colour from the palette

    def _restore_settings(self) -> None:
        s = self.settings
        geometry = s.value("window/geometry")
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(1280, 860)
        state = s.value("window/state")
        if state is not None:
            self.restoreState(state)
        else:
            self.patch_editor_dock.raise_()
            self.resizeDocks([self.patch_editor_dock], [400], Qt.Horizontal)
            self.resizeDocks([self.monitor_dock], [420], Qt.Vertical)
        self.set_dark_theme(str(s.value("view/dark", "false")).lower() == "true")
        self.sampling.restore(s)
        self.monitor.restore(s)
        self.patch_editor.restore(s)
        try:
            port = int(s.value("server/port", DEFAULT_API_PORT))
        except (TypeError, ValueError):
            port = DEFAULT_API_PORT
        self.server_port.setValue(port if 0 <= port <= 65535 else DEFAULT_API_PORT)
        # Serving resumes on launch (once the model has loaded) only if it was on when the app last closed.
        self.serve_action.setChecked(str(s.value("server/enabled", "false")).lower() == "true")

    def save_settings(self) -> None:
        s = self.settings
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue("window/state", self.saveState())
        s.setValue("view/dark", self.dark_theme_action.isChecked())
        for panel in (self.sampling, self.monitor):
            try:
                panel.save(s)
            except ValueError:
                pass   # unsaveable values keep the previous ones
        self.patch_editor.save(s)
        s.setValue("server/enabled", self.serve_action.isChecked())
        s.setValue("server/port", self.server_port.value())
        s.sync()

    def closeEvent(self, event: QCloseEvent) -> None:
        if not self._closed:
            self._closed = True
            self.save_settings()
            # The HTTP API serves the engine from its own threads: stop it while the engine is still whole.
            self.server.shutdown()
            # Stops a reply at its next token, ends the engine thread and waits for it: a QThread still
            # running when Python tears down aborts the process.
            self.client.shutdown()
        event.accept()
