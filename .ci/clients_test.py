#!/usr/bin/env python3
"""Check `gguftool serve` with the official `openai` Python client (from PyPI).

The script starts the server itself on a free 127.0.0.1 port (bundled demo model unless
--model is given), runs the checks, stops the server, and prints "N passed, M failed".

    python3 -m venv .venv && .venv/bin/pip install -r tests/dev/requirements-openai.txt
    cargo build -p gguftool
    .venv/bin/python tests/dev/openai_client_test.py [--bin target/debug/gguftool] [--model M.gguf]

Expected texts come from the fixture model's training corpus and llama-server's answers on the
same file (tests/fixtures/refs/llamacpp-tiny-glm5.json): "1 2 3 4 5 6 7 8 9 10" continues
" 11 12 13 ...".
"""
import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request

import openai

KEY = "test-key"
passed, failed = [], []


def check(name, fn):
    try:
        fn()
        passed.append(name)
        print(f"ok   {name}")
    except Exception:
        failed.append(name)
        print(f"FAIL {name}")
        traceback.print_exc()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(root, "target", "debug", "gguftool"))
    ap.add_argument("--model", default=None)
    args = ap.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [args.bin, "serve", "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY]
    if args.model:
        cmd += ["-m", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.3)
        else:
            print("server did not become ready:", proc.stderr.read().decode(errors="replace"))
            print("0 passed, 1 failed")
            return 1
        run_checks(base)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"{len(passed)} passed, {len(failed)} failed")
    return 0 if not failed else 1


def run_checks(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def models():
        m = client.models.list()
        assert len(m.data) == 1 and m.data[0].id

    def completion():
        r = client.completions.create(model="any", prompt="1 2 3 4 5 6 7 8 9 10",
                                      max_tokens=8, temperature=0)
        assert r.choices[0].text.startswith(" 11 12 13"), r.choices[0].text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0

    def completion_logprobs():
        r = client.completions.create(model="any", prompt="The capital of France is",
                                      max_tokens=3, temperature=0, logprobs=3)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3
        assert all(len(t) >= 1 for t in lp.top_logprobs)
        assert all(x <= 0 for x in lp.token_logprobs)

    def completion_stream():
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="any", prompt="1 2 3 4 5 6 7 8 9 10", max_tokens=8, temperature=0, stream=True)
            if c.choices)
        assert text.startswith(" 11 12 13"), text

    def chat():
        r = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0)
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content, r

    def chat_stream_usage():
        chunks = list(client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}))
        text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
        assert text, chunks
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)

    def chat_logprobs():
        r = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        assert content and all(len(t.top_logprobs) == 2 for t in content)
        assert content[0].token == content[0].top_logprobs[0].token

    def extra_sampling_params():
        r = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Count to five."}], max_tokens=8,
            temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 20, "min_p": 0.05})
        assert r.choices[0].finish_reason in ("stop", "length")

    def bad_request_raises():
        try:
            client.completions.create(model="any", prompt="x", max_tokens=-1)
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "max_tokens" in str(e)
            return
        raise AssertionError("no BadRequestError")

    def context_exceeded_raises():
        try:
            client.completions.create(model="any", prompt="1 2 3", max_tokens=10_000_000)
        except openai.BadRequestError:
            return
        raise AssertionError("no BadRequestError")

    def wrong_key_raises():
        bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        try:
            bad.models.list()
        except openai.AuthenticationError:
            return
        raise AssertionError("no AuthenticationError")

    def async_concurrent():
        async def go():
            ac = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
            rs = await asyncio.gather(*[
                ac.completions.create(model="any", prompt=f"{i} {i + 1} {i + 2}", max_tokens=8,
                                      temperature=0)
                for i in range(1, 33)])
            await ac.close()
            return rs
        rs = asyncio.run(go())
        assert len(rs) == 32 and all(r.choices[0].text for r in rs)

    for name, fn in [("models", models), ("completion", completion),
                     ("completion-logprobs", completion_logprobs),
                     ("completion-stream", completion_stream), ("chat", chat),
                     ("chat-stream-usage", chat_stream_usage), ("chat-logprobs", chat_logprobs),
                     ("extra-sampling-params", extra_sampling_params),
                     ("bad-request-raises", bad_request_raises),
                     ("context-exceeded-raises", context_exceeded_raises),
                     ("wrong-key-raises", wrong_key_raises),
                     ("async-concurrent-32", async_concurrent)]:
        check(name, fn)


if __name__ == "__main__":
    sys.exit(main())
