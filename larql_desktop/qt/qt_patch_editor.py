"""The patch editor: INSERT a fact (with optional paraphrases), probe it where people ask (its prompt, paraphrases
and a chat question, before/after), probe a prompt, and manage the applied patches and patch files."""
from __future__ import annotations

from pathlib import Path

import html

from PySide6.QtCore import QSettings, Qt, Signal, Slot
from PySide6.QtWidgets import (QAbstractItemView, QDoubleSpinBox, QFileDialog, QFormLayout, QGroupBox,
                               QHBoxLayout, QHeaderView, QLabel, QLineEdit, QPlainTextEdit, QProgressBar, QPushButton,
                               QScrollArea, QSizePolicy, QSpinBox, QStyle, QTableWidget, QTableWidgetItem,
                               QTextBrowser, QTreeWidget, QTreeWidgetItem, QVBoxLayout, QWidget)

from larql_desktop.engine.services import ProbeOutcome
from larql_desktop.qt.protocol import (ErrorReport, FactProbed, InsertCancelled, InsertFact, InsertFinished,
                                       InsertProgress, LoadPatchFile, ModelInfo, PatchesShown, PatchSaved, ProbeAnswered,
                                       ProbeFact, ProbePrompt, RemovePatch, SavePatch,
                                       SavePatchSet)
from larql_desktop.qt.qt_tables import read_only_table
from larql_desktop.qt.worker import EngineClient

_AUTO_LAYER = -1
# Each request's last answer (an INSERT's patches and probe come before its InsertFinished).
_FINAL_ANSWER = {InsertFact: InsertFinished, ProbePrompt: ProbeAnswered, ProbeFact: FactProbed,
                 LoadPatchFile: PatchesShown, RemovePatch: PatchesShown, SavePatch: PatchSaved,
                 SavePatchSet: PatchSaved}
# Before and after are whole continuations: the selected row's are shown in full, wrapped, under the table (seven
# columns in a 400 px panel squeezed every text column to "T..."; the table keeps what compares at a glance).
FACT_PROBE_COLUMNS = ["Kind", "Prompt", "P before", "P after", "Answers"]
_PATCH_FILTER = "LARQL patches (*.json *.vlp);;All files (*)"


def _probability(p: float | None) -> str:
    return "–" if p is None else f"{p:.3f}"


def _one_line(text: str) -> str:
    return " ".join(text.split("\n"))


def paraphrase_lines(text: str) -> tuple[str, ...]:
    """The paraphrases typed one per line: blank lines dropped, each trimmed, repeats once."""
    return tuple(dict.fromkeys(line.strip() for line in text.splitlines() if line.strip()))


