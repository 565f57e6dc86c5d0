"""The sampling settings panel: max tokens, temperature, top-p, seed."""
from __future__ import annotations

from PySide6.QtCore import QSettings, Signal
from PySide6.QtWidgets import QDoubleSpinBox, QFormLayout, QSpinBox, QWidget

from larql_desktop.engine.model.generation import SamplingSettings

_RANDOM_SEED = -1   # the seed box's special value


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
        return SamplingSettings(max_tokens=_number(values.get("max_tokens"), int, d.max_tokens),
                                temperature=_number(values.get("temperature"), float, d.temperature),
                                top_p=_number(values.get("top_p"), float, d.top_p),
                                seed=None if seed is None or seed < 0 else seed)
    except ValueError:
        return d


class SamplingPanel(QWidget):
    changed = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
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
        self.seed = QSpinBox(minimum=_RANDOM_SEED, maximum=2**31 - 1)
        self.seed.setSpecialValueText("random")
        self.seed.setAccessibleName("Seed")
        self.seed.setToolTip("Fixes the random choices of sampling; 'random' draws a new seed each reply")
        layout = QFormLayout(self)
        layout.addRow("Max tokens", self.max_tokens)
        layout.addRow("Temperature", self.temperature)
        layout.addRow("Top-p", self.top_p)
        layout.addRow("Seed", self.seed)
        self.set_settings(SamplingSettings())
        for box in (self.max_tokens, self.temperature, self.top_p, self.seed):
            box.valueChanged.connect(self.changed)

    def settings(self) -> SamplingSettings:
        """Raises ValueError if the engine refuses the values."""
        seed = self.seed.value()
        return SamplingSettings(max_tokens=self.max_tokens.value(), temperature=self.temperature.value(),
                                top_p=self.top_p.value(), seed=None if seed == _RANDOM_SEED else seed)

    def set_settings(self, settings: SamplingSettings) -> None:
        self.max_tokens.setValue(settings.max_tokens)
        self.temperature.setValue(settings.temperature)
        self.top_p.setValue(settings.top_p)
        self.seed.setValue(_RANDOM_SEED if settings.seed is None else settings.seed)

    def save(self, store: QSettings, group: str = "sampling") -> None:
        s = self.settings()
        store.beginGroup(group)
        store.setValue("max_tokens", s.max_tokens)
        store.setValue("temperature", s.temperature)
        store.setValue("top_p", s.top_p)
        store.setValue("seed", _RANDOM_SEED if s.seed is None else s.seed)
        store.endGroup()

    def restore(self, store: QSettings, group: str = "sampling") -> None:
        store.beginGroup(group)
        values = {key: store.value(key) for key in store.childKeys()}
        store.endGroup()
        self.set_settings(stored_sampling(values))
