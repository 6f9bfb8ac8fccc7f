"""Give a speed checkpoint's tokenizer a token for every id of the model's vocabulary (never for fixtures).

The bench checkpoints (make_bench_model.py) carry the tiny test tokenizer: 1,018 tokens for a 32,768-row
lm_head, so ~97% of what the random model samples decodes to nothing, and no server streams a visible
token: TTFT cannot be measured (bench serve, issue 54 item 4). This appends non-special added tokens
" w<id>" for ids 1018..vocab_size-1, so every id decodes to text; the special tokens keep their ids
(config.json's eos/media ids stay right), and ordinary text encodes as before (no input holds " w1018").

    python tools/widen_vocab.py MODEL_DIR [MODEL_DIR...]   (then convert the GGUF again for llama.cpp)
"""
import json
import pathlib
import sys

from tokenizers import AddedToken, Tokenizer


def widen(d: pathlib.Path) -> None:
    vocab = json.loads((d / "config.json").read_text())
    vocab = vocab.get("vocab_size") or vocab["text_config"]["vocab_size"]
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    have = tok.get_vocab_size()
    if have >= vocab:
        print(f"{d}: {have} tokens already")
        return
    tok.add_tokens([AddedToken(f" w{i}", special=False, normalized=False) for i in range(have, vocab)])
    assert tok.get_vocab_size() == vocab and tok.decode([vocab - 1]) == f" w{vocab - 1}"
    tok.save(str(d / "tokenizer.json"))
    print(f"{d}: {have} -> {vocab} tokens")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        widen(pathlib.Path(arg))
