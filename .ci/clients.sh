#!/usr/bin/env bash
# Real clients against `gguftool serve` on the bundled demo model: the official `openai` Python
# client, langchain-openai (invoke, stream, bind_tools, with_structured_output) and LiteLLM,
# installed from PyPI into a venv (target/ci-venv; reused when it has the pinned versions).
# Run from the repository root after the Rust tests (the debug binary exists then).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/debug/gguftool}
[[ -x $BIN ]] || cargo build -q -p gguftool
VENV=target/ci-venv
if ! "$VENV/bin/python" -c 'import openai, langchain_openai, litellm' 2>/dev/null; then
  echo "== installing the clients (pip, $VENV)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r .ci/requirements-clients.txt
fi
# LiteLLM would fetch its model price list from the network at import time.
LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" .ci/clients_test.py --bin "$BIN"
