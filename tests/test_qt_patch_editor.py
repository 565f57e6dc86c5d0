"""The patch editor's side of INSERT on the real window and the real SmolLM2, offscreen: paraphrases in the form,
the fact probe table after an insert and on demand, and a chat tab answering with the patches applied (after an
INSERT and after loading a patch file). Cancelling an INSERT is covered in test_qt_panels.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("pytestqt")

from PySide6.QtCore import QSettings, Qt  # noqa: E402

from larql_desktop.cli import serve_api  # noqa: E402
from larql_desktop.engine.core import LarqlEngine  # noqa: E402
from larql_desktop.engine.loading import chat_prompt_ids  # noqa: E402
from larql_desktop.engine.patches.insert import QUESTIONS, Fact, fill  # noqa: E402
from larql_desktop.engine.model.overlay import Patch, PatchOperation, PatchOverlay, save_patch_set  # noqa: E402
from larql_desktop.engine.services import CHAT_PROBE_TOKENS  # noqa: E402
from larql_desktop.qt.main_window import MainWindow  # noqa: E402
from larql_desktop.qt.qt_patch_editor import FACT_PROBE_COLUMNS, paraphrase_lines  # noqa: E402
from larql_desktop.qt.worker import EngineClient  # noqa: E402
from test_qt_app import REPLY_TIMEOUT, loaded, send, settings_file, window  # noqa: E402,F401
from test_qt_panels import INSERT_TIMEOUT  # noqa: E402

FACT = Fact("Atlantis", "capital-of", "Poseidon")
PARAPHRASES = ("Atlantis has its capital at", "The city that rules Atlantis is")
QUESTION = fill(QUESTIONS[0], FACT.relation_words, FACT.entity)
CHAT_TOKENS = CHAT_PROBE_TOKENS      # the probe table's chat row reads as many


@pytest.fixture(scope="module")
def saved_patch(smollm2, tmp_path_factory, capture_store):
    """One real INSERT of the module's fact (no paraphrases), saved as a patch file for the window to load."""
    engine = LarqlEngine(smollm2, capture_store=capture_store)
    result = engine.insert(FACT)
    path = tmp_path_factory.mktemp("patches") / "atlantis.json"
    result.patch.save(path)
    return path


def expected_chat_replies(win, question: str, tokens: int) -> tuple[str, str]:
    """The engine's own greedy replies (without patches, with the applied ones) to `question` as the first turn of
    a new chat with the template's default system prompt: what the chat tab must show."""
    engine = win.client.worker.engine
    inserter = engine.inserter()
    ids = chat_prompt_ids(engine.model, question)
    decode = engine.model.tokenizer.decode
    return (decode(inserter.greedy(ids, PatchOverlay(), tokens)),
            decode(inserter.greedy(ids, engine.patches, tokens)))


def ask_in_a_new_chat(qtbot, win, question: str) -> str:
    qtbot.keyClick(win.current_tab().input, Qt.Key_N, Qt.ControlModifier)
    assert win.current_tab().system_prompt is None          # the template's default, as a new chat has it
    _, finished = send(qtbot, win, question, max_tokens=CHAT_TOKENS)
    return finished.text


def table_rows(editor) -> list[list[str]]:
    table = editor.fact_table
    return [[table.item(r, c).text() for c in range(table.columnCount())] for r in range(table.rowCount())]


def test_paraphrase_lines_drop_blanks_and_repeats():
    assert paraphrase_lines("  one \n\n two\none\n   \n") == ("one", "two")
    assert paraphrase_lines("") == ()


