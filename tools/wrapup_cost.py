"""Grammar-mask cost of the budget wrap-up at short budgets (issue 40): two JSON schemas x 20 budgets
from 20 to 77 tokens against a running `osprey serve` (the default model), seeded, and the mean of
`osprey_grammar_mask_seconds_total / osprey_grammar_masks_total` over them. Usage:
    python3 tools/wrapup_cost.py PORT
Run two servers (before and after a change) and alternate, to compare inside one run."""
import json, sys, urllib.request, re
U="http://localhost:%s"%sys.argv[1]
def post(body):
    req=urllib.request.Request(U+"/v1/chat/completions",json.dumps(body).encode(),{"Content-Type":"application/json"})
    try: return json.load(urllib.request.urlopen(req))
    except urllib.error.HTTPError as e: return None
def metrics():
    t=urllib.request.urlopen(U+"/metrics").read().decode()
    g=lambda n: float(re.search(r"^%s(?:\{[^}]*\})? (\S+)"%n,t,re.M).group(1))
    return g("osprey_grammar_mask_seconds_total"), g("osprey_grammar_masks_total")
schemas=[{"type":"object","properties":{"description":{"type":"string"}},"required":["description"],"additionalProperties":False},
 {"type":"object","properties":{"shapes":{"type":"array","minItems":1,"items":{"type":"object","properties":{"color":{"enum":["red","green","blue"]},"name":{"type":"string"}},"required":["color","name"],"additionalProperties":False}},"count":{"type":"integer","minimum":0}},"required":["shapes","count"],"additionalProperties":False}]
s0,m0=metrics()
for sc in schemas:
  for b in range(20,80,3):
    post({"messages":[{"role":"user","content":"Describe the image."}],"seed":b,"max_tokens":b,"response_format":{"type":"json_schema","json_schema":{"name":"D","strict":True,"schema":sc}}})
s1,m1=metrics()
print("masks",m1-m0,"us/mask %.1f"%((s1-s0)/(m1-m0)*1e6))
