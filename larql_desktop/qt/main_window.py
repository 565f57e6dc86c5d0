"""The main window: chat tabs, model picker, the tool panels (sampling, saved chats, tokens, cache monitor, patch
editor), status. Wiring and layout: the engine is in the worker, the chats' flow in the chat controller
(qt/chat_controller.py), whose chats the tabs render.

Every chat is saved as it happens (engine/chats.py, a SQLite file under the user data dir); the chats open when
the app closed open again on launch, and the Chats panel lists, searches, renames and deletes the others."""
from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import QSettings, Qt, Slot
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (QApplication, QCheckBox, QComboBox, QDockWidget, QFileDialog, QFrame, QHBoxLayout,
                               QInputDialog, QLabel, QMainWindow, QProgressBar, QPushButton, QSpinBox, QTabWidget,
                               QToolButton, QVBoxLayout, QWidget)

from larql_desktop.engine.catalog import PACKAGED_MODELS
from larql_desktop.engine.chats import CHATS_FILE, ChatStore, ChatStoreError
from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.qt.qt_chat_panels import ChatsPanel, TokenView
from larql_desktop.qt.transcript import ASSISTANT
from larql_desktop.qt.chat_controller import Chat, ChatController, model_choice
from larql_desktop.qt.protocol import EngineActivity, ErrorReport, ModelInfo, ReplyFinished, ReplyStarted, RequestStats
from larql_desktop.qt.qt_cache_monitor import CacheMonitor
from larql_desktop.qt.qt_chat_tab import ChatTab
from larql_desktop.qt.qt_patch_editor import PatchEditor
from larql_desktop.qt.qt_reply_views import ReplyMap
from larql_desktop.qt import token_shading
from larql_desktop.qt.qt_sampling_panel import SamplingPanel
from larql_desktop.qt.qt_theme import app_icon, apply_theme
from larql_desktop.qt.reply_stats import format_load_progress, format_reply_stats
from larql_desktop.engine.services import DEFAULT_API_HOST, DEFAULT_API_PORT
from larql_desktop.qt.server_control import ServerController
from larql_desktop.qt.worker import EngineClient


log = logging.getLogger(__name__)