def test_an_insert_with_paraphrases_shows_the_fact_probe_table_and_the_chat_answers_with_it(loaded, qtbot):
    editor = loaded.patch_editor
    qtbot.keyClicks(editor.entity, FACT.entity)
    qtbot.keyClicks(editor.relation, FACT.relation)
    qtbot.keyClicks(editor.target, FACT.target)
    editor.paraphrases.setPlainText("\n".join(PARAPHRASES) + "\n\n")
    assert not editor.fact_probe_button.isEnabled()          # nothing inserted yet
    qtbot.mouseClick(editor.insert_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: editor.last_insert is not None and not editor.busy, timeout=INSERT_TIMEOUT)
    # The form's lines (blank ones dropped) reach the engine's insert and the probe.
    assert editor.last_fact.paraphrases == PARAPHRASES
    assert "2 paraphrase(s) given" in editor.patches[0].description

    probed = editor.last_fact_probes
    assert probed is not None and probed.request_id == editor.last_insert.request_id
    kinds = [row.kind for row in probed.rows]
    assert kinds == ["canonical", "paraphrase", "paraphrase", "chat", "conversation"]
    assert [row.prompt for row in probed.rows] == [FACT.canonical_prompt, *PARAPHRASES, QUESTION, QUESTION]
    assert all(0.0 <= p <= 1.0 for row in probed.rows for p in (row.p_before, row.p_after))
    canonical = probed.rows[0]
    assert canonical.answers_after and not canonical.answers_before
    assert canonical.after != canonical.before and canonical.after.lstrip().startswith(FACT.target)
    assert canonical.p_after > 10 * canonical.p_before
    # The chat row is what a new chat tab sends: the question through the template, default system prompt.
    chat, in_conversation = probed.rows[-2:]
    default_system = loaded.client.model.default_system_prompt
    assert default_system and default_system in chat.rendered
    assert chat.rendered.startswith("<|im_start|>system") and chat.rendered.endswith("<|im_start|>assistant\n")
    assert f"<|im_start|>user\n{QUESTION}<|im_end|>" in chat.rendered
    # The conversation row asks the same question after an earlier exchange: a longer chat ending the same way.
    assert in_conversation.rendered.endswith(chat.rendered[chat.rendered.index("<|im_start|>user"):])
    assert in_conversation.rendered.count("<|im_start|>user") == 2

    # The table shows the same rows, the rendered chat prompt in the prompt's tooltip; the detail pane the
    # selected row's continuations in full.
    columns = FACT_PROBE_COLUMNS
    assert [editor.fact_table.horizontalHeaderItem(c).text() for c in range(len(columns))] == columns
    rows = table_rows(editor)
    assert [r[0] for r in rows] == kinds and rows[0][1] == FACT.canonical_prompt
    assert rows[0][columns.index("Answers")] == "yes (was no)"
    assert rows[0][columns.index("P after")] == f"{canonical.p_after:.3f}"
    assert editor.fact_table.currentRow() == 0 and canonical.after.strip() in editor.fact_detail_text
    assert editor.fact_table.item(3, 1).toolTip() == chat.rendered
    assert editor.fact_table.item(4, 1).toolTip() == in_conversation.rendered
    answered = sum(row.answers_after for row in probed.rows)
    assert f"answers on {answered} of 5 prompts" in editor.fact_probe_label.text()

    # The chat tab answers with the patch on: its reply is the engine's patched greedy reply to that prompt.
    before, after = expected_chat_replies(loaded, QUESTION, CHAT_TOKENS)
    assert after != before                                   # the patch visibly changes this reply
    assert ask_in_a_new_chat(qtbot, loaded, QUESTION) == after
    assert chat.after == after and chat.before == before     # the probe's chat row saw the same replies

    # "Probe fact" probes the last inserted fact again: with the patch removed, after equals before.
    editor.patch_list.setCurrentItem(editor.patch_list.topLevelItem(0))
    editor.remove_selected()
    qtbot.waitUntil(lambda: not editor.busy and editor.patch_list.topLevelItemCount() == 0, timeout=REPLY_TIMEOUT)
    assert editor.fact_probe_button.isEnabled()
    with qtbot.waitSignal(loaded.client.fact_probed, timeout=REPLY_TIMEOUT):
        qtbot.mouseClick(editor.fact_probe_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: not editor.busy, timeout=REPLY_TIMEOUT)
    again = editor.last_fact_probes
    assert again.request_id != probed.request_id and [r.kind for r in again.rows] == kinds
    assert all(r.after == r.before and r.p_after == r.p_before for r in again.rows)
    assert again.rows[0].before == canonical.before            # the unpatched half does not depend on patches
    assert table_rows(editor)[0][FACT_PROBE_COLUMNS.index("Answers")] == "no"


