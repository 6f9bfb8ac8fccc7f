"""Chat-template parity cases with tools, rendered by transformers (the ground truth for osprey's minijinja).

Writes fixtures/ref/chat_templates.json: per case the messages, tools and template kwargs as transformers
received them, the rendered text and its token ids. `cargo test` renders the same cases in Rust and compares.
Usage: python tools/gen_template_fixtures.py  (the pinned venv, see tools/requirements.txt)
"""
import json
import pathlib

from transformers import AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "fixtures/models/osprey-default"
OUT = ROOT / "fixtures/ref/chat_templates.json"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
SCREENSHOT = {"type": "function", "function": {
    "name": "take_screenshot", "description": "Screenshot of a window.",
    "parameters": {"type": "object", "properties": {
        "window": {"type": "integer", "minimum": 0}, "region": {"type": "object", "properties": {
            "x": {"type": "number"}, "y": {"type": "number"}}},
        "tags": {"type": "array", "items": {"type": "string"}}, "grayscale": {"type": "boolean"}},
        "required": ["window"]}}}
TOOLS = [WEATHER, SCREENSHOT]

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CALL2 = {"id": "call_2", "type": "function", "function": {"name": "take_screenshot", "arguments": {
    "window": 3, "region": {"x": 1.5, "y": 2}, "tags": ["a", "b"], "grayscale": True}}}

CASES = [
    ("tools_user", [{"role": "user", "content": "Weather in Paris?"}], TOOLS, {}),
    ("tools_system", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
     TOOLS, {}),
    ("tools_no_thinking", [{"role": "user", "content": "Weather in Paris?"}], [WEATHER], {"enable_thinking": False}),
    ("call_and_result", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}], TOOLS, {}),
    ("parallel_calls", [
        {"role": "system", "content": "You operate a desktop."},
        {"role": "user", "content": "Check the weather and take a screenshot."},
        {"role": "assistant", "content": "Doing both.", "tool_calls": [CALL, CALL2]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "done"},
        {"role": "user", "content": "Thanks. Anything else?"}], TOOLS, {}),
    ("image_result", [
        {"role": "user", "content": "Show me window 3."},
        {"role": "assistant", "content": "", "tool_calls": [CALL2]},
        {"role": "tool", "tool_call_id": "call_2", "content": [
            {"type": "text", "text": "Screenshot:"}, {"type": "image"}]}], TOOLS, {}),
    ("reasoning_after_tool", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "assistant", "content": "It is 18 C.", "reasoning_content": "Report it."}], TOOLS, {}),
    ("history_without_tools", [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}], None, {}),
]


def main():
    tok = AutoTokenizer.from_pretrained(MODEL)
    out = []
    for name, messages, tools, kwargs in CASES:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out.append({"name": name, "messages": messages, "tools": tools, "kwargs": kwargs, "text": text, "ids": ids})
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(out)} cases to {OUT}")


if __name__ == "__main__":
    main()
