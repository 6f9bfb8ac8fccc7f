"""Client compatibility suite: drives the libraries people reach a home server with (the official `openai`
and `anthropic` SDKs and their helpers, LiteLLM, LangChain, instructor, pydantic-ai, and the official
`ollama` client against the Ollama API) against a running
`osprey serve` with the embedded default model, and reports each check as passed or failed with the
reason. Run by hand (not part of `cargo test`, which needs no Python):

    python3 -m venv /tmp/cc && /tmp/cc/bin/pip install $(python3 tools/client_compat.py --requirements)
    python3 -m venv /tmp/pai && /tmp/pai/bin/pip install $(python3 tools/client_compat.py --requirements pydantic-ai)
    cargo run --release -- serve --port 8080 &
    /tmp/cc/bin/python tools/client_compat.py --base http://127.0.0.1:8080 --skip pydantic-ai
    /tmp/pai/bin/python tools/client_compat.py --base http://127.0.0.1:8080 --only pydantic-ai

pydantic-ai has its own environment: every pydantic-ai-slim since 2.40 wants openai 3.x for its `openai`
extra, and langchain-openai 1.4.3 wants openai below 3, so one environment cannot hold both.

Exit status 0 when every check passes. The versions below are the ones the recorded run used
(docs/api.md, "Client compatibility").
"""

import argparse
import base64
import json
import os
import sys
import time
import traceback
from typing import List, Literal

REQUIREMENTS = [
    "openai==2.54.0",
    "anthropic==2.17.0",
    "litellm==1.110.2",
    "langchain-openai==1.4.3",
    "langchain-anthropic==1.7.10",
    "instructor==1.17.0",
    "ollama==0.6.3",
    "jsonschema==4.26.0",
]
PYDANTIC_AI_REQUIREMENTS = [
    "pydantic-ai-slim[openai]==2.68.0",
    "anthropic==2.17.0",
    "jsonschema==4.26.0",
]

MEDIA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "media", "default")
RESULTS = []
CHECKS = []
# The anthropic SDK's 2.x `messages.create` no longer takes `temperature`; the API (and osprey) still do.
GREEDY = {"temperature": 0}


def png(name):
    with open(os.path.join(MEDIA, name), "rb") as f:
        return base64.b64encode(f.read()).decode()


