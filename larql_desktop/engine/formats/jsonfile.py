"""Reading the JSON files users hand the app (reference outputs, scenarios, patches) with errors that say what to do."""
from __future__ import annotations

import json
from pathlib import Path


def read_json(path: str | Path, what: str, error: type[Exception] = ValueError):
    """The parsed document; `error` with a message naming the file and the problem otherwise."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}") from exc
    return parse_json(data, str(path), error)


def parse_json(data: bytes | str, where: str, error: type[Exception] = ValueError):
    """json.loads with the errors a user can act on: invalid JSON, or nesting too deep for the parser."""
    try:
        return json.loads(data)
    except ValueError as exc:   # also bad UTF-8
        raise error(f"{where}: not valid JSON ({exc})") from exc
    except RecursionError as exc:   # json recurses once per nested array or object
        raise error(f"{where}: JSON nested too deeply (no file this app reads nests beyond a few levels)") from exc
