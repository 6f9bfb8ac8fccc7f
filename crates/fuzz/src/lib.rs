//! # osprey-fuzz — the fuzz targets' bodies
//!
//! Brief overview: each target takes arbitrary bytes and drives one part that reads what a client sends,
//! the way a request would reach it. Any result is fine, an `Err` included; a panic, a hang or an
//! unbounded allocation is a bug, and so is a broken invariant (asserted here, e.g. incremental text ==
//! full decode). The bodies live in this ordinary crate so that `cargo test` replays the seed corpus
//! (`fuzz/corpus/<target>/`) through them on every run; `fuzz/` wraps each in a libFuzzer binary built
//! with coverage instrumentation on the stable toolchain (`tools/fuzz.sh`).
//!
//! The model is the embedded tiny one's directory (`fixtures/models/qwen3_5_moe-tiny`): its tokenizer,
//! chat template and processor config, loaded once per process.

use std::path::PathBuf;
use std::sync::OnceLock;

use base64::Engine;
use osprey_models::vision::{declared_size, decode_animation, decode_image, DecodeLimits};
use osprey_protocol::tokenizer::{ChatPrompt, DecodeState, MediaInput, MediaLimits};
use osprey_server::{Endpoint, Limits, ServerConfig};
use osprey_tokenizer::{Detokenizer, TokenizerCore};

/// A fuzz target: name (its corpus folder and libFuzzer binary) and body.
pub type Target = (&'static str, fn(&[u8]));

/// Every target.
pub const TARGETS: &[Target] = &[
    ("request", request),
    ("media", media),
    ("chat_template", chat_template),
    ("detokenize", detokenize),
    ("tool_calls", tool_calls),
    ("schema", schema),
];

/// The repository root (the corpus and the model directory are found from it).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Env {
    core: TokenizerCore,
    cfg: ServerConfig,
}

/// Media small enough that one input decodes in milliseconds (the server's own limits are larger; what
/// is fuzzed is the parsing, which does not depend on them).
const MAX_PIXELS: u64 = 1 << 16;

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let dir = repo_root().join("fixtures/models/qwen3_5_moe-tiny");
        let core = TokenizerCore::from_dir(&dir, true).expect("the tiny model's tokenizer loads");
        let tok = core.tokenizer();
        let cfg = ServerConfig {
            template_kwargs: core.template_variables(),
            // No remote or local media: a fuzzed URL never leaves the process.
            limits: Limits { max_image_pixels: MAX_PIXELS, max_media_bytes: 1 << 20, ..Limits::default() },
            ..ServerConfig::basic("tiny", 4096, tok.vocab_size(), tok.max_token_bytes())
        };
        Env { core, cfg }
    })
}

fn media_limits() -> MediaLimits {
    MediaLimits {
        max_pixels: MAX_PIXELS,
        max_frames: 8,
        max_total_pixels: 8 * MAX_PIXELS,
        max_media_tokens: usize::MAX,
    }
}

/// A request body's validation; the first byte picks the endpoint (mod 4): 0 `/v1/chat/completions`,
/// 1 `/v1/completions`, 2 `/v1/responses`, 3 `/v1/messages` (the last two translated into a chat body
/// first).
pub fn request(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else { return };
    let endpoint = [Endpoint::Chat, Endpoint::Completions, Endpoint::Responses, Endpoint::Messages][which as usize % 4];
    let _ = osprey_server::check_body(endpoint, body, &env().cfg);
}

/// A JSON Schema through the server's one schema gate and, when it passes, the grammar compiler with its
/// first mask: whatever the schema, a 400 or a grammar, never a crash (a 700-deep `$ref` chain once
/// overflowed the compiler's stack). The first byte picks the path: bit 1 clear, `response_format` (bit 0:
/// strict when clear); set, the parameters of a forced tool call (bit 0: parallel calls when clear).
pub fn schema(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else { return };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(rest) else { return };
    let grammar = if flags & 2 == 0 {
        osprey_server::schema_grammar(&v, flags % 2 == 0)
    } else {
        osprey_server::tool_call_grammar(&v, flags % 2 == 0)
    };
    if let Ok(g) = grammar {
        let _ = env().core.compile(&g);
    }
}

