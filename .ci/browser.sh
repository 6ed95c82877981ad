#!/usr/bin/env bash
# The chat page at / in a real browser: Debian's chromium, driven by playwright-core (npm),
# against `gguftool serve` on the bundled demo model. Loads the page, asks "What is the capital
# of Japan?", waits for "Tokyo" to stream in, checks the per-token log-probability view and the
# model page, and keeps screenshots in target/ci-artifacts/. Run from the repository root after
# the Rust tests (the debug binary exists then). BIN=... picks another binary.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/debug/gguftool}
[[ -x $BIN ]] || cargo build -q -p gguftool
if [[ ! -x /usr/bin/chromium ]]; then
  echo "== installing chromium (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
NODE_DIR=target/ci-node
if [[ ! -d $NODE_DIR/node_modules/playwright-core ]]; then
  echo "== installing playwright-core (npm; it drives /usr/bin/chromium, no browser download)"
  mkdir -p "$NODE_DIR"
  PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm install --silent --no-audit --no-fund --prefix "$NODE_DIR" playwright-core@1.65.1 >/dev/null
fi
mkdir -p target/ci-artifacts
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$BIN" serve --port "$PORT" >target/ci-artifacts/browser-serve.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  curl -fs "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  sleep 0.5
done
NODE_PATH=$NODE_DIR/node_modules node .ci/browser_test.mjs "http://127.0.0.1:$PORT/" target/ci-artifacts
