"""Reading and checking a request to the OpenAI-compatible routes before anything runs.

A body is read up to a size derived from the model's context (`body_limit`), then parsed, checked, templated and
tokenised in a preparation thread of its own (`RequestPreparation`), never on the server's event loop: a large or
hostile body costs its own request the time, not every other client (a 7.5 MB message used to hold /v1/health
for seconds). What is checked here, each refusal a 4xx in the OpenAI error shape naming the field (`param`):

  * the JSON: its nesting depth is measured on the raw bytes before parsing (Python's parser would otherwise
    recurse once per level), and every string must be valid Unicode (a lone surrogate, `"\\ud800"`, is legal JSON
    text but no tokenizer or database can take it);
  * types as strictly as the OpenAI API takes them (the request models are pydantic-strict: `"3"`, `true` and
    `2.0` are not a max_tokens, `"0"` is not a temperature);
  * what this server does not do is refused, consistently: tools, functions, a tool choice other than "none",
    and an assistant message's tool calls (dropping them would change what the model is told).
"""
from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

MAX_JSON_DEPTH = 64            # an OpenAI request is a few levels deep (messages[0].content[1].text)
JSON_ESCAPE_BYTES = 6          # one byte of text written as a \u00XX escape
BODY_ALLOWANCE = 64 * 1024     # the fields around the prompt: model, sampling, stop strings, metadata
# pydantic names a union's member in an error's location (prompt -> "list[int]" -> 0); the param names the field.
_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
                429: "rate_limit_error"}


def error_doc(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ApiError(Exception):
    """A refused request: its status, a message for the client, the field at fault and an OpenAI error code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_doc(self.status, self.message, self.param, self.code), status_code=self.status)


def body_limit(model, max_body: int) -> int:
    """The largest body worth reading for `model`: a prompt filling its whole context, every token the
    vocabulary's longest piece and every byte of it a JSON escape, plus room for the other fields (SmolLM2:
    8192 x 81 x 6 bytes + 64 KB, about 4 MB). A bigger body cannot hold a prompt that fits: 413 before parsing."""
    return min(max_body, model.context_limit * model.tokenizer.max_piece_bytes * JSON_ESCAPE_BYTES + BODY_ALLOWANCE)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit` bytes: by its Content-Length, or while it
    streams in (a chunked body has none)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {int(declared)} bytes; this model's context fits in at most "
                            f"{limit}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body exceeds {limit} bytes, more than this model's context can hold",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def json_depth(raw: bytes) -> int:
    """How deeply the arrays and objects of a JSON text nest, from its bytes alone (brackets inside strings do
    not count), without parsing it: one regex pass and a running sum."""
    codes = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    if not codes.size:
        return 0
    steps = (np.isin(codes, (ord("["), ord("{"))).astype(np.int32)
             - np.isin(codes, (ord("]"), ord("}"))).astype(np.int32))
    return int(np.cumsum(steps).max(initial=0))


def param_name(loc) -> str | None:
    """A pydantic error location as the OpenAI API names a field: ("messages", 0, "content") ->
    "messages[0].content"; a union member's tag ("list[int]") ends the name."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in _UNION_TAGS or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(part)):
            break
        else:
            name += f".{part}" if name else str(part)
    return name or None


def unencodable_text(doc) -> str | None:
    """The first place in a parsed JSON document (a param name; "" for a key of the top object) holding a string,
    or an object key, that is not valid Unicode (a lone surrogate); None if there is none. Walked without
    recursion."""
    stack = [(doc, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, where))
                stack.append((item, f"{where}.{key}" if where else str(key)))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
    return None


def decode_json(raw: bytes) -> dict:
    """The body as a JSON object, or an ApiError saying what is wrong with it."""
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"the body's JSON nests {depth} levels deep; at most {MAX_JSON_DEPTH} are taken")
    try:
        doc = json.loads(raw)
    except RecursionError:        # the depth scan bounds this; kept for bodies it misreads (UTF-16/32 text)
        raise ApiError(400, "the body's JSON is nested too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the body is not valid JSON") from None
    if not isinstance(doc, dict):
        raise ApiError(400, "the body must be a JSON object")
    where = unencodable_text(doc)
    if where is not None:
        raise ApiError(400, f"{where or 'a field name'} holds a lone surrogate (an unpaired \\ud800-\\udfff "
                            "escape), which is not valid Unicode text: send UTF-8 text", where or None)
    return doc


def validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    param = param_name(first.get("loc", ()))
    return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param)


def _asks_for_tools(value) -> bool:
    return value is not None and value != "none" and value != [] and value != {}


def refuse_unsupported_chat_fields(doc: dict) -> None:
    """Tool use in any of its spellings is refused the same way `tools` is (this server has no tool calling): a
    request that asks for it would otherwise get an answer that silently ignored it."""
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if _asks_for_tools(doc.get(name)):
            raise ApiError(400, f"{name} is not supported by this server (it has no tool calling)", name)
    messages = doc.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(message, dict):
            continue
        for name in ("tool_calls", "function_call"):
            if _asks_for_tools(message.get(name)):
                raise ApiError(400, f"messages[{i}].{name}: an assistant message's tool calls are not supported "
                                    "by this server (they would be dropped from what the model reads)",
                               f"messages[{i}].{name}")


class RequestPreparation:
    """Threads of their own where requests are parsed, checked, templated and tokenised: neither the event loop
    nor the thread pool that serves the other routes (/v1/health, /v1/models) waits on a large body.

    `observers` are called from the preparation thread with the name of each stage as it starts ("parse",
    "tokenise"): a test holds a request at a stage to show the server answers others meanwhile."""

    def __init__(self, threads: int = 2):
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="larql-prepare")
        self.observers: list[Callable[[str], None]] = []

    async def run(self, fn):
        return await asyncio.wrap_future(self._threads.submit(fn))

    def stage(self, name: str) -> None:
        for observer in tuple(self.observers):
            observer(name)