/// Model output through the tool-call parser: the first byte is the chunk size (1–32 chars) the text is
/// streamed in (low 5 bits) and whether one call only is kept (`parallel_tool_calls: false`, bit 5). Whatever the text, the streamed events equal those of one whole feed (text and calls),
/// the text events give back exactly the text outside complete calls, and each call's arguments are a
/// JSON object.
pub fn tool_calls(data: &[u8]) {
    let Some((&step, rest)) = data.split_first() else { return };
    let text = String::from_utf8_lossy(rest);
    let tools = osprey_server::tools::parse_chat_tools(Some(&serde_json::json!([
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "s": {"type": "string"}, "n": {"type": "integer"}, "o": {"type": "object"}}}}}
    ])))
    .expect("a valid tool");
    let run = |chunk: usize| {
        let mut p = osprey_server::tools::ToolParser::new(&tools, "c".into(), step & 32 == 0);
        let chars: Vec<char> = text.chars().collect();
        let mut events = Vec::new();
        for piece in chars.chunks(chunk.max(1)) {
            events.extend(p.feed(&piece.iter().collect::<String>()));
        }
        events.extend(p.finish().0);
        let said: String = events
            .iter()
            .filter_map(|e| if let osprey_server::tools::ToolEvent::Text(t) = e { Some(t.as_str()) } else { None })
            .collect();
        (said, p.calls().to_vec())
    };
    let whole = run(usize::MAX);
    let streamed = run(step as usize % 32 + 1);
    assert_eq!(whole, streamed, "streamed parsing differs from a whole feed");
    for c in &whole.1 {
        let v: serde_json::Value = serde_json::from_str(&c.arguments).expect("arguments are JSON");
        assert!(v.is_object(), "arguments are an object");
    }
    if whole.1.is_empty() {
        assert_eq!(whole.0, text, "without a complete call, the text comes back whole");
    }
    if step & 32 != 0 {
        assert!(whole.1.len() <= 1, "one call at most when parallel calls are off");
    }
}

/// Media bytes: first byte picks the path: 0 image header + decode, 1 animation (video file) decode,
/// 2 an image through the tokenizer (decode, resize, patches), 3 the bytes as a base64 data URL in a
/// chat body.
pub fn media(data: &[u8]) {
    let Some((&which, bytes)) = data.split_first() else { return };
    let lim = DecodeLimits { max_pixels: MAX_PIXELS, max_frames: 8 };
    match which % 4 {
        0 => {
            if let (Ok((w, h)), Ok(img)) = (declared_size(bytes), decode_image(bytes, lim)) {
                assert!(u64::from(w) * u64::from(h) <= MAX_PIXELS, "decoded past the pixel limit");
                assert_eq!(img.data.len(), img.width * img.height * 3, "RGB buffer size");
            }
        }
        1 => {
            if let Ok(f) = decode_animation(bytes, lim) {
                assert!(f.frames.len() <= 8, "decoded past the frame limit");
            }
        }
        2 => {
            let prompt = ChatPrompt {
                messages: serde_json::json!([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]),
                media: vec![MediaInput::Image { bytes: bytes.to_vec() }],
                template_kwargs: serde_json::Map::new(),
                limits: media_limits(),
                grammar: None,
                parse_special_tokens: false,
                add_generation_prompt: true,
                continue_final_message: false,
                deadline: None,
            };
            let _ = env().core.prepare_chat(prompt);
        }
        _ => {
            let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes));
            let body = serde_json::json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}]});
            let _ = osprey_server::check_body(Endpoint::Chat, body.to_string().as_bytes(), &env().cfg);
        }
    }
}

/// A JSON value as the `messages` of a chat prompt (and, when it is an object with `messages`, its
/// `chat_template_kwargs`, `parse_special_tokens` and `continue_final_message` too): template rendering,
/// continuation, special-token marking, placeholder expansion and tokenization.
pub fn chat_template(data: &[u8]) {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    let flag = |k: &str| v.get(k).and_then(serde_json::Value::as_bool).unwrap_or(false);
    let (parse_special, continue_final) = (flag("parse_special_tokens"), flag("continue_final_message"));
    let (messages, kwargs) = match &v {
        serde_json::Value::Object(o) if o.contains_key("messages") => (
            o["messages"].clone(),
            o.get("chat_template_kwargs").and_then(|k| k.as_object().cloned()).unwrap_or_default(),
        ),
        _ => (v, serde_json::Map::new()),
    };
    let prompt = ChatPrompt {
        messages,
        media: Vec::new(),
        template_kwargs: kwargs,
        limits: media_limits(),
        grammar: None,
        parse_special_tokens: parse_special,
        add_generation_prompt: !continue_final,
        continue_final_message: continue_final,
        deadline: None,
    };
    let _ = env().core.prepare_chat(prompt);
}

/// Token ids (two bytes each, modulo the vocabulary) fed to the incremental detokenizer in steps whose
/// sizes come from the first byte; the streamed text must equal one decode of all ids.
pub fn detokenize(data: &[u8]) {
    let Some((&steps, rest)) = data.split_first() else { return };
    let tok = env().core.tokenizer();
    let vocab = tok.vocab_size() as u32;
    let ids: Vec<u32> = rest.chunks_exact(2).map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])) % vocab).collect();
    let mut decode = |ids: &[u32]| tok.decode(ids, true).unwrap_or_default();
    let mut d = Detokenizer::default();
    let mut st = DecodeState { skip_special: true, ..DecodeState::default() };
    let mut text = String::new();
    let step = usize::from(steps % 4) + 1;
    for chunk in ids.chunks(step) {
        text.push_str(&d.step(&mut st, chunk, &mut decode));
    }
    text.push_str(&d.flush(&mut st, &mut decode));
    assert_eq!(text, decode(&ids), "incremental detokenization of {ids:?} in steps of {step}");
}
