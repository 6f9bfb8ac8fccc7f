"""Drives a running osprey server with the official OpenAI (Responses) and Anthropic (Messages) Python
clients: text, an image, streaming, a forced tool call and its result, JSON Schema output,
previous_response_id, count_tokens. Not part of `cargo test`; run it against any osprey server:

    osprey serve &                       # the embedded default model on 127.0.0.1:8080
    pip install openai anthropic         # (tools/requirements.txt pins the rest)
    python tools/api_clients.py --url http://127.0.0.1:8080 [--api-key K]

Prints one line per check and exits non-zero on the first failure.
"""
import argparse
import base64
import json
import pathlib
import sys

import anthropic
import openai

ROOT = pathlib.Path(__file__).resolve().parent.parent
IMAGE = base64.b64encode((ROOT / "fixtures/media/default/blue_triangle_img0.png").read_bytes()).decode()
# Newer anthropic clients no longer take `temperature` as an argument; the server still reads it.
GREEDY = {"temperature": 0}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
           "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}


def check(name, cond, detail=""):
    print(f"{'ok ' if cond else 'FAIL'} {name} {detail}")
    if not cond:
        sys.exit(1)


def responses(url, key):
    c = openai.OpenAI(base_url=url + "/v1", api_key=key or "none")
    r = c.responses.create(model="osprey-default", input="Describe a red square.", max_output_tokens=24, temperature=0)
    check("responses: text", r.status in ("completed", "incomplete") and isinstance(r.output_text, str), repr(r.output_text))
    r = c.responses.create(model="osprey-default", max_output_tokens=24, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": f"data:image/png;base64,{IMAGE}"}, {"type": "input_text", "text": "What is this?"}]}])
    check("responses: image", r.usage.input_tokens > 30, f"{r.usage.input_tokens} input tokens: {r.output_text!r}")
    kinds = [e.type for e in c.responses.create(model="osprey-default", input="Describe a red square.",
                                                   max_output_tokens=16, temperature=0, stream=True)]
    check("responses: stream", kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"),
          f"{len(kinds)} events")
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r = c.responses.create(model="osprey-default", input="Weather in Paris?", tools=tools, tool_choice="required",
                           max_output_tokens=200, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    check("responses: forced function call", bool(calls) and "city" in json.loads(calls[0].arguments), calls[0].arguments if calls else "")
    r2 = c.responses.create(model="osprey-default", previous_response_id=r.id, tools=tools, max_output_tokens=16, temperature=0,
                            input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"}])
    check("responses: previous_response_id", r2.usage.input_tokens > r.usage.input_tokens,
          f"cached {r2.usage.input_tokens_details.cached_tokens} of {r2.usage.input_tokens}")
    schema = {"type": "object", "properties": {"shape": {"enum": ["square", "circle"]}, "sides": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["shape", "sides"], "additionalProperties": False}
    r = c.responses.create(model="osprey-default", input="Describe a red square as JSON.", max_output_tokens=64, temperature=0,
                           text={"format": {"type": "json_schema", "name": "shape", "schema": schema, "strict": True}})
    out = json.loads(r.output_text)
    check("responses: json_schema", out["shape"] in ("square", "circle") and 0 <= out["sides"] <= 8, r.output_text)


def messages(url, key):
    c = anthropic.Anthropic(base_url=url, api_key=key or "none")
    m = c.messages.create(model="osprey-default", max_tokens=24, extra_body=GREEDY, system="Be brief.",
                          messages=[{"role": "user", "content": "Describe a red square."}])
    check("messages: text", m.stop_reason in ("end_turn", "max_tokens") and m.content[0].type == "text", repr(m.content[0].text))
    n = c.messages.count_tokens(model="osprey-default", system="Be brief.", messages=[{"role": "user", "content": "Describe a red square."}])
    check("messages: count_tokens", n.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0), str(n.input_tokens))
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMAGE}}
    m = c.messages.create(model="osprey-default", max_tokens=24, extra_body=GREEDY,
                          messages=[{"role": "user", "content": [img, {"type": "text", "text": "What is this?"}]}])
    check("messages: image", m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 30, repr(m.content))
    with c.messages.stream(model="osprey-default", max_tokens=16, extra_body=GREEDY,
                           messages=[{"role": "user", "content": "Describe a red square."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    check("messages: stream", text == "".join(b.text for b in final.content if b.type == "text"), repr(text))
    tools = [{"name": "get_weather", "description": "Weather for a city.", "input_schema": WEATHER}]
    m = c.messages.create(model="osprey-default", max_tokens=200, extra_body=GREEDY, tools=tools, tool_choice={"type": "any"},
                          messages=[{"role": "user", "content": "Weather in Paris?"}])
    use = [b for b in m.content if b.type == "tool_use"]
    check("messages: forced tool_use", m.stop_reason == "tool_use" and bool(use) and "city" in use[0].input, repr(m.content))
    m2 = c.messages.create(model="osprey-default", max_tokens=16, extra_body=GREEDY, tools=tools, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": [{"type": "text", "text": "radar:"}, img]}]}])
    check("messages: tool_result with an image", m2.usage.input_tokens + (m2.usage.cache_read_input_tokens or 0) > m.usage.input_tokens,
          m2.stop_reason)
    try:
        c.messages.create(model="osprey-default", max_tokens=4, messages=[{"role": "system", "content": "x"}])
        check("messages: error envelope", False)
    except anthropic.BadRequestError as e:
        check("messages: error envelope", e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", str(e.body))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key")
    a = ap.parse_args()
    responses(a.url, a.api_key)
    messages(a.url, a.api_key)
    print("all checks passed")


if __name__ == "__main__":
    main()