def test_a_chat_tab_answers_with_a_loaded_patch_file(loaded, qtbot, saved_patch):
    before_loading = ask_in_a_new_chat(qtbot, loaded, QUESTION)
    editor = loaded.patch_editor
    editor.load_file(saved_patch)
    qtbot.waitUntil(lambda: not editor.busy and editor.patch_list.topLevelItemCount() == 1, timeout=REPLY_TIMEOUT)
    before, after = expected_chat_replies(loaded, QUESTION, CHAT_TOKENS)
    assert before_loading == before and after != before
    assert ask_in_a_new_chat(qtbot, loaded, QUESTION) == after
    assert editor.last_fact is None and not editor.fact_probe_button.isEnabled()   # no INSERT was made here


def test_a_patch_set_file_is_listed_and_removed_one_by_one_and_saved_whole(loaded, qtbot, smollm2, tmp_path):
    editor = loaded.patch_editor
    engine = loaded.client.worker.engine
    start = [p.id for p in engine.applied_patches]
    rng = np.random.default_rng(3)
    made = [Patch((PatchOperation("update", layer, 300 + i,
                                  down=rng.standard_normal(smollm2.config.hidden).astype(np.float32) * 0.01),),
                  smollm2.name, smollm2.checksum, description=f"fact {i}").named(f"fact {i}")
            for i, layer in enumerate((3, 8, 12))]
    path = tmp_path / "facts.json"
    save_patch_set(made, path)
    editor.load_file(path)
    qtbot.waitUntil(lambda: not editor.busy and editor.patch_list.topLevelItemCount() == len(start) + 3,
                    timeout=REPLY_TIMEOUT)
    rows = [editor.patch_list.topLevelItem(i).text(0) for i in range(editor.patch_list.topLevelItemCount())]
    assert rows[len(start):] == ["fact 0", "fact 1", "fact 2"]

    editor.patch_list.setCurrentItem(editor.patch_list.topLevelItem(len(start) + 1))    # "fact 1"
    qtbot.mouseClick(editor.remove_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: not editor.busy and editor.patch_list.topLevelItemCount() == len(start) + 2,
                    timeout=REPLY_TIMEOUT)
    assert [p.id for p in engine.applied_patches] == start + [made[0].id, made[2].id]

    assert editor.save_all_button.isEnabled()
    saved = tmp_path / "all.json"
    editor.save_all(saved)
    qtbot.waitUntil(lambda: not editor.busy, timeout=REPLY_TIMEOUT)
    assert [e["name"] for e in json.loads(saved.read_text())["patches"]][len(start):] == ["fact 0", "fact 2"]
    assert [p.id for p in engine.read_patches(saved)] == start + [made[0].id, made[2].id]
    assert editor.status.text() == f"Saved {len(start) + 2} patches to {saved}"
    for patch in (made[0], made[2]):        # the list as this test found it
        editor.remove_patch([s.id for s in editor.patches].index(patch.id))
        qtbot.waitUntil(lambda: not editor.busy, timeout=REPLY_TIMEOUT)
    assert [p.id for p in engine.applied_patches] == start


def test_the_paraphrases_are_remembered(qtbot, qapp, app_paths, settings_file):  # noqa: F811
    def make():
        win = MainWindow(EngineClient(app_paths, serve=serve_api), QSettings(str(settings_file), QSettings.IniFormat),
                         qapp)
        win.show()
        return win

    win = make()
    try:
        win.patch_editor.entity.setText(FACT.entity)
        win.patch_editor.paraphrases.setPlainText("\n".join(PARAPHRASES))
    finally:
        win.close()
    again = make()
    try:
        assert again.patch_editor.entity.text() == FACT.entity
        assert paraphrase_lines(again.patch_editor.paraphrases.toPlainText()) == PARAPHRASES
    finally:
        again.close()
        assert not again.client.is_running()


def test_the_new_controls_have_accessible_names(window):
    p = window.patch_editor
    for widget in (p.paraphrases, p.fact_probe_button, p.fact_probe_label, p.fact_table):
        assert widget.accessibleName(), widget
    assert not p.fact_probe_button.isEnabled()              # no model, no fact yet
