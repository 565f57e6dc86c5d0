"""larql-desktop: run, edit and understand LARQL's FFN activation cache on real language models."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("larql-desktop")
except PackageNotFoundError:   # run from a source tree that was never installed
    __version__ = "0+unknown"
