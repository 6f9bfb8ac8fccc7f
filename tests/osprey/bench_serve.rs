//! `osprey bench serve` end to end: against the embedded default model over real HTTP (every scenario,
//! a fixed concurrency and seeded Poisson arrivals, the conversation's growing cached prefix, osprey's
//! counters), and against servers that cannot answer: a refused connection and a stub that answers every
//! request with an error give a clear error, never a hang.

use crate::harness;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};

use osprey::Settings;
use osprey_bench::serve::{run, table, Scenario, ServeOptions};

fn opts(url: String, scenario: Scenario, requests: usize) -> ServeOptions {
    ServeOptions {
        url,
        model: None,
        scenario,
        requests,
        concurrency: 2,
        rate: None,
        seed: 5,
        max_tokens: 6,
        api_key: None,
        timeout_secs: 60.0,
        response_format: None,
        context_tokens: None,
        text_only: false,
        cold_reference: false,
    }
}

#[test]
fn every_scenario_runs_against_osprey_and_reports_every_field() {
    let dir = osprey::model_dir(&Settings::default()).expect("default model");
    let addr = harness::start(Settings::default(), dir);
    let url = format!("http://{addr}");
    for (scenario, n) in [(Scenario::Text, 4), (Scenario::PreambleImage, 2), (Scenario::Video, 2)] {
        let r = run(&opts(url.clone(), scenario, n)).expect("run");
        assert!(r.osprey && r.server_model.is_some(), "{scenario:?}: the target is osprey");
        assert_eq!(r.samples.len(), n);
        assert!(r.samples.iter().all(|s| s.error.is_none() && s.ttft_s.is_some() && s.output_tokens.is_some()));
        assert!(r.summary.ttft_s.p50 > 0.0 && r.summary.throughput_tok_s > 0.0, "{scenario:?}");
        assert!(r.metrics_delta["osprey_prompt_tokens_total"] > 0.0);
        let json = serde_json::to_value(&r).expect("json");
        for field in ["options", "server_model", "osprey", "samples", "summary", "metrics_delta"] {
            assert!(json.get(field).is_some(), "{field}");
        }
        assert!(table(&r).contains("TTFT ms"));
    }
    // Turns of one conversation: each resends the history, which the prefix cache serves.
    let r = run(&opts(url.clone(), Scenario::Conversation, 3)).expect("conversation");
    let cached: Vec<u64> = r.samples.iter().map(|s| s.cached_tokens.unwrap_or(0)).collect();
    assert!(cached[2] > 0 && cached[2] >= cached[1], "later turns hit the cache: {cached:?}");
    // Structured output: every answer follows the schema; osprey reports the time its masks took.
    let schema = serde_json::json!({"type": "json_schema", "json_schema": {"name": "s", "strict": true, "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}}});
    let o = ServeOptions { response_format: Some(schema), max_tokens: 16, ..opts(url.clone(), Scenario::Text, 2) };
    let r = run(&o).expect("structured");
    assert!(r.samples.iter().all(|s| s.error.is_none() && s.output_tokens.is_some()));
    assert!(r.metrics_delta["osprey_grammar_masks_total"] >= 2.0, "{:?}", r.metrics_delta);
    assert!(r.metrics_delta["osprey_grammar_mask_seconds_total"] > 0.0);
    // Seeded Poisson arrivals: sent in order, spread out.
    let r = run(&ServeOptions { rate: Some(20.0), ..opts(url, Scenario::Text, 5) }).expect("rate");
    let sent: Vec<f64> = r.samples.iter().map(|s| s.sent_at_s).collect();
    assert!(sent.windows(2).all(|w| w[0] <= w[1] + 0.05) && sent[4] > 0.0, "{sent:?}");
}

/// Issue 53: the long-images conversation on the embedded model to a context of 1,200 tokens. It ends
/// at the first turn past the context; every turn resends the history and reports the server's view
/// after it: KV pages and bytes, snapshots, the process's memory, and the vision encoder running only on
/// the turn's new media (the resent images are served from the prefix cache or the encoder's cache).
/// The text-only form of the same conversation sends no media and grows alike. The server runs with its
/// defaults: they take a conversation's images (8 a request refused its 5th–7th turn).
#[test]
fn a_long_image_conversation_reports_every_turn() {
    let dir = osprey::model_dir(&Settings::default()).expect("default model");
    let addr = harness::start(Settings::default(), dir);
    let o = ServeOptions {
        context_tokens: Some(1200),
        requests: 20,
        max_tokens: 4,
        ..opts(format!("http://{addr}"), Scenario::LongImages, 20)
    };
    let r = run(&o).expect("long images");
    let last = r.samples.last().expect("turns");
    assert!(
        last.prompt_tokens.unwrap_or(0) >= 1200 && r.samples.len() < 20,
        "ends at its context: {}",
        r.samples.len()
    );
    assert!(r.samples[..r.samples.len() - 1].iter().all(|s| s.prompt_tokens.unwrap_or(0) < 1200));
    for (i, s) in r.samples.iter().enumerate() {
        let t = s.turn.as_ref().expect("turn stats");
        assert!(s.error.is_none() && t.request_bytes > 0 && t.media_items > 0, "turn {i}: {s:?}");
        assert!(t.kv_pages_used.is_some_and(|p| p > 0.0) && t.kv_bytes.is_some_and(|b| b > 0.0), "turn {i}: {t:?}");
        assert!(t.snapshots.is_some_and(|n| n > 0.0) && t.rss_bytes.is_some_and(|b| b > 1e6), "turn {i}: {t:?}");
        assert_eq!(t.vision_misses, Some(t.media_items as f64), "turn {i}: the tower ran on its new media alone");
        assert_eq!(t.new_tokens, Some(s.prompt_tokens.unwrap_or(0) - s.cached_tokens.unwrap_or(0)));
    }
    assert!(table(&r).contains("| turn | media | prompt | cached | new |"));
    let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-long-images");
    std::fs::create_dir_all(&out).expect("mkdir");
    let file = out.join("long.json");
    std::fs::write(&file, serde_json::json!({"report": r}).to_string()).expect("write");
    let charts = osprey_bench::chart::charts(&[file], &out).expect("charts");
    assert!(charts.iter().any(|p| p.ends_with("long-context.svg")), "{charts:?}");
    let text = run(&ServeOptions { text_only: true, ..o.clone() }).expect("text only");
    let grew = |r: &osprey_bench::serve::ServeReport| r.samples.iter().map(|s| s.prompt_tokens.unwrap_or(0)).max();
    assert!(grew(&text) >= Some(1200), "the text-only form grows to the context too");
    assert!(text.samples.iter().all(|s| s.turn.as_ref().is_some_and(|t| t.vision_misses == Some(0.0))));
    // With a cold reference after every turn: the reference's media are new (nothing of it cached but
    // at most its first page), and the conversation's own turns still reuse their history and encode
    // only their new media (the reference's encodes are left out of the turn's deltas).
    let paired = run(&ServeOptions { cold_reference: true, ..o }).expect("paired");
    for (i, s) in paired.samples.iter().enumerate() {
        let t = s.turn.as_ref().expect("turn stats");
        assert!(t.cold_ttft_s.is_some_and(|c| c > 0.0), "turn {i}: {t:?}");
        assert!(t.cold_cached_tokens.is_some_and(|c| c < 16), "turn {i}: the reference is cold: {t:?}");
        assert!(t.vision_misses.is_some_and(|m| m <= t.media_items as f64), "turn {i}: {t:?}");
        if i > 0 {
            let (p, c) = (s.prompt_tokens.unwrap_or(0), s.cached_tokens.unwrap_or(0));
            assert!(c * 10 >= p * 8, "turn {i}: the history is still reused ({c} of {p})");
        }
    }
    assert!(table(&paired).contains("| cold TTFT ms |"));
}

#[test]
fn a_refused_connection_or_a_server_that_only_errs_is_a_clear_error() {
    let e = run(&opts("http://127.0.0.1:1".into(), Scenario::Text, 2)).expect_err("nothing listens").to_string();
    assert!(e.contains("127.0.0.1:1"), "{e}");
    assert!(run(&opts("ftp://x".into(), Scenario::Text, 1)).expect_err("scheme").to_string().contains("http://"));
    // A stub: every request gets a 500 with an OpenAI error body.
    let addr = stub(|_, s| {
        let body = r#"{"error":{"message":"broken","type":"server_error","code":"engine_error"}}"#;
        let _ = write!(
            s,
            "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    });
    let t = std::time::Instant::now();
    let e = run(&opts(format!("http://{addr}"), Scenario::Text, 2)).expect_err("all fail").to_string();
    assert!(e.contains("every request failed") && e.contains("engine_error"), "{e}");
    assert!(t.elapsed().as_secs() < 30, "no hang");
}

/// `bench chart` turns a serve report and experts lines into SVG files.
#[test]
fn charts_are_drawn_from_serve_and_experts_results() {
    let dir = osprey::model_dir(&Settings::default()).expect("default model");
    let addr = harness::start(Settings::default(), dir);
    let r = run(&opts(format!("http://{addr}"), Scenario::Conversation, 2)).expect("run");
    let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-charts");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).expect("mkdir");
    let serve = out.join("conv.json");
    std::fs::write(&serve, serde_json::json!({"report": r}).to_string()).expect("write");
    let experts = out.join("experts.jsonl");
    let line = |b: f64, t: f64, r: f64| format!("{{\"budget_fraction\":{b},\"decode_tok_s\":{t},\"residency\":{r}}}\n");
    std::fs::write(&experts, line(1.0, 20.0, 0.9) + &line(0.25, 12.0, 0.3)).expect("write");
    let written = osprey_bench::chart::charts(&[serve, experts], &out).expect("charts");
    assert_eq!(written.len(), 3);
    for p in written {
        let svg = std::fs::read_to_string(&p).expect("svg");
        assert!(svg.starts_with("<svg") && svg.contains("</svg>"), "{}", p.display());
    }
    assert!(osprey_bench::chart::charts(&[out.join("missing.json")], &out).is_err());
}

/// `osprey bench experts --budgets` on the default model: a two-point sweep, each budget in its own
/// process, with the disk's bandwidth and the machine in its JSON, which `bench chart` draws.
#[test]
fn a_two_point_expert_budget_sweep_runs_on_the_default_model() {
    let dir = osprey::model_dir(&Settings::default()).expect("default model");
    let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-sweep");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).expect("mkdir");
    let json = out.join("sweep.json");
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_osprey"))
        .args(["--threads", "2", "bench", "experts", "--model"])
        .arg(&dir)
        .args(["--budgets", "1,0.5", "--prompt-len", "8", "--decode-tokens", "4", "--out"])
        .arg(&json)
        .output()
        .expect("run osprey");
    // Said in full when it fails (a run once failed with nothing to say why).
    assert!(run.status.success(), "{}: {}", run.status, String::from_utf8_lossy(&run.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("parse");
    assert_eq!(v["runs"].as_array().map(Vec::len), Some(2));
    assert!(v["disk_read_gb_s"].as_f64().is_some() && v["machine"]["cores"].as_u64().is_some());
    for run in v["runs"].as_array().expect("runs") {
        for field in
            ["budget_fraction", "decode_tok_s", "residency", "bytes_read_per_token", "peak_rss_bytes", "policies"]
        {
            assert!(run.get(field).is_some(), "{field}");
        }
    }
    let written = osprey_bench::chart::charts(&[json], &out).expect("chart");
    assert!(written.iter().any(|p| p.ends_with("experts.svg")));
}

/// The binary end to end: `osprey bench serve --out` writes the report with the command line, version,
/// the machine and (with `--disk-dir`) the disk's bandwidth; a refused connection exits non-zero.
#[test]
fn the_serve_command_writes_its_json_and_fails_cleanly() {
    let dir = osprey::model_dir(&Settings::default()).expect("default model");
    let addr = harness::start(Settings::default(), dir.clone());
    let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-serve-cli.json");
    let run = |url: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_osprey"))
            .args(["bench", "serve", "--url", url, "--requests", "2", "--max-tokens", "4", "--disk-dir"])
            .arg(&dir)
            .arg("--out")
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("run osprey")
    };
    assert!(run(&format!("http://{addr}")).success());
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).expect("json")).expect("parse");
    for field in ["command", "osprey_version", "machine", "disk_read_gb_s", "report"] {
        assert!(!v[field].is_null(), "{field}");
    }
    assert_eq!(v["report"]["samples"].as_array().map(Vec::len), Some(2));
    assert!(!run("http://127.0.0.1:1").success(), "a refused connection exits non-zero");
}

/// Time to first token is the first token's chunk, not the role chunk a server sends at once: a stub
/// sends the role chunk (with `"content": ""`, as osprey and vLLM do), waits 300 ms, then a token.
#[test]
fn the_role_chunk_is_not_the_first_token() {
    let addr = stub(|request, s| {
        if !request.starts_with(b"POST") {
            let _ = write!(s, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            return;
        }
        let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n");
        let chunk = |d: &str| format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{d}}}]}}\n\n");
        let _ = s.write_all(chunk(r#"{"role":"assistant","content":""}"#).as_bytes());
        let _ = s.flush();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let _ = s.write_all(chunk(r#"{"content":"hi"}"#).as_bytes());
        let usage = r#"data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
        let _ = write!(s, "{usage}\n\ndata: [DONE]\n\n");
    });
    let r = run(&ServeOptions { concurrency: 1, ..opts(format!("http://{addr}"), Scenario::Text, 1) }).expect("run");
    let ttft = r.samples[0].ttft_s.expect("a token came");
    assert!(ttft >= 0.29, "TTFT {ttft} s counts the role chunk");
}

/// A stub HTTP server for 8 connections: `answer` gets each whole request and the socket. The request
/// is read to the end of its body first (a socket closed with unread bytes is reset, and the client
/// would see a transport error instead of the answer).
fn stub(answer: impl Fn(&[u8], &mut TcpStream) + Send + 'static) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for stream in listener.incoming().take(8) {
            let Ok(mut s) = stream else { continue };
            let mut req = Vec::new();
            let mut buf = [0u8; 65536];
            loop {
                let n = s.read(&mut buf).unwrap_or(0);
                req.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&req);
                let Some(head) = text.find("\r\n\r\n") else {
                    if n == 0 {
                        break;
                    } else {
                        continue;
                    }
                };
                let len = text[..head]
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0))
                    })
                    .unwrap_or(0usize);
                if n == 0 || req.len() >= head + 4 + len {
                    break;
                }
            }
            answer(&req, &mut s);
        }
    });
    addr
}
