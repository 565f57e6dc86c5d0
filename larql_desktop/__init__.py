"""larql-desktop: run, edit and understand LARQL's FFN activation cache on real language models."""
from __future__ import annotations


def __getattr__(name: str) -> str:
    # The version is read from the installed package's metadata when asked for: importlib.metadata brings in
    # email, zipfile and csv (3 MB of a process that only serves a model and never prints its version).
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("larql-desktop")
        except PackageNotFoundError:   # run from a source tree that was never installed
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
