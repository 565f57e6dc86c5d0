"""The sampling settings panel of the chat in front: its system prompt, a preset, max tokens, temperature,
top-p, top-k, min-p, repeat penalty, stop strings and seed."""
from __future__ import annotations

import json

from PySide6.QtCore import QSettings, QSignalBlocker, Signal
from PySide6.QtWidgets import (QComboBox, QDoubleSpinBox, QFormLayout, QFrame, QLabel, QPlainTextEdit, QScrollArea,
                               QSpinBox, QVBoxLayout, QWidget)

from larql_desktop.engine.model.generation import PRESETS, SamplingSettings, apply_preset, preset_of

_RANDOM_SEED = -1   # the seed box's special value
_CUSTOM = "Custom"


def _number(value, kind, default):
    try:
        return kind(value)
    except (TypeError, ValueError):
        return default


def stored_sampling(values: dict) -> SamplingSettings:
    """SamplingSettings from stored strings (INI files give back text); anything invalid falls back to defaults."""
    d = SamplingSettings()
    seed = _number(values.get("seed"), int, None)
    try:
        stop = json.loads(values.get("stop") or "[]")
    except ValueError:
        stop = []
    try:
        return SamplingSettings(max_tokens=_number(values.get("max_tokens"), int, d.max_tokens),
                                temperature=_number(values.get("temperature"), float, d.temperature),
                                top_p=_number(values.get("top_p"), float, d.top_p),
                                seed=None if seed is None or seed < 0 else seed,
                                top_k=_number(values.get("top_k"), int, d.top_k),
                                min_p=_number(values.get("min_p"), float, d.min_p),
                                repeat_penalty=_number(values.get("repeat_penalty"), float, d.repeat_penalty),
                                stop=tuple(stop) if isinstance(stop, list) else ())
    except ValueError:
        return d


def parse_stop_strings(text: str) -> tuple[str, ...]:
    """One stop string per line; \\n and \\t stand for a newline and a tab."""
    return tuple(line.replace("\\n", "\n").replace("\\t", "\t") for line in text.splitlines() if line)


def format_stop_strings(stop: tuple[str, ...]) -> str:
    return "\n".join(s.replace("\n", "\\n").replace("\t", "\\t") for s in stop)