class PatchEditor(QWidget):
    error = Signal(str)   # for the window's banner (GUI-side problems; engine errors come through the client)

    def __init__(self, client: EngineClient, parent: QWidget | None = None):
        super().__init__(parent)
        self.client = client
        self.patches: tuple = ()   # PatchSummary of each row of the list
        self._patches_version = 0
        self.last_probe: ProbeOutcome | None = None
        self.last_insert: InsertFinished | None = None
        self.last_fact: ProbeFact | None = None           # the last fact inserted here ("Probe fact" probes it)
        self.last_fact_probes: FactProbed | None = None
        self._pending: dict[int, type] = {}   # this panel's requests still in the worker, by id
        self._last_dir = str(Path.home())
        content = QWidget()
        layout = QVBoxLayout(content)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self._build_insert())
        layout.addWidget(self._build_fact_probe())
        layout.addWidget(self._build_probe())
        layout.addWidget(self._build_list(), 1)
        self.status = QLabel("")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.status.setAccessibleName("Patch editor status")
        layout.addWidget(self.status)
        scroll = QScrollArea()   # the dock may be shorter than the form: scroll rather than squash it
        scroll.setWidget(content)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QScrollArea.NoFrame)
        # The width at which the form never scrolls sideways, the INSERT's Cancel button included (it keeps its
        # place while hidden): the window docks the panel at least this wide. Not a minimum: a small window may
        # still squeeze the panel, and then it scrolls rather than clips.
        self.fitting_width = (content.minimumSizeHint().width()
                              + scroll.style().pixelMetric(QStyle.PM_ScrollBarExtent) + 2 * scroll.frameWidth() + 2)
        self.scroll = scroll
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scroll)
        client.insert_progress.connect(self._on_insert_progress)
        client.patches_shown.connect(self._on_patches_shown)
        client.insert_cancelled.connect(self._on_insert_cancelled)
        client.insert_finished.connect(self._on_insert_finished)
        client.probe_answered.connect(self._on_probe_answered)
        client.fact_probed.connect(self._on_fact_probed)
        client.patch_saved.connect(self._on_patch_saved)
        client.error.connect(self._on_error)
        client.model_loaded.connect(self._on_model_loaded)
        client.busy_changed.connect(self._update_enabled)
        self._update_enabled()

    # --- construction ---

    def _line(self, name: str, placeholder: str) -> QLineEdit:
        edit = QLineEdit()
        edit.setAccessibleName(name)
        edit.setPlaceholderText(placeholder)
        return edit

    def _build_insert(self) -> QGroupBox:
        box = QGroupBox("INSERT a fact")
        self.entity = self._line("Entity", "e.g. Atlantis")
        self.relation = self._line("Relation", "e.g. capital-of")
        self.target = self._line("Target", "e.g. Poseidon")
        self.paraphrases = QPlainTextEdit()
        self.paraphrases.setAccessibleName("Paraphrases")
        self.paraphrases.setPlaceholderText("Optional, one per line, e.g. Atlantis has its capital at\n"
                                            "(none: phrasings are generated from the relation)")
        self.paraphrases.setToolTip("Other phrasings of the question the fact must answer; the INSERT keys on "
                                    "them as well as on phrasings it generates")
        self.paraphrases.setTabChangesFocus(True)
        self.paraphrases.setFixedHeight(self.paraphrases.fontMetrics().lineSpacing() * 4 + 12)
        self.layer = QSpinBox(minimum=_AUTO_LAYER, maximum=1000)
        self.layer.setSpecialValueText("auto")
        self.layer.setValue(_AUTO_LAYER)
        self.layer.setAccessibleName("Install layer")
        self.layer.setToolTip("auto: LARQL's default layer, then its neighbours until the target is likely")
        self.alpha = QDoubleSpinBox(minimum=0.001, maximum=100.0, singleStep=0.05, decimals=3, value=0.1)
        self.alpha.setAccessibleName("Alpha")
        self.alpha.setToolTip("Initial strength of the written down vector (balanced afterwards)")
        self.insert_button = QPushButton("Insert")
        self.insert_button.setAccessibleName("Insert fact")
        self.insert_button.setToolTip("Runs for a few seconds in the engine thread (Ctrl+I)")
        self.insert_button.setShortcut("Ctrl+I")
        self.insert_button.clicked.connect(self.insert)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setAccessibleName("Cancel INSERT")
        self.cancel_button.setToolTip("Stop the INSERT at its next step; nothing is applied")
        self.cancel_button.clicked.connect(self.cancel_insert)
        _keep_place_when_hidden(self.cancel_button)
        self.cancel_button.hide()
        self._insert_request: InsertFact | None = None
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setAccessibleName("INSERT progress")
        self.progress.setTextVisible(False)
        self.progress.hide()
        self.progress_label = QLabel("")
        self.progress_label.setWordWrap(True)
        # A long progress message wraps within the panel's width instead of widening it.
        self.progress_label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.progress_label.setAccessibleName("INSERT progress message")
        form = QFormLayout(box)
        form.addRow("Entity", self.entity)
        form.addRow("Relation", self.relation)
        form.addRow("Target", self.target)
        form.addRow("Paraphrases (one per line)", self.paraphrases)
        row = QHBoxLayout()
        row.addWidget(QLabel("Layer"))
        row.addWidget(self.layer)
        row.addWidget(QLabel("Alpha"))
        row.addWidget(self.alpha)
        row.addStretch(1)
        row.addWidget(self.insert_button)
        row.addWidget(self.cancel_button)
        form.addRow(row)
        form.addRow(self.progress)
        form.addRow(self.progress_label)
        self.entity.textChanged.connect(self._suggest_probe)
        self.relation.textChanged.connect(self._suggest_probe)
        return box

    def _build_fact_probe(self) -> QGroupBox:
        box = QGroupBox("Fact probe")
        self.fact_probe_button = QPushButton("Probe fact")
        self.fact_probe_button.setAccessibleName("Probe fact")
        self.fact_probe_button.setToolTip("The last inserted fact on its prompt, the paraphrases and a chat "
                                          "question: greedy continuations and P(whole target) without and with "
                                          "the applied patches")
        self.fact_probe_button.clicked.connect(self.probe_fact)
        self.fact_probe_label = QLabel("Shown after an INSERT: where the fact answers, before and after.")
        self.fact_probe_label.setWordWrap(True)
        self.fact_probe_label.setAccessibleName("Fact probe summary")
        self.fact_table = read_only_table(FACT_PROBE_COLUMNS, "Fact probe results", stretch=False)
        self.fact_table.setWordWrap(True)                  # a long prompt wraps onto a second line
        self.fact_table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.fact_table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.fact_table.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        header = self.fact_table.horizontalHeader()
        for col, name in enumerate(FACT_PROBE_COLUMNS):
            header.setSectionResizeMode(col, QHeaderView.Stretch if name == "Prompt" else QHeaderView.ResizeToContents)
        # The stretched prompt column keeps at least its header's width: the table is never narrower than
        # every header side by side.
        self.fact_table.setMinimumWidth(sum(header_text_width(header, name) for name in FACT_PROBE_COLUMNS)
                                        + 2 * self.fact_table.frameWidth()
                                        + self.fact_table.style().pixelMetric(QStyle.PM_ScrollBarExtent))
        self.fact_table.setMinimumHeight(self.fact_table.verticalHeader().defaultSectionSize() * 5
                                         + header.sizeHint().height())
        self.fact_table.currentCellChanged.connect(lambda row, *_: self._show_fact_detail(row))
        self.fact_detail = QTextBrowser()
        self.fact_detail.setAccessibleName("Fact probe detail")
        self.fact_detail.setPlaceholderText("The selected prompt's continuations, before and after the patches.")
        self.fact_detail.setMinimumHeight(self.fact_detail.fontMetrics().lineSpacing() * 7)
        layout = QVBoxLayout(box)
        row = QHBoxLayout()
        row.addWidget(self.fact_probe_label, 1)
        row.addWidget(self.fact_probe_button)
        layout.addLayout(row)
        layout.addWidget(self.fact_table)
        layout.addWidget(self.fact_detail)
        return box

    def _build_probe(self) -> QGroupBox:
        box = QGroupBox("Probe")
        self.probe_prompt = self._line("Probe prompt", "e.g. The capital of Atlantis is")
        self.probe_button = QPushButton("Probe")
        self.probe_button.setAccessibleName("Run probe")
        self.probe_button.setToolTip("Greedy continuation and the target's probability without and with patches")
        self.probe_button.clicked.connect(self.probe)
        self.probe_prompt.returnPressed.connect(self.probe)
        self.probe_table = QTableWidget(2, 2)
        self.probe_table.setAccessibleName("Probe results")
        self.probe_table.setHorizontalHeaderLabels(["Greedy continuation", "P(first target token)"])
        self.probe_table.setVerticalHeaderLabels(["Base model", "With patches"])
        self.probe_table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.probe_table.setWordWrap(False)
        self.probe_table.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        self.probe_table.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeToContents)
        self.probe_table.setFixedHeight(self.probe_table.verticalHeader().length()
                                        + self.probe_table.horizontalHeader().sizeHint().height() + 6)
        layout = QVBoxLayout(box)
        row = QHBoxLayout()
        row.addWidget(self.probe_prompt, 1)
        row.addWidget(self.probe_button)
        layout.addLayout(row)
        layout.addWidget(self.probe_table)
        return box

    def _build_list(self) -> QGroupBox:
        box = QGroupBox("Applied patches")
        self.patch_list = QTreeWidget()
        self.patch_list.setAccessibleName("Applied patches")
        self.patch_list.setHeaderLabels(["Patch", "Layers", "Features"])
        self.patch_list.setRootIsDecorated(False)
        self.patch_list.setSelectionMode(QAbstractItemView.SingleSelection)
        self.patch_list.header().setSectionResizeMode(0, QHeaderView.Stretch)
        self.patch_list.itemSelectionChanged.connect(self._update_enabled)
        self.remove_button = QPushButton("Remove")
        self.remove_button.setAccessibleName("Remove patch")
        self.remove_button.clicked.connect(self.remove_selected)
        self.save_button = QPushButton("Save…")
        self.save_button.setAccessibleName("Save patch")
        self.save_button.clicked.connect(self._on_save)
        self.save_all_button = QPushButton("Save all…")
        self.save_all_button.setAccessibleName("Save all patches to one file")
        self.save_all_button.setToolTip("Every applied patch, in order, in one patch set file: loaded again, "
                                        "they are listed and removed one by one")
        self.save_all_button.clicked.connect(self._on_save_all)
        self.load_button = QPushButton("Load…")
        self.load_button.setAccessibleName("Load patch file")
        self.load_button.setToolTip("A patch file, or a patch set file (each of its patches listed on its own)")
        self.load_button.clicked.connect(self._on_load)
        row = QHBoxLayout()
        for button in (self.load_button, self.save_button, self.save_all_button, self.remove_button):
            row.addWidget(button)
        row.addStretch(1)
        layout = QVBoxLayout(box)
        layout.addWidget(self.patch_list, 1)
        layout.addLayout(row)
        return box

    # --- requests ---

    def _submit(self, request) -> int:
        self._pending[request.request_id] = type(request)
        self.client.submit(request)
        self._update_enabled()
        return request.request_id

    @Slot()
    def insert(self) -> int | None:
        if self.client.model is None:
            return None
        layer = self.layer.value()
        self.progress.setValue(0)
        self.progress.show()
        self.progress_label.setText("Starting INSERT…")
        self.last_insert = None
        self._insert_request = InsertFact(self.client.next_request_id(), self.entity.text(), self.relation.text(),
                                          self.target.text(), None if layer == _AUTO_LAYER else layer,
                                          self.alpha.value(), self.probe_prompt.text(),
                                          paraphrase_lines(self.paraphrases.toPlainText()))
        self.cancel_button.show()
        return self._submit(self._insert_request)

    @Slot()
    def cancel_insert(self) -> None:
        """Ask the running INSERT to stop at its next step (the worker answers InsertCancelled)."""
        if self._insert_request is not None:
            self._insert_request.cancel.set()
            self.progress_label.setText("Cancelling INSERT…")

    @Slot()
    def probe_fact(self) -> int | None:
        """Probe the last inserted fact again (e.g. after loading or removing patches)."""
        if self.client.model is None or self.last_fact is None:
            return None
        f = self.last_fact
        return self._submit(ProbeFact(self.client.next_request_id(), f.entity, f.relation, f.target,
                                      f.paraphrases))

    @Slot()
    def probe(self) -> int | None:
        if self.client.model is None:
            return None
        return self._submit(ProbePrompt(self.client.next_request_id(), self.probe_prompt.text(), self.target.text()))

    def load_file(self, path: str | Path) -> int:
        return self._submit(LoadPatchFile(self.client.next_request_id(), Path(path)))

    def save_patch(self, index: int, path: str | Path) -> int:
        """Save the patch shown in row `index` (requests name it by id: the list may change meanwhile)."""
        return self._submit(SavePatch(self.client.next_request_id(), self.patches[index].id, Path(path)))

    def save_all(self, path: str | Path) -> int:
        """Save every applied patch, in order, to one patch set file."""
        return self._submit(SavePatchSet(self.client.next_request_id(), Path(path)))

    def remove_patch(self, index: int) -> int:
        return self._submit(RemovePatch(self.client.next_request_id(), self.patches[index].id))

    @property
    def busy(self) -> bool:
        """A request of this panel is still running (or queued) in the engine thread."""
        return bool(self._pending)

    def selected_index(self) -> int | None:
        items = self.patch_list.selectedItems()
        return self.patch_list.indexOfTopLevelItem(items[0]) if items else None

    @Slot()
    def remove_selected(self) -> None:
        index = self.selected_index()
        if index is not None:
            self.remove_patch(index)

    @Slot()
    def _on_save(self) -> None:
        index = self.selected_index()
        if index is None:
            return
        name = (self.patches[index].name or f"patch-{index + 1}") + ".json"
        path, _ = QFileDialog.getSaveFileName(self, "Save patch", str(Path(self._last_dir) / name), _PATCH_FILTER)
        if path:
            self._last_dir = str(Path(path).parent)
            self.save_patch(index, path)

    @Slot()
    def _on_save_all(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save all patches", str(Path(self._last_dir) / "patches.json"),
                                              _PATCH_FILTER)
        if path:
            self._last_dir = str(Path(path).parent)
            self.save_all(path)

    @Slot()
    def _on_load(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Load patch file", self._last_dir, _PATCH_FILTER)
        if path:
            self._last_dir = str(Path(path).parent)
            self.load_file(path)

    # --- answers ---

    @Slot(object)
    def _on_insert_progress(self, event: InsertProgress) -> None:
        self.progress.setValue(round(max(0.0, min(1.0, event.fraction)) * 1000))
        self.progress_label.setText(event.message)

    @Slot(object)
    def _on_patches_shown(self, event: PatchesShown) -> None:
        self._show_patches(event)
        self._answered(event)

    @Slot(object)
    def _on_insert_cancelled(self, event: InsertCancelled) -> None:
        self.progress.hide()
        self.progress_label.setText("INSERT cancelled: nothing was applied.")
        self._pending.pop(event.request_id, None)
        self._insert_finished(event.request_id)
        self._answered(event)

    @Slot(object)
    def _on_insert_finished(self, event: InsertFinished) -> None:
        self.last_insert = event
        request = self._insert_request
        if request is not None and request.request_id == event.request_id:
            self.last_fact = ProbeFact(0, request.entity, request.relation, request.target, request.paraphrases)
        self._insert_finished(event.request_id)
        self.progress.hide()
        self.progress_label.setText(f"Inserted at layer {event.layer}, feature {event.feature}: "
                                    f"P(first target token) = {event.probability:.3f} on the fact's own prompt.")
        self._answered(event)

    @Slot(object)
    def _on_probe_answered(self, event: ProbeAnswered) -> None:
        self._show_probe(event.outcome)
        self._answered(event)

    @Slot(object)
    def _on_fact_probed(self, event: FactProbed) -> None:
        self._show_fact_probes(event)
        self._answered(event)

    @Slot(object)
    def _on_patch_saved(self, event: PatchSaved) -> None:
        self.status.setText(f"Saved {event.path}" if event.count == 1 else
                            f"Saved {event.count} patches to {event.path}")
        self._answered(event)

    def _answered(self, answer) -> None:
        """A request of this panel is done once its last answer arrives."""
        if type(answer) is _FINAL_ANSWER.get(self._pending.get(answer.request_id)):
            del self._pending[answer.request_id]
        self._update_enabled()

    def _insert_finished(self, request_id: int) -> None:
        if self._insert_request is not None and self._insert_request.request_id == request_id:
            self._insert_request = None
            self.cancel_button.hide()

    @Slot(object)
    def _on_error(self, report: ErrorReport) -> None:
        if report.request_id in self._pending:   # this panel's request (errors are routed by id, never by wording)
            self._insert_finished(report.request_id)
            self._pending.pop(report.request_id, None)
            self.progress.hide()
            self.progress_label.setText("")
            self.status.setText(f"<span style='color:#c0392b'>{report.describe()}</span>")
            self._update_enabled()

    @Slot(object)
    def _on_model_loaded(self, info: ModelInfo) -> None:
        self.layer.setMaximum(info.n_layers - 1)
        self._pending.clear()
        self.last_fact = None        # inserted into the previous model's engine
        self.last_fact_probes = None
        self.fact_table.setRowCount(0)
        self.fact_detail.clear()
        self.progress.hide()
        self._update_enabled()

    def _show_patches(self, shown: PatchesShown) -> None:
        # Events from HTTP clients and from this window may arrive out of order: never show an older state.
        # Version 0 is the full list sent after a model load, whose engine counts afresh.
        event = shown.change
        if event.version and event.version < self._patches_version:
            return
        self._patches_version = event.version
        self.patches = event.patches
        self.patch_list.clear()
        for patch in event.patches:
            features = ", ".join(f"{layer}:{feature}" for layer, feature in patch.features)
            item = QTreeWidgetItem([patch.description or patch.name or "(no description)",
                                    ", ".join(map(str, patch.layers)), features])
            item.setToolTip(0, patch.description)
            self.patch_list.addTopLevelItem(item)
        for col in (1, 2):
            self.patch_list.resizeColumnToContents(col)
        layers = ", ".join(map(str, event.overridden_layers)) or "none"
        self.status.setText(f"{len(event.patches)} patch{'es' if len(event.patches) != 1 else ''} applied; "
                            f"patched layers: {layers}")

    def _show_probe(self, result: ProbeOutcome) -> None:
        self.last_probe = result
        rows = ((result.base_text, result.base_probability), (result.patched_text, result.patched_probability))
        for row, (text, p) in enumerate(rows):
            item = QTableWidgetItem(_one_line(text))   # one line per cell; the tooltip has all
            item.setToolTip(text)
            self.probe_table.setItem(row, 0, item)
            cell = QTableWidgetItem(_probability(p))
            cell.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
            self.probe_table.setItem(row, 1, cell)
        self.probe_table.setToolTip(f"“{result.prompt}” · target “{result.target}”")

    def _show_fact_probes(self, event: FactProbed) -> None:
        self.last_fact_probes = event
        rows = event.rows
        self.fact_table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            answers = "yes" if row.answers_after else "no"
            if row.answers_after != row.answers_before:
                answers += f" (was {'yes' if row.answers_before else 'no'})"
            cells = (row.kind, row.prompt, _probability(row.p_before), _probability(row.p_after), answers)
            tips = (None, row.rendered, None, None,
                    "the reply names the target" if row.is_reply else
                    "the continuation starts with the whole target")
            for c, (text, tip) in enumerate(zip(cells, tips)):
                item = QTableWidgetItem(_one_line(text))   # the detail pane has the continuations in full
                if tip:
                    item.setToolTip(tip)
                if c in (2, 3):
                    item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                self.fact_table.setItem(r, c, item)
        self.fact_table.resizeRowsToContents()
        if rows:
            self.fact_table.setCurrentCell(0, 1)
        self._show_fact_detail(self.fact_table.currentRow())
        answered = sum(row.answers_after for row in rows)
        self.fact_probe_label.setText(f"({event.entity}, {event.relation}, {event.target}): answers on "
                                      f"{answered} of {len(rows)} prompts with the patches applied.")

    def _show_fact_detail(self, row: int) -> None:
        """The selected probe row in full: its prompt, and what the model continued it with before and after."""
        rows = self.last_fact_probes.rows if self.last_fact_probes is not None else ()
        if not 0 <= row < len(rows):
            self.fact_detail.clear()
            return
        probe = rows[row]

        def para(title: str, text: str, p: float | None = None) -> str:
            chance = f" <span style='color:gray'>P(target) = {_probability(p)}</span>" if p is not None else ""
            body = html.escape(text).replace("\n", "<br>")
            return f"<p><b>{title}</b>{chance}<br>{body}</p>"

        self.fact_detail.setHtml(para(f"{probe.kind.capitalize()} prompt", probe.prompt)
                                 + para("Before", probe.before, probe.p_before)
                                 + para("After", probe.after, probe.p_after))

    @property
    def fact_detail_text(self) -> str:
        return self.fact_detail.toPlainText()

    @Slot()
    def _suggest_probe(self) -> None:
        """Keep the probe prompt in step with the fact while the user has not typed their own."""
        entity, relation = self.entity.text().strip(), self.relation.text().strip()
        current = self.probe_prompt.text()
        if current and current != getattr(self, "_suggested", None):
            return
        words = relation.replace("-", " ").replace("_", " ").split()
        if len(words) > 1 and words[-1].lower() == "of":
            words = words[:-1]
        self._suggested = f"The {' '.join(words)} of {entity} is" if entity and words else ""
        self.probe_prompt.setText(self._suggested)

    @Slot()
    def _update_enabled(self) -> None:
        loaded = self.client.model is not None and not self.client.loading
        busy = bool(self._pending)
        self.insert_button.setEnabled(loaded and not busy)
        self.probe_button.setEnabled(loaded and not busy)
        self.fact_probe_button.setEnabled(loaded and not busy and self.last_fact is not None)
        self.load_button.setEnabled(loaded and not busy)
        selected = self.selected_index() is not None
        self.save_button.setEnabled(loaded and selected and not busy)
        self.save_all_button.setEnabled(loaded and bool(self.patches) and not busy)
        self.remove_button.setEnabled(loaded and selected and not busy)

    # --- settings ---

    def save(self, store: QSettings, group: str = "patches") -> None:
        store.beginGroup(group)
        store.setValue("last_dir", self._last_dir)
        store.setValue("entity", self.entity.text())
        store.setValue("relation", self.relation.text())
        store.setValue("target", self.target.text())
        store.setValue("paraphrases", self.paraphrases.toPlainText())
        store.setValue("probe", self.probe_prompt.text())
        store.setValue("alpha", self.alpha.value())
        store.endGroup()

    def restore(self, store: QSettings, group: str = "patches") -> None:
        store.beginGroup(group)
        self._last_dir = str(store.value("last_dir", self._last_dir))
        for edit, key in ((self.entity, "entity"), (self.relation, "relation"), (self.target, "target"),
                          (self.probe_prompt, "probe")):
            edit.setText(str(store.value(key, "")))
        self.paraphrases.setPlainText(str(store.value("paraphrases", "")))
        try:
            self.alpha.setValue(float(store.value("alpha", 0.1)))
        except (TypeError, ValueError):
            pass
        store.endGroup()


def header_text_width(header: QHeaderView, text: str) -> int:
    """The width a header section needs to show `text` whole (its text, the style's margins on both sides)."""
    margin = header.style().pixelMetric(QStyle.PM_HeaderMargin, None, header)
    return header.fontMetrics().horizontalAdvance(text) + 2 * margin + 4


def _keep_place_when_hidden(widget: QWidget) -> None:
    """A widget that comes and goes (INSERT's Cancel and progress) keeps its place, so showing it never widens
    the form."""
    policy = widget.sizePolicy()
    policy.setRetainSizeWhenHidden(True)
    widget.setSizePolicy(policy)
