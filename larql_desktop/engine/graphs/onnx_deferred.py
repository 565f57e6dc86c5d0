"""The `onnx` package for the graph builders, imported when a graph is first built rather than with the engine.

`onnx` only builds graphs: a model whose graphs are exported already runs them in onnxruntime alone. Imported
at start, it cost every process 11 MB of resident memory and ~0.1 s (`python -X importtime`), a share of the
dense decode's peak RSS that bench compares with llama.cpp's. The builders use these names as they would the
package's; the first attribute read imports it. Type checkers see the package itself:

    if TYPE_CHECKING:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    else:
        from larql_desktop.engine.graphs.onnx_deferred import TensorProto, helper, numpy_helper, onnx

Graphs made at every load, before any builder runs (the thread pool's start, the token view's softmax), are
kept here already serialised (tests/test_onnx_deferred.py checks them against what `onnx` builds).
"""
from __future__ import annotations

import importlib
from typing import Any

# onnx.TensorProto.FLOAT: element type numbers are fixed by the ONNX standard. A module-level constant of the
# builders (read at their import) that must not import the package.
FLOAT = 1


class _Deferred:
    """A module, or an attribute of one, imported at the first read of one of its attributes."""

    __slots__ = ("_module", "_attribute")

    def __init__(self, module: str, attribute: str | None = None):
        self._module = module
        self._attribute = attribute

    def __getattr__(self, name: str) -> Any:
        target = importlib.import_module(self._module)
        if self._attribute is not None:
            target = getattr(target, self._attribute)
        return getattr(target, name)

    def __repr__(self) -> str:
        return f"<deferred {self._module}{'.' + self._attribute if self._attribute else ''}>"


onnx: Any = _Deferred("onnx")
helper: Any = _Deferred("onnx.helper")
numpy_helper: Any = _Deferred("onnx.numpy_helper")
TensorProto: Any = _Deferred("onnx", "TensorProto")

# make_model([Identity x -> y], x, y float [1], "start") of graphs/store.py, serialised: the one-node session
# that makes onnxruntime create its environment (and the shared pool's threads) at share_thread_pool.
START_MODEL = bytes.fromhex(
    "080a120d6c6172716c2d6465736b746f703a3b0a100a017812017922084964656e74697479120573746172745a0f0a017812"
    "0a0a08080112040a020801620f0a0179120a0a08080112040a02080142040a00101542110a0d636f6d2e6d6963726f736f66"
    "741001")
# make_model([Softmax(axis=-1) logits -> probabilities], both float ["N"], "softmax"), serialised: the token
# view's softmax over any vocabulary (graphs/softmax.py).
SOFTMAX_MODEL = bytes.fromhex(
    "080a120d6c6172716c2d6465736b746f703a760a360a066c6f67697473120d70726f626162696c69746965732207536f6674"
    "6d61782a140a046178697318ffffffffffffffffff01a001021207736f66746d61785a150a066c6f67697473120b0a090801"
    "12050a0312014e621c0a0d70726f626162696c6974696573120b0a09080112050a0312014e42040a00101542110a0d636f6d"
    "2e6d6963726f736f66741001")