OPEN_GGUF = "__open_gguf__"   # the model picker's "Open GGUF file…" entry
TAB_TITLE_LENGTH = 24


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
        self._closed = False
        # Saved chats; a database SQLite cannot use is set aside (the warning says where) and a fresh one started.
        store, chats_warning = ChatStore.open(client.paths.data / CHATS_FILE)
        # The chats' flow (requests, the reply stream into transcripts and the store) is the controller's; the
        # window shows what it reports.
        self.chat_controller = controller = ChatController(client, store, self)
        controller.opened.connect(self._add_tab)
        controller.reply_started.connect(self._on_reply_started)
        controller.streamed.connect(lambda chat, text: self.tab_for(chat.id).show_streamed(text))
        controller.reply_finished.connect(self._on_reply_finished)
        controller.retitled.connect(self._set_tab_title)
        controller.list_changed.connect(self._refresh_chat_list)
        controller.problem.connect(self.show_error)
        controller.note.connect(lambda text: self.statusBar().showMessage(text, 10_000))
        self._default_system_prompt: str | None = None
        self._had_model = False   # a model was loaded in this window (a later load is a model change)
        self.setWindowTitle("larql-desktop")
        self.setWindowIcon(app_icon())
        self.setObjectName("mainWindow")

        self._panels: list[tuple[QDockWidget, Qt.DockWidgetArea]] = []   # each dock and its default area
        self._build_actions()
        self._build_menus()
        self.sampling = SamplingPanel()
        self.sampling_dock = self.add_panel("Sampling", self.sampling, shortcut="Ctrl+Shift+S")
        self.sampling.changed.connect(self._on_sampling_changed)
        self.sampling.system_prompt_changed.connect(self._on_system_prompt_changed)
        self.chats_panel = ChatsPanel()
        self.chats_dock = self.add_panel("Chats", self.chats_panel, shortcut="Ctrl+Shift+H")
        self.chats_panel.open_requested.connect(self.open_saved_chat)
        self.chats_panel.rename_requested.connect(self.rename_chat)
        self.chats_panel.delete_requested.connect(self.delete_chat)
        self.chats_panel.search_changed.connect(self._refresh_chat_list)
        self.token_view = TokenView(client)
        self.token_dock = self.add_panel("Tokens", self.token_view, shortcut="Ctrl+Shift+T")
        self.patch_editor = PatchEditor(client)
        self.patch_editor_dock = self.add_panel("Patch editor", self.patch_editor, shortcut="Ctrl+Shift+P")
        self.monitor = CacheMonitor(client)
        self.monitor_dock = self.add_panel("Cache monitor", self.monitor, Qt.BottomDockWidgetArea,
                                           shortcut="Ctrl+Shift+M")
        self.reply_map = ReplyMap(client)
        self.reply_map_dock = self.add_panel("Reply map", self.reply_map, Qt.BottomDockWidgetArea,
                                             shortcut="Ctrl+Shift+L")
        self.reply_map.cell_clicked.connect(self._on_reply_cell_clicked)
        self.reply_map.analysed.connect(self._on_reply_analysed)
        self.reply_map_dock.visibilityChanged.connect(self._on_reply_map_shown)
        self._reply_map_source: tuple[ChatTab, int] | None = None   # the (tab, turn index) the map shows
        for panel in (self.patch_editor, self.monitor):
            panel.error.connect(self.show_error)
        # The right-hand panels run the full height; the monitor sits under the chats.
        self.setCorner(Qt.BottomRightCorner, Qt.RightDockWidgetArea)
        self._build_model_picker()
        self._build_central()
        self._build_status_bar()
        self._show_chats_store_state()
        self.server = ServerController(client, parent=self)
        self.server.changed.connect(self._on_server_changed)
        self.serve_action.toggled.connect(self._on_serve_toggled)
        # HTTP clients move the statistics while the window sits idle: the worker forwards the engine's events
        # and the window asks for one snapshot at a time (patch changes arrive as events of their own).
        self._stats_outstanding = False
        client.engine_activity.connect(self._on_engine_activity)
        client.stats.connect(self._on_stats_arrived)

        client.model_loaded.connect(self._on_model_loaded)
        client.load_progress.connect(self._on_load_progress)
        client.error.connect(self._on_error)
        client.busy_changed.connect(self._update_actions)

        self._restore_settings()
        self._restore_chats()
        self._update_actions()
        if chats_warning:
            self.show_warning(chats_warning)

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
        self.rename_chat_action = self._action("Re&name chat…", lambda: self.rename_chat(self._current_chat_id()),
                                               ["F2"])
        self.export_markdown_action = self._action("Export chat as &Markdown…", lambda: self.export_dialog("md"),
                                                   ["Ctrl+Shift+E"])
        self.export_json_action = self._action("Export chat as &JSON…", lambda: self.export_dialog("json"))
        self.copy_reply_action = self._action("&Copy last reply", self.copy_last_reply, ["Ctrl+Shift+C"])
        self.show_tokens_action = self._action("Show &tokens of the last reply", self.show_last_reply_tokens)
        self.reset_layout_action = self._action("&Reset layout", self.reset_layout,
                                                tip="Put every panel back where it starts, at its first size")
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
        for action in (self.new_chat_action, self.close_chat_action, self.rename_chat_action, self.open_gguf_action,
                       self.export_markdown_action, self.export_json_action):
            file_menu.addAction(action)
        file_menu.addSeparator()
        file_menu.addAction(self.quit_action)
        chat_menu = bar.addMenu("&Chat")
        for action in (self.send_action, self.stop_action, self.regenerate_action, self.copy_reply_action,
                       self.show_tokens_action):
            chat_menu.addAction(action)
        view_menu = bar.addMenu("&View")
        view_menu.addAction(self.dark_theme_action)
        shade_menu = view_menu.addMenu("&Shade replies by")
        self.shade_actions = QActionGroup(self)
        for key, text in token_shading.MEASURES.items():
            action = shade_menu.addAction(text)
            action.setCheckable(True)
            action.setData(key)
            action.setChecked(key == token_shading.NONE)
            action.triggered.connect(lambda _=False, k=key: self.set_shading(k))
            self.shade_actions.addAction(action)
        self.panels_menu = view_menu.addMenu("&Panels")
        view_menu.addAction(self.reset_layout_action)
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
        toolbar.addSeparator()
        shade_label = QLabel(" Shade replies by: ")
        self.shade_picker = QComboBox()
        self.shade_picker.setAccessibleName("Shade replies by")
        self.shade_picker.setToolTip("Colour each token of the replies that have ended by a measure; hover a token "
                                     "for its alternatives, click it to inspect it")
        for key, text in token_shading.MEASURES.items():
            self.shade_picker.addItem(text, key)
        shade_label.setBuddy(self.shade_picker)
        self.shade_picker.currentIndexChanged.connect(lambda _: self.set_shading(self.shade_picker.currentData()))
        self.shade_legend = QLabel("")
        self.shade_legend.setAccessibleName("Shading legend")
        toolbar.addWidget(shade_label)
        toolbar.addWidget(self.shade_picker)
        toolbar.addWidget(self.shade_legend)

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

    def _show_chats_store_state(self) -> None:
        """A permanent note while saved chats are not being written (read-only, or kept in memory this run)."""
        if self.chats.read_only:
            text, tip = "Saved chats: read-only", f"{self.chats.where} is open read-only: {self.chats.read_only}"
        elif not self.chats.persistent:
            text, tip = "Saved chats: not saved", "The saved chats file could not be opened: chats are kept in memory"
        else:
            return
        self.chats_state_label = QLabel(text)
        self.chats_state_label.setAccessibleName("Saved chats state")
        self.chats_state_label.setToolTip(tip + " (new chats are not saved this run)")
        self.statusBar().addPermanentWidget(self.chats_state_label)

    def add_panel(self, title: str, widget: QWidget, area: Qt.DockWidgetArea = Qt.RightDockWidgetArea,
                  shortcut: str | None = None) -> QDockWidget:
        """Extension point for tool panels (cache monitor, patch editor…): a dock, tabbed with the others in
        its area, listed under View > Panels (with an optional shortcut to show/hide it), its place remembered
        with the window state."""
        dock = QDockWidget(title, self)
        dock.setObjectName(f"panel:{title}")
        dock.setWidget(widget)
        widget.setAccessibleName(f"{title} panel")
        self._place_panel(dock, area)
        self._panels.append((dock, area))
        toggle = dock.toggleViewAction()
        if shortcut:
            toggle.setShortcut(QKeySequence(shortcut))
            self.addAction(toggle)
        self.panels_menu.addAction(toggle)
        return dock

    def _place_panel(self, dock: QDockWidget, area: Qt.DockWidgetArea) -> None:
        """Dock a panel in `area`, tabbed behind the panels already there."""
        existing = [d for d, a in self._panels if d is not dock and a == area and self.dockWidgetArea(d) == area
                    and not d.isFloating()]
        self.addDockWidget(area, dock)
        if existing:
            self.tabifyDockWidget(existing[-1], dock)

    @Slot()
    def reset_layout(self) -> None:
        """View > Reset layout: every panel docked, shown and tabbed where it starts, at its first size."""
        for dock, _ in self._panels:
            self.removeDockWidget(dock)
        placed: list[QDockWidget] = []
        for dock, area in self._panels:
            dock.setFloating(False)
            self.addDockWidget(area, dock)
            same_area = [d for d in placed if self.dockWidgetArea(d) == area]
            if same_area:
                self.tabifyDockWidget(same_area[-1], dock)
            dock.show()
            placed.append(dock)
        self._default_dock_sizes()

    def _default_dock_sizes(self) -> None:
        self.patch_editor_dock.raise_()
        self.monitor_dock.raise_()
        # The right-hand panels as wide as the patch editor's form needs (never scrolled sideways); the monitor
        # under the chats at most half the height (its charts need ~400 px).
        right = max(400, self.patch_editor.fitting_width)
        self.resizeDocks([self.patch_editor_dock], [right], Qt.Horizontal)
        self.resizeDocks([self.monitor_dock], [max(300, min(420, self.height() // 2))], Qt.Vertical)

    # --- chats ---

    def chat_tabs(self) -> list[ChatTab]:
        return [self.tabs.widget(i) for i in range(self.tabs.count())]

    def current_tab(self) -> ChatTab | None:
        return self.tabs.currentWidget()

    def tab_for(self, session_id: int) -> ChatTab | None:
        return next((tab for tab in self.chat_tabs() if tab.session_id == session_id), None)

    @property
    def chats(self) -> ChatStore:
        """The saved chats (the controller's store)."""
        return self.chat_controller.store

    def _current_chat_id(self) -> int | None:
        tab = self.current_tab()
        return tab.session_id if tab is not None else None

    @Slot(object)
    def _add_tab(self, chat: Chat) -> ChatTab:
        tab = ChatTab(chat, [self.send_action, self.stop_action, self.regenerate_action])
        tab.shade_by = self.shading
        tab.tokens_requested.connect(lambda index, t=tab: self.show_tokens(t, index))
        tab.token_clicked.connect(lambda index, token, t=tab: self.show_tokens(t, index, token))
        self.tabs.setCurrentIndex(self.tabs.addTab(tab, _tab_text(chat.title)))
        self.tabs.setTabToolTip(self.tabs.indexOf(tab), chat.title)
        tab.render()
        return tab

    @Slot()
    def new_chat(self) -> ChatTab:
        try:
            sampling = self.sampling.settings()   # a new chat starts from the settings last used
        except ValueError:
            sampling = SamplingSettings()
        tab = self.tab_for(self.chat_controller.new_chat(sampling).id)
        tab.input.setFocus()
        return tab

    @Slot(int)
    def open_saved_chat(self, chat_id: int) -> ChatTab | None:
        """Show a saved chat in a tab (its own if it is open already)."""
        tab = self.tab_for(chat_id)
        if tab is not None:
            self.tabs.setCurrentWidget(tab)
            return tab
        if self.chat_controller.open_saved(chat_id) is None:
            return None
        self._on_current_chat_changed()
        return self.tab_for(chat_id)

    @Slot(int)
    def close_chat(self, index: int) -> None:
        """Close a chat's tab; it stays saved (an empty one is not kept)."""
        tab = self.tabs.widget(index)
        if tab is None:
            return
        self.tabs.removeTab(index)
        self.chat_controller.close(tab.session_id)
        tab.deleteLater()
        if self.tabs.count() == 0:
            self.new_chat()

    @Slot(int)
    def delete_chat(self, chat_id: int) -> None:
        tab = self.tab_for(chat_id)
        if tab is not None:
            self.close_chat(self.tabs.indexOf(tab))
        self.chat_controller.delete(chat_id)

    @Slot(int)
    def rename_chat(self, chat_id: int | None, title: str | None = None) -> None:
        if chat_id is None:
            return
        if title is None:
            tab = self.tab_for(chat_id)
            current = tab.title if tab is not None else ""
            title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=current)
            if not ok:
                return
        try:
            self.chat_controller.rename(chat_id, title)
        except ValueError as exc:
            self.show_error(f"Rename: {exc}")

    @Slot(object)
    def _set_tab_title(self, chat: Chat) -> None:
        tab = self.tab_for(chat.id)
        if tab is not None:
            index = self.tabs.indexOf(tab)
            self.tabs.setTabText(index, _tab_text(chat.title))
            self.tabs.setTabToolTip(index, chat.title)

    @Slot()
    def _refresh_chat_list(self, *_args) -> None:
        chats = self.chat_controller.list_chats(self.chats_panel.search.text())
        if chats is not None:
            self.chats_panel.show_chats(chats)

    def _restore_chats(self) -> None:
        """Reopen the chats that were open when the app closed (a new one if none)."""
        wanted = _ids(self.settings.value("chats/open", []))
        current = _ids(self.settings.value("chats/current", []))
        for chat_id in wanted:
            if self.chat_controller.stored(self.chats.exists, chat_id):
                self.open_saved_chat(chat_id)
        if self.tabs.count() == 0:
            self.new_chat()
        elif current and self.tab_for(current[0]) is not None:
            self.tabs.setCurrentWidget(self.tab_for(current[0]))
        self._refresh_chat_list()

    # --- per-chat settings ---

    @Slot()
    def _on_sampling_changed(self) -> None:
        tab = self.current_tab()
        if tab is None:
            return
        try:
            self.chat_controller.set_sampling(tab.chat, self.sampling.settings())
        except ValueError:
            return   # shown when the user sends

    @Slot()
    def _on_system_prompt_changed(self) -> None:
        tab = self.current_tab()
        if tab is not None:
            self.chat_controller.set_system_prompt(tab.chat, self.sampling.chat_system_prompt())

    # --- copy, export, tokens ---

    @Slot()
    def copy_last_reply(self) -> str | None:
        tab = self.current_tab()
        replies = [i for i, t in enumerate(tab.transcript.turns) if t.role == ASSISTANT] if tab else []
        return tab.copy_turn(replies[-1]) if replies else None

    def export_chat(self, path: Path, fmt: str, chat_id: int | None = None) -> Path:
        """Write the chat (the current one by default) as it is saved: "md" (Markdown) or "json"."""
        chat_id = self._current_chat_id() if chat_id is None else chat_id
        chat = self.chat_controller.export(chat_id, path, fmt, self._default_system_prompt)
        self.statusBar().showMessage(f"Exported {chat.title} to {path}", 10_000)
        return Path(path)

    def export_dialog(self, fmt: str) -> None:
        tab = self.current_tab()
        if tab is None:
            return
        kind = "Markdown (*.md)" if fmt == "md" else "JSON (*.json)"
        start = Path(str(self.settings.value("chats/export_dir", str(Path.home())))) / f"{_file_name(tab.title)}.{fmt}"
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", str(start), kind)
        if not path:
            return
        self.settings.setValue("chats/export_dir", str(Path(path).parent))
        try:
            self.export_chat(Path(path), fmt)
        except (OSError, ChatStoreError) as exc:
            self.show_error(f"Export: {exc}")

    def show_tokens(self, tab: ChatTab, index: int, token: int = 0) -> None:
        turn = tab.transcript.turns[index]
        number = sum(1 for t in tab.transcript.turns[:index + 1] if t.role == ASSISTANT)
        if self.token_view.events != list(turn.tokens):
            self.token_view.show_reply(turn.tokens, f"{tab.title}, reply {number}")
        if 0 <= token < len(turn.tokens):
            self.token_view.tokens.setCurrentRow(token)
        self._show_reply_map(tab, index)
        self.token_dock.show()
        self.token_dock.raise_()

    # --- the reply as pictures: shading, the reply x layer map ---

    @property
    def shading(self) -> str:
        checked = self.shade_actions.checkedAction()
        return checked.data() if checked is not None else token_shading.NONE

    @Slot(str)
    def set_shading(self, measure: str) -> None:
        """Shade the ended replies of every chat by `measure` (token_shading.MEASURES; "none": Markdown)."""
        if measure not in token_shading.MEASURES:
            raise ValueError(f"no shading measure {measure!r}; choose one of {', '.join(token_shading.MEASURES)}")
        for action in self.shade_actions.actions():
            action.setChecked(action.data() == measure)
        self.shade_picker.blockSignals(True)
        self.shade_picker.setCurrentIndex(self.shade_picker.findData(measure))
        self.shade_picker.blockSignals(False)
        self.shade_legend.setText(token_shading.legend_html(measure))
        for tab in self.chat_tabs():
            if tab.shade_by != measure:
                tab.shade_by = measure
                tab.render()
        if measure == token_shading.INSERT and self.reply_map.turn is not None and self.reply_map.fired is None:
            self.reply_map.analyse()   # where INSERTs fired is known once the reply's pass has run

    def _show_reply_map(self, tab: ChatTab, index: int) -> None:
        turn = tab.transcript.turns[index]
        if self.reply_map.turn is turn:
            return
        number = sum(1 for t in tab.transcript.turns[:index + 1] if t.role == ASSISTANT)
        self._reply_map_source = (tab, index)
        # The pass is recomputed only when its picture is in view (or shading asks where INSERTs fired).
        wanted = self.reply_map_dock.isVisible() and not self.reply_map.visibleRegion().isEmpty() \
            or self.shading == token_shading.INSERT
        self.reply_map.show_reply(turn, f"{tab.title}, reply {number}: tokens across, layers down",
                                  analyse=wanted and self.client.ready)

    @Slot(bool)
    def _on_reply_map_shown(self, visible: bool) -> None:
        if visible and self.reply_map.turn is not None and self.reply_map.fired is None \
                and not self.reply_map.analysing and self.client.ready:
            self.reply_map.analyse()

    @Slot(int, int)
    def _on_reply_cell_clicked(self, token: int, layer: int) -> None:
        """A cell of the reply map: that token in the token view, its pass's features at that layer."""
        if self._reply_map_source is None:
            return
        tab, index = self._reply_map_source
        if self.tabs.indexOf(tab) < 0:
            return
        self.show_tokens(tab, index, token)
        self.token_view.show_features(layer)

    @Slot(object)
    def _on_reply_analysed(self, turn) -> None:
        if self.shading == token_shading.INSERT:
            for tab in self.chat_tabs():
                if any(t is turn for t in tab.transcript.turns):
                    tab.render()

    @Slot()
    def show_last_reply_tokens(self) -> None:
        tab = self.current_tab()
        replies = [i for i, t in enumerate(tab.transcript.turns) if t.role == ASSISTANT] if tab else []
        if replies:
            self.show_tokens(tab, replies[-1])

    @Slot()
    def _on_current_chat_changed(self) -> None:
        """The monitor's 'this chat' line follows the chat in front."""
        tab = self.current_tab()
        if tab is not None:
            self.sampling.set_settings(tab.sampling)   # the panel shows the chat in front
            self.sampling.set_chat_system_prompt(tab.system_prompt)
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
            self.chat_controller.send(tab.chat, tab.input.toPlainText(), settings)

    @Slot()
    def regenerate(self) -> None:
        tab = self.current_tab()
        if tab is None or not self.client.ready or not tab.transcript.can_regenerate:
            return
        settings = self._sampling_settings()
        if settings is not None:
            self.chat_controller.regenerate(tab.chat, settings)

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

    _model_choice = staticmethod(model_choice)

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
        # Chats restored on launch were not running on any model yet: only a change in this run is news.
        had_chats = self._had_model and any(tab.transcript.turns for tab in self.chat_tabs())
        self._had_model = True
        self.progress.hide()
        self.error_banner.clear()
        self._select_model_item(self._model_choice(info))
        self.settings.setValue("models/last", self._model_choice(info))
        self._default_system_prompt = info.default_system_prompt if info.is_chat else None
        self.sampling.set_default_system_prompt(self._default_system_prompt)
        # A base model (no chat template) continues the text as it is: a system prompt would be ignored.
        self.sampling.system_prompt.setEnabled(info.is_chat)
        self.model_label.setText(f"{info.display_name} · {info.n_layers} layers · {info.threads} threads")
        self.statusBar().showMessage(f"Loaded {info.display_name} in {info.load_seconds:.2f} s", 10_000)
        if had_chats:
            self.chat_controller.model_changed(info)
            for tab in self.chat_tabs():
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

    @Slot(object, object)
    def _on_reply_started(self, chat: Chat, started: ReplyStarted) -> None:
        tab = self.tab_for(chat.id)
        if tab is None:
            return
        self.error_banner.clear()
        if started.prompt is not None and tab.input.toPlainText() == started.prompt:
            tab.input.clear()
        tab.render()
        self._set_tab_busy(tab, True)
        self.statusBar().showMessage(f"Generating in {tab.title}…")

    @Slot(object, object)
    def _on_reply_finished(self, chat: Chat, finished: ReplyFinished) -> None:
        tab = self.tab_for(chat.id)
        if tab is None:
            return
        tab.render()
        if tab is self.current_tab():
            self.show_last_reply_tokens_quietly(tab)
        self._set_tab_busy(tab, False)
        stats_line = format_reply_stats(finished.stats).replace("\n", " · ")
        self.statusBar().showMessage(f"{tab.title}: {stats_line}", 15_000)
        self._update_actions()

    def _set_tab_busy(self, tab: ChatTab, busy: bool) -> None:
        index = self.tabs.indexOf(tab)
        if index >= 0:
            self.tabs.setTabText(index, f"{_tab_text(tab.title)} …" if busy else _tab_text(tab.title))

    def show_last_reply_tokens_quietly(self, tab: ChatTab) -> None:
        """Keep the token view on the newest reply of the chat in front, without raising its panel."""
        replies = [i for i, t in enumerate(tab.transcript.turns) if t.role == ASSISTANT]
        if replies:
            turn = tab.transcript.turns[replies[-1]]
            self.token_view.show_reply(turn.tokens, f"{tab.title}, reply {len(replies)}")
            self._show_reply_map(tab, replies[-1])

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
    def _on_engine_activity(self, _event: EngineActivity) -> None:
        if not self._stats_outstanding and self.client.ready:
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
        has_reply = tab is not None and any(t.role == ASSISTANT for t in tab.transcript.turns)
        self.copy_reply_action.setEnabled(has_reply)
        self.show_tokens_action.setEnabled(has_reply)
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
            if geometry is not None:   # the docks' saved sizes may have grown the window: the saved size wins
                self.restoreGeometry(geometry)
        else:
            self._default_dock_sizes()
        self.set_dark_theme(str(s.value("view/dark", "false")).lower() == "true")
        shading = str(s.value("view/shade", token_shading.NONE))
        self.set_shading(shading if shading in token_shading.MEASURES else token_shading.NONE)
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
        s.setValue("view/shade", self.shading)
        for panel in (self.sampling, self.monitor):
            try:
                panel.save(s)
            except ValueError:
                pass   # unsaveable values keep the previous ones
        self.patch_editor.save(s)
        s.setValue("server/enabled", self.serve_action.isChecked())
        s.setValue("server/port", self.server_port.value())
        kept = [tab for tab in self.chat_tabs() if tab.session_id > 0 and
                (tab.transcript.messages() or tab.system_prompt is not None)]
        s.setValue("chats/open", [tab.session_id for tab in kept])
        current = self.current_tab()
        s.setValue("chats/current", current.session_id if current in kept else 0)
        s.sync()

    def last_model(self, default: str) -> str:
        """The model the app ran last (the packaged key or a GGUF path), else `default`."""
        last = self.settings.value("models/last")
        return str(last) if last else default

    def closeEvent(self, event: QCloseEvent) -> None:
        if not self._closed:
            self._closed = True
            self.save_settings()
            # The HTTP API serves the engine from its own threads: stop it while the engine is still whole.
            self.server.shutdown()
            # Stops a reply at its next token, ends the engine thread and waits for it: a QThread still
            # running when Python tears down aborts the process.
            self.client.shutdown()
            self.chat_controller.shutdown()   # a reply stopped by closing is kept as far as it got
        event.accept()


def _tab_text(title: str) -> str:
    return title if len(title) <= TAB_TITLE_LENGTH else title[:TAB_TITLE_LENGTH - 1] + "…"


def _ids(value) -> list[int]:
    """Chat ids from QSettings (an INI file gives a list, one string, or nothing)."""
    values = value if isinstance(value, (list, tuple)) else [value] if value not in (None, "") else []
    out = []
    for v in values:
        try:
            out.append(int(v))
        except (TypeError, ValueError):
            pass
    return [v for v in out if v > 0]


def _file_name(title: str) -> str:
    return "".join(c if c.isalnum() or c in " -_" else "_" for c in title).strip() or "chat"