def check(name):
    def wrap(fn):
        def run(*a):
            t0 = time.time()
            try:
                fn(*a)
                RESULTS.append((name, True, f"{time.time() - t0:.2f}s"))
            except Exception as e:  # a failed check is a finding, the suite goes on
                detail = "".join(traceback.format_exception_only(type(e), e)).strip()
                RESULTS.append((name, False, detail[:400]))
        CHECKS.append((name, run))
        return run
    return wrap


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="http://127.0.0.1:8080")
    ap.add_argument("--requirements", nargs="?", const="main", choices=["main", "pydantic-ai"],
                    help="print the pinned requirements of an environment and exit")
    ap.add_argument("--only", help="run only the checks whose name starts with this")
    ap.add_argument("--skip", help="leave out the checks whose name starts with this")
    a = ap.parse_args()
    if a.requirements:
        print(" ".join(PYDANTIC_AI_REQUIREMENTS if a.requirements == "pydantic-ai" else REQUIREMENTS))
        return 0

    import anthropic
    import openai
    from pydantic import BaseModel

    base = a.base.rstrip("/")
    oai = openai.OpenAI(base_url=base + "/v1", api_key="none")
    ant = anthropic.Anthropic(base_url=base, api_key="none")
    model = oai.models.list().data[0].id
    red = png("red_circle_img0.png")
    red_url = "data:image/png;base64," + red
    frames = ["data:image/png;base64," + png(f"moving_left_vid0_{i}.png") for i in range(4)]

    class Shape(BaseModel):
        color: Literal["red", "green", "blue"]
        shape: str

    weather_tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

    # ---- openai ----
    @check("openai: models.list and models.retrieve")
    def _():
        m = oai.models.retrieve(model)
        expect(m.id == model, m)
        try:
            oai.models.retrieve("no-such-model")
            raise AssertionError("an unknown model was found")
        except openai.NotFoundError:
            pass

    @check("openai: chat with an image")
    def _():
        r = oai.chat.completions.create(model=model, temperature=0, max_tokens=16, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": red_url}}, {"type": "text", "text": "What is in the image?"}]}])
        expect(r.choices[0].message.content == "a red circle", r.choices[0].message.content)

    @check("openai: streaming with usage")
    def _():
        s = oai.chat.completions.create(model=model, temperature=0, max_tokens=16, stream=True,
                                        stream_options={"include_usage": True},
                                        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": red_url}},
                                                                               {"type": "text", "text": "What is in the image?"}]}])
        text, usage = "", None
        for c in s:
            if c.choices and c.choices[0].delta.content:
                text += c.choices[0].delta.content
            usage = c.usage or usage
        expect(text == "a red circle" and usage and usage.completion_tokens > 0, (text, usage))

    @check("openai: video frames")
    def _():
        r = oai.chat.completions.create(model=model, temperature=0, max_tokens=16, messages=[{"role": "user", "content": [
            {"type": "video", "video": frames, "fps": 2}, {"type": "text", "text": "Which way does it move?"}]}])
        expect(r.choices[0].message.content == "left", r.choices[0].message.content)

    @check("openai: forced tool call and a tool-result turn")
    def _():
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = oai.chat.completions.create(model=model, temperature=0, max_tokens=64, messages=msgs, tools=[weather_tool],
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
        call = r.choices[0].message.tool_calls[0]
        expect(call.function.name == "get_weather" and "city" in json.loads(call.function.arguments), call)
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        r2 = oai.chat.completions.create(model=model, temperature=0, max_tokens=16, messages=msgs, tools=[weather_tool])
        expect(r2.choices[0].finish_reason in ("stop", "length", "tool_calls"), r2)

    @check("openai: chat.completions.parse (pydantic)")
    def _():
        r = oai.chat.completions.parse(model=model, temperature=0, max_tokens=48, response_format=Shape,
                                       messages=[{"role": "user", "content": "Describe a red circle."}])
        expect(r.choices[0].message.parsed.color in ("red", "green", "blue"), r.choices[0].message)

    @check("openai: parse at a small budget")
    def _():
        class Desc(BaseModel):
            description: str
        for n in (16, 24, 48):
            r = oai.chat.completions.parse(model=model, max_tokens=n, response_format=Desc,
                                           messages=[{"role": "user", "content": "Describe the image."}])
            expect(isinstance(r.choices[0].message.parsed, Desc), (n, r.choices[0].message))

    @check("openai: responses.create, previous_response_id")
    def _():
        r = oai.responses.create(model=model, input="Hello!", max_output_tokens=16)
        r2 = oai.responses.create(model=model, input="And again?", previous_response_id=r.id, max_output_tokens=16)
        expect(r.output_text is not None and r2.status in ("completed", "incomplete"), (r, r2))

    @check("openai: responses.parse (text.format)")
    def _():
        r = oai.responses.parse(model=model, input="Describe a red circle.", text_format=Shape, max_output_tokens=48)
        expect(r.output_parsed is not None and r.output_parsed.color in ("red", "green", "blue"), r)

    @check("openai: errors are typed exceptions")
    def _():
        try:
            oai.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}])
            raise AssertionError("no error")
        except openai.BadRequestError as e:
            expect(e.status_code == 400, e)

    # ---- anthropic ----
    @check("anthropic: models.retrieve")
    def _():
        m = ant.models.retrieve(model)
        expect(m.id == model, m)

    @check("anthropic: messages with an image, streaming")
    def _():
        msg = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": red}},
                                             {"type": "text", "text": "What is in the image?"}]}]
        r = ant.messages.create(model=model, max_tokens=16, messages=msg, extra_body=GREEDY)
        expect(r.content[0].text == "a red circle", r.content)
        with ant.messages.stream(model=model, max_tokens=16, messages=msg, extra_body=GREEDY) as s:
            text = "".join(s.text_stream)
        expect(text == "a red circle", text)

    @check("anthropic: assistant prefill is continued")
    def _():
        r = ant.messages.create(model=model, max_tokens=8, extra_body=GREEDY, messages=[
            {"role": "user", "content": "Describe a red circle."}, {"role": "assistant", "content": "a red"}])
        expect(not r.content[0].text.startswith("a red"), r.content)

    @check("anthropic: tools and tool_result")
    def _():
        tools = [{"name": "get_weather", "description": "Weather of a city",
                  "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
        r = ant.messages.create(model=model, max_tokens=64, extra_body=GREEDY, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Paris?"}])
        use = [b for b in r.content if b.type == "tool_use"][0]
        r2 = ant.messages.create(model=model, max_tokens=16, extra_body=GREEDY, tools=tools, messages=[
            {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": r.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}])
        expect(r2.stop_reason in ("end_turn", "max_tokens", "tool_use"), r2)

    @check("anthropic: thinking")
    def _():
        r = ant.messages.create(model=model, max_tokens=64, thinking={"type": "enabled", "budget_tokens": 32},
                                messages=[{"role": "user", "content": "Hello!"}])
        expect(any(b.type == "text" for b in r.content), r.content)

    @check("anthropic: structured output (output_format / messages.parse)")
    def _():
        schema = Shape.model_json_schema()
        schema["additionalProperties"] = False
        r = ant.messages.create(model=model, max_tokens=48, messages=[{"role": "user", "content": "Describe a red circle."}],
                                extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
        Shape.model_validate_json(r.content[0].text)
        if hasattr(ant.messages, "parse"):
            p = ant.messages.parse(model=model, max_tokens=48, output_format=Shape,
                                   messages=[{"role": "user", "content": "Describe a red circle."}])
            expect(p.parsed_output is not None, p)

    @check("anthropic: count_tokens and typed errors")
    def _():
        n = ant.messages.count_tokens(model=model, messages=[{"role": "user", "content": "Hello!"}])
        expect(n.input_tokens > 0, n)
        try:
            ant.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
            raise AssertionError("no error")
        except anthropic.NotFoundError:
            pass

    # ---- litellm ----
    @check("litellm: completion, stream and tools")
    def _():
        import litellm
        r = litellm.completion(model="openai/" + model, api_base=base + "/v1", api_key="none", temperature=0, max_tokens=16,
                               messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": red_url}},
                                                                      {"type": "text", "text": "What is in the image?"}]}])
        expect(r.choices[0].message.content == "a red circle", r)
        s = litellm.completion(model="openai/" + model, api_base=base + "/v1", api_key="none", max_tokens=8, stream=True,
                               messages=[{"role": "user", "content": "Hello!"}])
        expect(len(list(s)) > 0, "no chunks")
        t = litellm.completion(model="openai/" + model, api_base=base + "/v1", api_key="none", max_tokens=64,
                               messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[weather_tool], tool_choice="required")
        expect(t.choices[0].message.tool_calls, t)

    # ---- langchain ----
    @check("langchain-openai: invoke, stream, with_structured_output, bind_tools")
    def _():
        from langchain_openai import ChatOpenAI
        llm = ChatOpenAI(model=model, base_url=base + "/v1", api_key="none", temperature=0, max_tokens=96)
        expect(llm.invoke("Hello!").content is not None, "invoke")
        expect(len(list(llm.stream("Hello!"))) > 0, "stream")
        for method in ("json_schema", "function_calling"):
            out = llm.with_structured_output(Shape, method=method).invoke("Describe a red circle.")
            expect(isinstance(out, Shape), (method, out))
        ai = llm.bind_tools([weather_tool], tool_choice="get_weather").invoke("Weather in Paris?")
        expect(ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather", ai)

    @check("langchain-anthropic: out of the box, structured output")
    def _():
        from langchain_anthropic import ChatAnthropic
        llm = ChatAnthropic(model=model, base_url=base, api_key="none")
        expect(llm.invoke("Hello!").content is not None, "invoke with the default max_tokens")
        out = llm.with_structured_output(Shape, method="json_schema").invoke("Describe a red circle.")
        expect(isinstance(out, Shape), out)

    # ---- instructor ----
    @check("instructor: JSON_SCHEMA and TOOLS modes")
    def _():
        import instructor
        for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
            client = instructor.from_openai(openai.OpenAI(base_url=base + "/v1", api_key="none"), mode=mode)
            out = client.chat.completions.create(model=model, response_model=Shape, max_tokens=64, max_retries=0,
                                                 messages=[{"role": "user", "content": "Describe a red circle."}])
            expect(isinstance(out, Shape), (mode, out))

    # ---- ollama (the Ollama API: /api/chat, /api/generate, /api/tags, /api/show, /api/ps) ----
    def ollama_client():
        import ollama
        return ollama, ollama.Client(host=base)

    @check("ollama: list, show, ps and an unknown model")
    def _():
        ollama, c = ollama_client()
        names = [m.model for m in c.list().models]
        expect(names == [model + ":latest"], names)
        info = c.show(model)
        expect("completion" in info.capabilities and info.details.family, info)
        expect([m.model for m in c.ps().models] == names, c.ps())
        try:
            c.chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}])
            raise AssertionError("an unknown model answered")
        except ollama.ResponseError as e:
            expect(e.status_code == 404 and "not found" in e.error, (e.status_code, e.error))

    @check("ollama: chat with an image, whole and streamed")
    def _():
        _, c = ollama_client()
        msgs = [{"role": "user", "content": "What is in the image?",
                 "images": [os.path.join(MEDIA, "red_circle_img0.png")]}]
        r = c.chat(model=model, messages=msgs, options={"temperature": 0, "num_predict": 16})
        expect(r.message.content == "a red circle" and r.done and r.done_reason == "stop", r)
        expect(r.eval_count > 0 and r.prompt_eval_count > 0 and r.total_duration > 0, r)
        text, last = "", None
        for chunk in c.chat(model=model, messages=msgs, stream=True, options={"temperature": 0, "num_predict": 16}):
            text += chunk.message.content
            last = chunk
        expect(text == "a red circle" and last.done and last.eval_count == r.eval_count, (text, last))

    @check("ollama: generate, with a system prompt and a length limit")
    def _():
        _, c = ollama_client()
        r = c.generate(model=model, prompt="Describe a red circle.", options={"temperature": 0, "num_predict": 8})
        expect(r.done_reason == "length" and r.eval_count == 8 and r.response, r)
        r = c.generate(model=model, prompt="Describe a red circle.", system="Be brief.", options={"temperature": 0})
        expect(r.done_reason == "stop" and r.response, r)

    @check("ollama: structured output (format: a JSON Schema, and json)")
    def _():
        _, c = ollama_client()
        r = c.chat(model=model, messages=[{"role": "user", "content": "Describe a red circle."}],
                   format=Shape.model_json_schema(), options={"temperature": 0, "num_predict": 64})
        Shape.model_validate_json(r.message.content)
        r = c.chat(model=model, messages=[{"role": "user", "content": "Describe a red circle."}], format="json",
                   options={"temperature": 0, "num_predict": 64})
        expect(isinstance(json.loads(r.message.content), dict), r.message.content)

    @check("ollama: tools reach the template, a call and its result round-trip")
    def _():
        ollama, c = ollama_client()
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        bare = c.chat(model=model, messages=msgs, options={"temperature": 0, "num_predict": 4})
        r = c.chat(model=model, messages=msgs, tools=[weather_tool], options={"temperature": 0, "num_predict": 4})
        expect(r.prompt_eval_count > bare.prompt_eval_count + 20, (bare.prompt_eval_count, r.prompt_eval_count))
        # The Ollama API cannot force a call (no tool_choice) and the embedded model was not taught tools,
        # so the call is the client's own Message type, as an agent loop sends it back with its result;
        # forced calls in Ollama's shape are tested over HTTP in tests/osprey/apis.rs (osprey's tool_choice).
        call = ollama.Message(role="assistant", content="", tool_calls=[ollama.Message.ToolCall(
            function=ollama.Message.ToolCall.Function(name="get_weather", arguments={"city": "Paris"}))])
        msgs += [call, {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
        r2 = c.chat(model=model, messages=msgs, tools=[weather_tool], options={"temperature": 0, "num_predict": 32})
        expect(r2.done and r2.prompt_eval_count > r.prompt_eval_count, r2)

    # ---- pydantic-ai ----
    @check("pydantic-ai: an output type")
    def _():
        from pydantic_ai import Agent
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider
        m = OpenAIChatModel(model, provider=OpenAIProvider(base_url=base + "/v1", api_key="none"))
        agent = Agent(m, output_type=Shape, model_settings={"max_tokens": 96})
        out = agent.run_sync("Describe a red circle.").output
        expect(isinstance(out, Shape), out)

    for name, run in CHECKS:
        if (a.only is None or name.startswith(a.only)) and (a.skip is None or not name.startswith(a.skip)):
            run()

    width = max(len(n) for n, _, _ in RESULTS)
    for name, ok, detail in RESULTS:
        print(f"{'PASS' if ok else 'FAIL'}  {name:<{width}}  {detail}")
    failed = sum(1 for _, ok, _ in RESULTS if not ok)
    print(f"\n{len(RESULTS) - failed} of {len(RESULTS)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