class SamplingPanel(QWidget):
    changed = Signal()                 # a sampling setting changed (by the user or a preset)
    system_prompt_changed = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setToolTip("This chat's system prompt; empty: the model's own default (shown greyed)")
        self.system_prompt.setMaximumHeight(90)
        self.default_prompt = QLabel()
        self.default_prompt.setWordWrap(True)
        self.default_prompt.setAccessibleName("Template default system prompt")
        self.preset = QComboBox()
        self.preset.addItems([_CUSTOM, *PRESETS])
        self.preset.setAccessibleName("Sampling preset")
        self.preset.setToolTip("Greedy: always the most likely token. Balanced and Creative sample more freely")
        self.max_tokens = QSpinBox(minimum=1, maximum=100_000, singleStep=32)
        self.max_tokens.setAccessibleName("Max tokens")
        self.max_tokens.setToolTip("Longest reply, in tokens")
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=5.0, singleStep=0.1, decimals=2)
        self.temperature.setSpecialValueText("0 (greedy)")
        self.temperature.setAccessibleName("Temperature")
        self.temperature.setToolTip("0 always picks the most likely token")
        self.top_p = QDoubleSpinBox(minimum=0.01, maximum=1.0, singleStep=0.05, decimals=2)
        self.top_p.setAccessibleName("Top-p")
        self.top_p.setToolTip("Sample only from the most likely tokens whose probabilities add up to this")
        self.top_k = QSpinBox(minimum=0, maximum=100_000)
        self.top_k.setSpecialValueText("off")
        self.top_k.setAccessibleName("Top-k")
        self.top_k.setToolTip("Sample only from this many most likely tokens")
        self.min_p = QDoubleSpinBox(minimum=0.0, maximum=0.99, singleStep=0.01, decimals=2)
        self.min_p.setSpecialValueText("off")
        self.min_p.setAccessibleName("Min-p")
        self.min_p.setToolTip("Drop tokens less likely than this fraction of the most likely one")
        self.repeat_penalty = QDoubleSpinBox(minimum=0.5, maximum=3.0, singleStep=0.05, decimals=2)
        self.repeat_penalty.setAccessibleName("Repeat penalty")
        self.repeat_penalty.setToolTip("Above 1 makes tokens of the last 64 less likely (1: off)")
        self.stop = QPlainTextEdit()
        self.stop.setAccessibleName("Stop strings")
        self.stop.setPlaceholderText("one per line; \\n for a newline")
        self.stop.setToolTip("The reply ends before the first of these strings")
        self.stop.setMaximumHeight(60)
        self.seed = QSpinBox(minimum=_RANDOM_SEED, maximum=2**31 - 1)
        self.seed.setSpecialValueText("random")
        self.seed.setAccessibleName("Seed")
        self.seed.setToolTip("Fixes the random choices of sampling; 'random' draws a new seed each reply")
        form = QWidget()
        column = QVBoxLayout(form)
        layout = QFormLayout()
        column.addLayout(layout)
        column.addStretch(1)   # spare height below the fields, not between them
        layout.addRow("System prompt", self.system_prompt)
        layout.addRow("", self.default_prompt)
        layout.addRow("Preset", self.preset)
        layout.addRow("Max tokens", self.max_tokens)
        layout.addRow("Temperature", self.temperature)
        layout.addRow("Top-p", self.top_p)
        layout.addRow("Top-k", self.top_k)
        layout.addRow("Min-p", self.min_p)
        layout.addRow("Repeat penalty", self.repeat_penalty)
        layout.addRow("Stop strings", self.stop)
        layout.addRow("Seed", self.seed)
        scroll = QScrollArea()   # scrolls rather than make the dock (and so the window) taller
        scroll.setWidget(form)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.NoFrame)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scroll)
        self.set_default_system_prompt(None)
        self.set_settings(SamplingSettings())
        for box in (self.max_tokens, self.temperature, self.top_p, self.top_k, self.min_p, self.repeat_penalty,
                    self.seed):
            box.valueChanged.connect(self._on_changed)
        self.stop.textChanged.connect(self._on_changed)
        self.preset.activated.connect(self._on_preset)
        self.system_prompt.textChanged.connect(self.system_prompt_changed)

    def settings(self) -> SamplingSettings:
        """Raises ValueError if the engine refuses the values."""
        seed = self.seed.value()
        return SamplingSettings(max_tokens=self.max_tokens.value(), temperature=self.temperature.value(),
                                top_p=self.top_p.value(), seed=None if seed == _RANDOM_SEED else seed,
                                top_k=self.top_k.value(), min_p=self.min_p.value(),
                                repeat_penalty=self.repeat_penalty.value(),
                                stop=parse_stop_strings(self.stop.toPlainText()))

    def set_settings(self, settings: SamplingSettings) -> None:
        """Show a chat's settings (no `changed` signal: nothing changed for that chat)."""
        boxes = (self.max_tokens, self.temperature, self.top_p, self.top_k, self.min_p, self.repeat_penalty,
                 self.seed, self.stop, self.preset)
        blockers = [QSignalBlocker(b) for b in boxes]
        self.max_tokens.setValue(settings.max_tokens)
        self.temperature.setValue(settings.temperature)
        self.top_p.setValue(settings.top_p)
        self.top_k.setValue(settings.top_k)
        self.min_p.setValue(settings.min_p)
        self.repeat_penalty.setValue(settings.repeat_penalty)
        self.seed.setValue(_RANDOM_SEED if settings.seed is None else settings.seed)
        if parse_stop_strings(self.stop.toPlainText()) != settings.stop:
            self.stop.setPlainText(format_stop_strings(settings.stop))
        self.preset.setCurrentText(preset_of(settings) or _CUSTOM)
        del blockers

    # --- the system prompt ---

    def chat_system_prompt(self) -> str | None:
        """None when the box is empty: the chat uses the model's default."""
        text = self.system_prompt.toPlainText()
        return text if text.strip() else None

    def set_chat_system_prompt(self, prompt: str | None) -> None:
        with QSignalBlocker(self.system_prompt):
            self.system_prompt.setPlainText(prompt or "")

    def set_default_system_prompt(self, default: str | None) -> None:
        self.system_prompt.setPlaceholderText(default or "no system prompt")
        self.default_prompt.setText(f"Empty: the model's default, “{default}”" if default
                                    else "Empty: no system prompt (the model has no default; a base model "
                                         "takes none)")

    def apply_preset(self, name: str) -> None:
        self.set_settings(apply_preset(self.settings(), name))
        self.changed.emit()

    def _on_preset(self, index: int) -> None:
        name = self.preset.itemText(index)
        if name in PRESETS:
            try:
                self.apply_preset(name)
            except ValueError:
                pass   # the other values are refused; `changed` reports that on the next edit

    def _on_changed(self) -> None:
        try:
            current = preset_of(self.settings()) or _CUSTOM
        except ValueError:
            current = _CUSTOM
        with QSignalBlocker(self.preset):
            self.preset.setCurrentText(current)
        self.changed.emit()

    def save(self, store: QSettings, group: str = "sampling") -> None:
        s = self.settings()
        store.beginGroup(group)
        store.setValue("max_tokens", s.max_tokens)
        store.setValue("temperature", s.temperature)
        store.setValue("top_p", s.top_p)
        store.setValue("top_k", s.top_k)
        store.setValue("min_p", s.min_p)
        store.setValue("repeat_penalty", s.repeat_penalty)
        store.setValue("stop", json.dumps(list(s.stop)))
        store.setValue("seed", _RANDOM_SEED if s.seed is None else s.seed)
        store.endGroup()

    def restore(self, store: QSettings, group: str = "sampling") -> None:
        store.beginGroup(group)
        values = {key: store.value(key) for key in store.childKeys()}
        store.endGroup()
        self.set_settings(stored_sampling(values))
