"""The inference engine on the real models: agreement with llama.cpp, generation, and bad input."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from larql_desktop.engine.graphs.ffn import OnnxFfn
from larql_desktop.engine.graphs.softmax import OnnxSoftmax
from larql_desktop.engine.model.generation import SamplingSettings, top_alternatives
from larql_desktop.engine.model.transformer import KvCache, NumpyDenseFfn
from larql_desktop.tools.verify_reference import check_model
from larql_desktop.engine.loading import load_model
from larql_desktop.engine.session import ChatSession

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}


@pytest.fixture(params=list(MODELS))
def model_and_reference(request, reference):
    model = request.getfixturevalue(request.param)
    return model, MODELS[request.param], reference["models"][MODELS[request.param]]


def test_agrees_with_llamacpp(model_and_reference):
    model, name, entry = model_and_reference
    result = check_model(model, name, entry, log=lambda line: None)
    assert result.tokenizer_identical == result.tokenizer_total > 0
    assert result.clear_total > 100
    assert result.clear_agree / result.clear_total >= 0.99, result


def test_onnx_ffn_matches_numpy_dense(model_and_reference):
    model, _, _ = model_and_reference
    reference_ffn = NumpyDenseFfn(model.transformer)
    x = np.random.default_rng(1).standard_normal((4, model.config.hidden)).astype(np.float32)
    for layer in (0, model.config.n_layers - 1):
        ours, exact = model.ffn(layer, x), reference_ffn(layer, x)
        cos = np.sum(ours * exact, axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(exact, axis=1))
        # int8 activations inside MatMulNBits (as llama.cpp) cost a little precision, never direction.
        assert cos.min() > 0.999


def test_kv_cache_decode_equals_full_prefill(smollm2):
    """Decoding token by token (the whole-model decoder graph, the KV cache growing) predicts what one batched
    pass through the per-layer graphs predicts."""
    ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog because the dog was asleep in the sun")
    full = smollm2.transformer.forward(ids, KvCache(smollm2.config), smollm2.ffn, all_logits=True)
    kv = KvCache(smollm2.config, capacity=4)   # forces the cache to grow while decoding
    smollm2.transformer.forward(ids[:3], kv, smollm2.ffn)
    steps = np.stack([smollm2.transformer.forward([t], kv, smollm2.ffn)[0] for t in ids[3:]])
    # Not bitwise: MatMulNBits quantises activations to int8 (as llama.cpp), so rounding differences
    # between batched and single-row attention can flip a quantisation step. Same predictions, same shape.
    top2 = np.sort(full[3:], axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= 0.5
    assert clear.sum() >= 5
    assert (steps.argmax(axis=1) == full[3:].argmax(axis=1))[clear].all()
    cos = np.sum(steps * full[3:], axis=1) / (np.linalg.norm(steps, axis=1) * np.linalg.norm(full[3:], axis=1))
    assert cos.min() > 0.99


def test_kv_cache_is_one_block_that_grows_keeping_its_contents_and_lists(smollm2):
    """Every layer's keys and values are views of one zeroed allocation (mapped fresh, so capacity not yet
    written costs no memory); growing copies what was written and keeps the lists their holders see."""
    kv = KvCache(smollm2.config, capacity=4)
    assert all(array.base is kv.keys[0].base is not None for array in kv.keys + kv.values)
    smollm2.transformer.forward(smollm2.tokenizer.encode("The quick brown fox"), kv, smollm2.ffn)
    keys, written = kv.keys, [k[:, :kv.length].copy() for k in kv.keys]
    kv.reserve(64)
    assert kv.keys is keys and kv.keys[0].shape[1] == 64
    assert all(array.base is kv.keys[0].base is not None for array in kv.keys + kv.values)
    assert all(np.array_equal(k[:, :kv.length], w) and not k[:, kv.length:].any() for k, w in zip(kv.keys, written))


def _greedy_with_margins(model, ids, n):
    """An independent greedy run (the per-layer forward pass, one token at a time): its tokens and, per step,
    the lead of the best logit over the second."""
    kv = KvCache(model.config)
    logits = model.transformer.forward(ids, kv, model.ffn)[-1]
    tokens, margins = [], []
    for _ in range(n):
        top2 = np.sort(logits)[-2:]
        margins.append(float(top2[1] - top2[0]))
        tokens.append(int(np.argmax(logits)))
        logits = model.transformer.forward([tokens[-1]], kv, model.ffn)[-1]
    return tokens, margins


def _reply_agrees_with_an_independent_run(model, prompt, n):
    """The chat session's greedy reply has the independent run's tokens up to its first near-tie (a lead under
    0.5, where the two paths' kernels may choose differently), and its text is those tokens' text. No wording
    is asserted: replies differ between AVX2 and AVX-512 hosts at near-ties."""
    session = ChatSession(model)
    ids = model.encode_prompt(session.conversation([{"role": "user", "content": prompt}]))
    stream = session.reply(prompt, SamplingSettings(max_tokens=n))
    steps = list(stream)
    text = "".join(s.text for s in steps)
    assert stream.ended and stream.text == text   # the reply hands back its final text
    expected, margins = _greedy_with_margins(model, ids, len(steps))
    clear = next((i for i, m in enumerate(margins) if m < 0.5), len(margins))
    assert clear >= 4, margins
    assert [s.token_id for s in steps][:clear] == expected[:clear]
    assert text and session.messages[-1] == {"role": "assistant", "content": text}
    assert text == model.tokenizer.decode([s.token_id for s in steps if not s.is_stop])
    # Stopped after two tokens: the result is what the session kept, no more.
    stopped = session.reply(prompt, SamplingSettings(max_tokens=n))
    first_two = [next(stopped), next(stopped)]
    assert not stopped.ended
    stopped.close()
    assert stopped.ended and stopped.text.startswith("".join(s.text for s in first_two))
    assert session.messages[-1] == {"role": "assistant", "content": stopped.text}


def test_chat_answers_a_clear_question(smollm2):
    # A question whose greedy answer is no coin flip: "What is the capital of France?" is a near-tie for this model
    # (llama.cpp itself answers "L'Étoile…"), and so is the spider's question at its 7th token.
    _reply_agrees_with_an_independent_run(smollm2, "Name three primary colors.", 24)


def test_gemma_completes_text(gemma3):
    _reply_agrees_with_an_independent_run(gemma3, "Water boils at a temperature of", 8)


def test_greedy_is_deterministic_and_regenerate_reuses_context(smollm2):
    session = ChatSession(smollm2)
    first = [s.token_id for s in session.reply("Name three primary colors.", SamplingSettings(max_tokens=12))]
    prompt_len = len(session.history) - len(first) + 1
    again = list(session.regenerate(SamplingSettings(max_tokens=12)))
    assert [s.token_id for s in again] == first
    assert again[0].prompt_tokens == 0, "regenerate re-ran prompt tokens instead of reusing the prompt's state"
    assert prompt_len > 10


def test_sampling_is_seeded(smollm2):
    def sample(seed):
        s = ChatSession(smollm2)
        settings = SamplingSettings(max_tokens=16, temperature=1.0, top_p=0.9, seed=seed)
        return [step.token_id for step in s.reply("Tell me a story.", settings)]

    a, b, c = sample(7), sample(7), sample(8)
    assert a == b
    assert a != c


def test_stop_token_ends_reply(smollm2):
    steps = list(ChatSession(smollm2).reply("Say hi.", SamplingSettings(max_tokens=200)))
    assert steps[-1].is_stop and steps[-1].token_id in smollm2.tokenizer.stop_ids
    assert len(steps) < 200


@pytest.mark.parametrize("kwargs, says", [
    (dict(max_tokens=0), "max tokens must be between 1"), (dict(temperature=-1.0), "temperature must be between"),
    (dict(top_p=0.0), r"top-p must be in \(0, 1\], not 0.0"), (dict(top_p=1.5), r"top-p must be in \(0, 1\], not 1.5"),
    (dict(temperature=float("nan")), "temperature must be between 0 and 100, not nan")])
def test_absurd_sampling_settings_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        SamplingSettings(**kwargs)


def test_empty_prompt_refused_and_nothing_changes(smollm2):
    session = ChatSession(smollm2)
    with pytest.raises(ValueError, match="empty"):
        session.reply("   ", SamplingSettings())
    assert session.messages == [] and session.kv.length == 0


def test_prompt_longer_than_context_refused(smollm2):
    session = ChatSession(smollm2)
    with pytest.raises(ValueError, match="context holds"):
        session.reply("word " * (smollm2.context_limit + 10), SamplingSettings())
    assert session.messages == [] and session.kv.length == 0


def test_corrupt_onnx_file_is_rebuilt(smollm2, smollm2_graphs_copy):
    directory = smollm2_graphs_copy / smollm2.checksum
    victim = directory / "layer03.walk.onnx"
    good = victim.read_bytes()
    victim.write_bytes(good[: len(good) // 2] + b"garbage")
    (directory / "layer04.gate.onnx").unlink()
    ffn = OnnxFfn(smollm2.gguf, smollm2.config, smollm2.checksum, smollm2_graphs_copy, threads=1)
    assert sorted(ffn.rebuilt) == ["layer03.walk.onnx", "layer04.gate.onnx"]
    assert victim.read_bytes() == good
    x = np.ones((1, smollm2.config.hidden), np.float32)
    np.testing.assert_array_equal(ffn(3, x), smollm2.ffn(3, x))


def test_second_load_reuses_exported_graphs(app_paths, smollm2):
    again = load_model("smollm2", app_paths, threads=1)
    assert again.ffn.rebuilt == []
    assert again.checksum == smollm2.checksum


def test_unknown_model_name(app_paths):
    with pytest.raises(ValueError, match="unknown model"):
        load_model("no-such-model", app_paths)


def test_engine_never_imports_qt():
    code = ("import sys, larql_desktop.engine.loading, larql_desktop.engine.session, larql_desktop.tools.verify_reference,"
            " larql_desktop.cli; bad = [m for m in sys.modules if m.startswith(('PySide6', 'pyqtgraph'))];"
            " print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("vocab", [3, 5, 7, 2561, 49152, 262144, 262145])
def test_top_alternatives_are_the_largest_logits_in_order_ties_to_the_lower_id(vocab):
    """The top tokens come from group maxima (not a partition of the whole vocabulary): the same ids and order as
    a stable sort of every logit, ties included, and probabilities that are the softmax's, from numpy and from
    the onnxruntime softmax a loaded model decodes with (one bound function, called again and again)."""
    rng = np.random.default_rng(vocab)
    softmax = OnnxSoftmax(vocab).bound()
    for trial in range(12):
        z = (rng.standard_normal(vocab) * 5).astype(np.float32)
        if trial % 3 == 0:
            z = np.round(z)                       # many ties, some at the fifth place
        if trial == 4:
            z[:] = 1.5                            # every logit tied
        alternatives = top_alternatives(z, str)
        from_graph = top_alternatives(z, str, softmax=softmax)
        assert [(a.token_id, a.text) for a in from_graph] == [(a.token_id, a.text) for a in alternatives]
        expected = np.argsort(-z, kind="stable")[:5]
        assert [a.token_id for a in alternatives] == expected.tolist()
        p = np.exp(z.astype(np.float64) - z.max())
        p /= p.sum()
        assert np.allclose([a.probability for a in alternatives], p[expected], rtol=1e-5)
        assert np.allclose([a.probability for a in from_graph], p[expected], rtol=1e-4)


def test_the_softmax_graph_refuses_logits_of_another_size():
    softmax = OnnxSoftmax(7).bound()
    with pytest.raises(ValueError, match="8 logits given to a softmax over 7"):
        softmax(np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="at least one logit"):
        OnnxSoftmax(0)
