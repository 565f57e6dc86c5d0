"""The reply as the token view, on the real window and the real SmolLM2, offscreen: the chat's tokens shaded by the
stored probabilities and cache outcomes (hover: alternatives; click: the token view), the reply x layer map's cells
equal to the engine's recorded outcomes with INSERT fired where an inserted feature fires, a click on a cell opening
that pass's features, the logit lens of a token (its last layer the model's own prediction) and the feature table's
promoted tokens."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import QPoint, QPointF, Qt  # noqa: E402
from PySide6.QtGui import QTextCursor  # noqa: E402

from larql_desktop.engine.analysis.reply_pass import Cell, cell_of  # noqa: E402
from larql_desktop.engine.model.overlay import Patch, PatchOperation  # noqa: E402
from larql_desktop.qt import token_shading  # noqa: E402
from larql_desktop.qt.qt_chat_tab import TOKEN_PROPERTY  # noqa: E402
from larql_desktop.qt.qt_reply_views import CELL_COLOURS  # noqa: E402
from test_qt_app import REPLY_TIMEOUT, loaded, send, settings_file, window  # noqa: E402,F401

PROMPT = "How many legs does a spider have?"
FIRING_LAYER = 3


def expected_probability_colour(event) -> str | None:
    """The probability shade, from the bin edges the legend states (P < 0.1, 0.1-0.3, 0.3-0.5, 0.5-0.8, >= 0.8)."""
    p = next((a.probability for a in event.alternatives if a.token_id == event.token_id), None)
    if p is None:
        return token_shading.NOT_IN_TOP[0]
    colours = [c for _, c, _ in token_shading.PROBABILITY_BINS]
    return colours[sum(p >= edge for edge in (0.1, 0.3, 0.5, 0.8))]


def expected_cache_colour(event) -> str:
    hits = sum(o.outcome == "hit" for o in event.layers)
    colours = [c for _, c, _ in token_shading.CACHE_BINS]
    return colours[0 if hits == 0 else 3 if hits == len(event.layers) else 1 if 2 * hits < len(event.layers)
                   else 2]


def test_the_shaded_reply_follows_the_stored_probabilities_and_cache_outcomes(loaded, qtbot):
    win = loaded
    send(qtbot, win, PROMPT, max_tokens=12)
    tab = win.current_tab()
    turn = tab.transcript.replies()[-1]
    assert win.shading == token_shading.NONE and tab.shaded_tokens() == []      # off by default: Markdown

    win.set_shading(token_shading.PROBABILITY)
    shown = tab.shaded_tokens()
    index = tab.transcript.turns.index(turn)
    assert {t for t, _, _, _ in shown} == {index}
    assert "".join(text for _, _, text, _ in shown) == turn.text                # the reply, token by token
    assert [number for _, number, _, _ in shown] == sorted({number for _, number, _, _ in shown})
    for _, number, _, colour in shown:
        assert colour == expected_probability_colour(turn.tokens[number])
    assert "P ≥ 0.8" in win.shade_legend.text()

    # The same prompt in a new chat hits the shared L2: its tokens shade by how many layers hit.
    win.set_shading(token_shading.CACHE)
    qtbot.keyClick(win.current_tab().input, Qt.Key_N, Qt.ControlModifier)
    send(qtbot, win, PROMPT, max_tokens=12)
    tab = win.current_tab()
    turn = tab.transcript.replies()[-1]
    shown = tab.shaded_tokens()
    assert shown and all(colour == expected_cache_colour(turn.tokens[n]) for _, n, _, colour in shown)
    assert any(colour != token_shading.CACHE_BINS[0][1] for _, _, _, colour in shown)   # some layers hit

    # Hover: the token's tooltip lists its alternatives; click: the token view opens on that token.
    _, number, _, _ = shown[min(2, len(shown) - 1)]
    event = turn.tokens[number]
    point = token_point(tab, number)
    fmt = tab._token_format_at(point)
    assert fmt is not None and all(token_shading.visible(a.text) in fmt.toolTip() or "&" in fmt.toolTip()
                                   for a in event.alternatives)
    qtbot.mouseClick(tab.view.viewport(), Qt.LeftButton, pos=point)
    assert win.token_view.tokens.currentRow() == number and win.token_view.events == turn.tokens

    win.set_shading(token_shading.NONE)
    assert tab.shaded_tokens() == []


def token_point(tab, number: int) -> QPoint:
    """The viewport point in the middle of a shaded token's first character."""
    doc = tab.view.document()
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            fmt = fragment.charFormat()
            if fmt.hasProperty(TOKEN_PROPERTY) and fmt.intProperty(TOKEN_PROPERTY) == number:
                cursor = QTextCursor(doc)
                cursor.setPosition(fragment.position())
                left = tab.view.cursorRect(cursor)
                cursor.setPosition(fragment.position() + 1)
                right = tab.view.cursorRect(cursor)
                return QPoint((left.x() + right.x()) // 2, left.center().y())
            it += 1
        block = block.next()
    raise AssertionError(f"token {number} is not shown")


def firing_patch(win) -> Patch:
    """A gated override at FIRING_LAYER whose biased gate is positive for every input (zero vectors: it writes
    nothing), and one at the next layer that never fires."""
    engine = win.client.worker.engine
    zeros = np.zeros(win.client.model.hidden, np.float32)
    ops = (PatchOperation("insert", FIRING_LAYER, 11, zeros, zeros, zeros, gate_bias=1.0, entity="e", relation="r",
                          target="t"),
           PatchOperation("insert", FIRING_LAYER + 1, 12, zeros, zeros, zeros, gate_bias=-1.0, entity="e",
                          relation="r", target="t"))
    return Patch(ops, engine.model.name, engine.model.checksum, "fires at one layer")


def test_the_reply_map_shows_the_recorded_outcomes_insert_fired_and_opens_a_cells_features(loaded, qtbot,
                                                                                        tmp_path):
    win = loaded
    path = tmp_path / "firing.json"
    firing_patch(win).save(path)
    with qtbot.waitSignal(win.client.patches_shown, timeout=REPLY_TIMEOUT,
                          check_params_cb=lambda e: e.change.overridden_layers):
        win.patch_editor.load_file(path)
    win.reply_map_dock.show()
    win.reply_map_dock.raise_()
    with qtbot.waitSignal(win.client.reply_analysed, timeout=REPLY_TIMEOUT):
        send(qtbot, win, PROMPT, max_tokens=8)
    qtbot.waitUntil(lambda: win.reply_map.fired is not None, timeout=REPLY_TIMEOUT)
    turn = win.current_tab().transcript.replies()[-1]
    assert win.reply_map.turn is turn
    n_layers = win.client.model.n_layers
    grid = win.reply_map.grid
    assert grid.shape == (n_layers, len(turn.tokens))
    for t, event in enumerate(turn.tokens):
        recorded = {o.layer: cell_of(o) for o in event.layers}
        # What the engine recorded there: the first token's pass is the prompt's prefill.
        assert recorded[FIRING_LAYER] == (Cell.BYPASS_PREFILL if t == 0 else Cell.BYPASS_PATCHED)
        for layer in range(n_layers):
            expected = Cell.INSERT_FIRED if layer == FIRING_LAYER else recorded[layer]
            assert grid[layer, t] == expected, (t, layer)
    assert turn.fired == {t: (FIRING_LAYER,) for t in range(len(turn.tokens))}
    # The picture draws each cell in its outcome's colour.
    colours = win.reply_map.image_colours()
    for layer, t in ((0, 0), (FIRING_LAYER, len(turn.tokens) - 1), (n_layers - 1, 1)):
        assert "#%02x%02x%02x" % tuple(colours[layer, t]) == CELL_COLOURS[Cell(grid[layer, t])]

    # A click on a cell: that token in the token view and its pass's features at that layer.
    token, layer = 1, 7
    target = win.reply_map.plot.vb.mapViewToScene(QPointF(token + 0.5, layer + 0.5))
    widget_point = win.reply_map.plot_widget.mapFromScene(target)
    with qtbot.waitSignal(win.client.features_shown, timeout=REPLY_TIMEOUT) as answered:
        qtbot.mouseClick(win.reply_map.plot_widget.viewport(), Qt.LeftButton, pos=widget_point)
    assert win.token_view.tokens.currentRow() == token
    assert answered.args[0].view.layer == layer and answered.args[0].view.position == turn.tokens[token].position

    # Shading by INSERT fired marks every token (the override fires everywhere).
    win.set_shading(token_shading.INSERT)
    shown = win.current_tab().shaded_tokens()
    assert shown and all(colour == token_shading.FIRED[0] for _, _, _, colour in shown)


def test_the_logit_lens_ends_at_the_models_own_prediction_and_features_show_promoted_tokens(loaded, qtbot):
    win = loaded
    send(qtbot, win, PROMPT, max_tokens=6)
    turn = win.current_tab().transcript.replies()[-1]
    win.show_tokens(win.current_tab(), win.current_tab().transcript.turns.index(turn), 2)
    event = turn.tokens[2]
    with qtbot.waitSignal(win.client.lens_shown, timeout=REPLY_TIMEOUT) as answered:
        win.token_view.show_lens()
    lens = answered.args[0].lens
    table = win.token_view.lens.table
    assert table.rowCount() == win.client.model.n_layers == len(lens.layers)
    last = lens.layers[-1]
    # Greedy: the model chose its own top token; the lens's last layer reads the same distribution.
    assert last.top_ids[0] == event.token_id and last.chosen_rank == 1 and table.item(table.rowCount() - 1, 2).text() == "1"
    own = {a.token_id: a.probability for a in event.alternatives}
    for token_id, p in zip(last.top_ids, last.top_probabilities):
        if token_id in own:
            assert p == pytest.approx(own[token_id], abs=0.02)
    assert set(last.top_ids[:2]) <= set(own)

    # The feature table shows each feature's promoted tokens.
    with qtbot.waitSignal(win.client.features_shown, timeout=REPLY_TIMEOUT) as answered:
        win.token_view.show_features(5)
    result = answered.args[0]
    features = win.token_view.features
    assert len(result.promoted) == len(result.view.rows) == features.table.rowCount() > 0
    for row, (feature_row, promoted) in enumerate(zip(result.view.rows, result.promoted)):
        assert promoted.feature == feature_row.feature and promoted.layer == 5
        assert features.table.item(row, 4).text() == " ".join(token_shading.visible(t) for t in promoted.texts)
