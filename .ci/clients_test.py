#!/usr/bin/env python3
"""Real clients against `gguftool serve` (run by .ci/clients.sh, which installs them from PyPI):
the official `openai` client, langchain-openai (invoke, stream, bind_tools,
with_structured_output) and LiteLLM.

The script starts the server itself on a free 127.0.0.1 port (bundled demo model unless
--model is given), runs the checks, stops the server, and prints "N passed, M failed".

    bash .ci/clients.sh          # or, with the clients installed:
    .venv/bin/python .ci/clients_test.py [--bin target/debug/gguftool] [--model M.gguf]

Expected texts come from the fixture model's training corpus and llama-server's answers on the
same file (tests/fixtures/refs/llamacpp-tiny-glm5.json): "1 2 3 4 5 6 7 8 9 10" continues
" 11 12 13 ...", and the chat "What is the capital of Japan?" answers "The capital of Japan is
Tokyo." Tool-call and structured-output checks hold whatever the tiny model prefers, because the
output is constrained: they check the shape the client parses and the schema.
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

import json

import openai
import pydantic

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


class Trip(pydantic.BaseModel):
    """A trip: where and for how long."""
    city: str = pydantic.Field(max_length=16)
    days: int = pydantic.Field(ge=1, le=30)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 30}},
        "required": ["city", "days"], "additionalProperties": False}}}
JAPAN = [{"role": "user", "content": "What is the capital of Japan?"}]


def valid_weather(args):
    return (set(args) == {"city", "days"} and isinstance(args["city"], str)
            and len(args["city"]) <= 16 and type(args["days"]) is int and 1 <= args["days"] <= 30)


def run_checks(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    model_id = client.models.list().data[0].id

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

    def model_retrieve():
        assert " " not in model_id and client.models.retrieve(model_id).id == model_id

    def chat_japan():
        r = client.chat.completions.create(model=model_id, messages=JAPAN, max_tokens=16, temperature=0)
        assert "Tokyo" in r.choices[0].message.content, r

    def n_and_prompt_lists():
        r = client.completions.create(model="any", prompt=["1 2 3", "4 5 6"], max_tokens=4,
                                      temperature=0.9, n=2, seed=3)
        assert len(r.choices) == 4 and sorted(c.index for c in r.choices) == [0, 1, 2, 3]

    def tool_call_named():
        r = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=200, temperature=0)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert valid_weather(json.loads(call.function.arguments)), call
        # The result goes back as a tool message.
        msgs = [{"role": "user", "content": "Weather in Paris for 3 days?"}, r.choices[0].message,
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        r2 = client.chat.completions.create(model=model_id, messages=msgs, tools=[WEATHER],
                                            max_tokens=8, temperature=0)
        assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")

    def tool_call_stream():
        calls = {}
        with client.chat.completions.stream(
                model=model_id, messages=[{"role": "user", "content": "Weather in Rome?"}],
                tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0) as st:
            for _ in st:
                pass
            final = st.get_final_completion()
        call = final.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and valid_weather(json.loads(call.function.arguments))
        assert final.choices[0].finish_reason == "tool_calls"

    def structured_parse():
        r = client.chat.completions.parse(model=model_id, messages=[
            {"role": "user", "content": "Plan a trip: a city and a number of days."}],
            response_format=Trip, max_tokens=200, temperature=0)
        trip = r.choices[0].message.parsed
        assert isinstance(trip, Trip) and 1 <= trip.days <= 30, r

    def json_object():
        r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Answer in JSON."}],
                                           response_format={"type": "json_object"}, max_tokens=200, temperature=0)
        c = r.choices[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.message.content.startswith("{")

    def grammar_extra_body():
        r = client.completions.create(model="any", prompt="Is Paris in France?", max_tokens=4, temperature=0,
                                      extra_body={"grammar": 'root ::= "yes" | "no"'})
        assert r.choices[0].text in ("yes", "no")

    def unknown_field_refused():
        try:
            client.chat.completions.create(model=model_id, messages=JAPAN, max_tokens=4,
                                           extra_body={"mirostat": 2})
        except openai.BadRequestError as e:
            assert "mirostat" in str(e)
            return
        raise AssertionError("mirostat 2 was accepted")

    for name, fn in [("models", models), ("model-retrieve", model_retrieve), ("completion", completion),
                     ("completion-logprobs", completion_logprobs),
                     ("completion-stream", completion_stream), ("chat", chat),
                     ("chat-stream-usage", chat_stream_usage), ("chat-logprobs", chat_logprobs),
                     ("extra-sampling-params", extra_sampling_params),
                     ("bad-request-raises", bad_request_raises),
                     ("context-exceeded-raises", context_exceeded_raises),
                     ("wrong-key-raises", wrong_key_raises),
                     ("async-concurrent-32", async_concurrent),
                     ("chat-capital-of-japan", chat_japan), ("n-and-prompt-lists", n_and_prompt_lists),
                     ("tool-call-named", tool_call_named), ("tool-call-stream", tool_call_stream),
                     ("structured-parse", structured_parse), ("json-object", json_object),
                     ("gbnf-extra-body", grammar_extra_body), ("unknown-field-refused", unknown_field_refused)]:
        check("openai/" + name, fn)
    langchain_checks(base, model_id)
    litellm_checks(base, model_id)


def langchain_checks(base, model_id):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base + "/v1", api_key=KEY, model=model_id, temperature=0,
                     max_tokens=200, max_retries=0, timeout=60)

    class GetWeather(pydantic.BaseModel):
        """Weather forecast for a city over a number of days."""
        city: str = pydantic.Field(max_length=16)
        days: int = pydantic.Field(ge=1, le=30)

    def invoke():
        m = llm.invoke("What is the capital of Japan?")
        assert "Tokyo" in m.content, m

    def stream():
        text = "".join(c.content for c in llm.stream("What is the capital of Japan?"))
        assert "Tokyo" in text, text

    def bind_tools():
        m = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Paris for 3 days?")
        call = m.tool_calls[0]
        assert call["name"] == "GetWeather", m
        GetWeather(**call["args"])

    def structured_json_schema():
        trip = llm.with_structured_output(Trip).invoke("Plan a trip: a city and a number of days.")
        assert isinstance(trip, Trip), trip

    def structured_function_calling():
        trip = llm.with_structured_output(Trip, method="function_calling").invoke("Plan a trip.")
        assert isinstance(trip, Trip), trip

    for name, fn in [("invoke", invoke), ("stream", stream), ("bind-tools", bind_tools),
                     ("with-structured-output", structured_json_schema),
                     ("with-structured-output-function-calling", structured_function_calling)]:
        check("langchain/" + name, fn)


def litellm_checks(base, model_id):
    import litellm

    kw = dict(model="openai/" + model_id, api_base=base + "/v1", api_key=KEY, temperature=0,
              max_tokens=200, num_retries=0)

    def completion():
        r = litellm.completion(messages=JAPAN, **kw)
        assert "Tokyo" in r.choices[0].message.content, r

    def stream():
        text = "".join((c.choices[0].delta.content or "") for c in litellm.completion(messages=JAPAN, stream=True, **kw))
        assert "Tokyo" in text, text

    def tools():
        r = litellm.completion(messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
                               tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and valid_weather(json.loads(call.function.arguments))

    for name, fn in [("completion", completion), ("stream", stream), ("tools", tools)]:
        check("litellm/" + name, fn)


if __name__ == "__main__":
    sys.exit(main())
