"""Where larql-desktop keeps its files: platformdirs' user dirs, with the app name bound.

`LARQL_DESKTOP_HOME` moves all of them under one folder (tests and portable installs use it), and
`LARQL_DESKTOP_DATA_DIR`, `..._CACHE_DIR`, `..._LOG_DIR`, `..._CONFIG_DIR` move one each.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import platformdirs

APP_NAME = "larql-desktop"


@dataclass(frozen=True)
class AppPaths:
    data: Path
    cache: Path
    log: Path
    config: Path

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> "AppPaths":
        home = env.get("LARQL_DESKTOP_HOME")
        defaults = {
            "data": Path(home, "data") if home else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False)),
            "cache": Path(home, "cache") if home else Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False)),
            "log": Path(home, "log") if home else Path(platformdirs.user_log_dir(APP_NAME, appauthor=False)),
            "config": Path(home, "config") if home else Path(platformdirs.user_config_dir(APP_NAME, appauthor=False)),
        }
        chosen = {k: Path(env[f"LARQL_DESKTOP_{k.upper()}_DIR"]) if env.get(f"LARQL_DESKTOP_{k.upper()}_DIR") else v
                  for k, v in defaults.items()}
        return cls(**chosen)

    def ensure(self) -> "AppPaths":
        for p in (self.data, self.cache, self.log, self.config):
            p.mkdir(parents=True, exist_ok=True)
        return self

    @property
    def models_dir(self) -> Path:
        return self.data / "models"

    @property
    def insert_captures(self) -> Path:
        """INSERT's negatives' captures kept between launches (patches/insert/capture_store.py)."""
        return self.cache / "insert" / "captures.sqlite3"

    @property
    def onnx_dir(self) -> Path:
        return self.cache / "onnx"
