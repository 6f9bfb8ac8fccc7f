//! The web page in a real browser: `osprey serve` with the embedded model, driven through headless
//! Chromium (Debian's `chromium`, which `.ci/run` installs) over the DevTools protocol. It attaches an
//! image by picking it and reads the streamed answer from the page, stops a long answer and sees the
//! engine free its sequence, reads a prefix-cache hit and expert residency from the engine view, and
//! is refused a chat until the API key is given. `OSPREY_WEBUI_SCREENSHOTS=docs` writes the screenshots
//! the README shows.

use crate::harness;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use headless_chrome::protocol::cdp::Page::CaptureScreenshotFormatOption;
use headless_chrome::{Browser, LaunchOptions, Tab};
use osprey::Settings;

fn chromium() -> PathBuf {
    let p = PathBuf::from(std::env::var("OSPREY_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into()));
    assert!(
        p.exists(),
        "{} not found: install Debian's chromium (`apt-get install chromium`; .ci/run does)",
        p.display()
    );
    p
}

fn browser() -> Browser {
    let flags = [
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-quic",
    ];
    let opts = LaunchOptions::default_builder()
        .path(Some(chromium()))
        .sandbox(false)
        .window_size(Some((1280, 900)))
        .idle_browser_timeout(Duration::from_secs(120))
        .args(flags.iter().map(std::ffi::OsStr::new).collect())
        .build()
        .expect("launch options");
    Browser::new(opts).expect("start chromium")
}

fn server(settings: Settings) -> SocketAddr {
    let dir = osprey::model_dir(&Settings::default()).expect("embedded default model");
    harness::start(settings, dir)
}

/// Evaluates `js` in the page (a string result).
fn js(tab: &Tab, js: &str) -> String {
    let v = tab.evaluate(js, true).unwrap_or_else(|e| panic!("{js}: {e}")).value;
    match v {
        Some(serde_json::Value::String(s)) => s,
        Some(v) => v.to_string(),
        None => String::new(),
    }
}

/// Waits until `js` evaluates to true.
fn wait_until(tab: &Tab, what: &str, js_cond: &str) {
    let t0 = Instant::now();
    while js(tab, &format!("Boolean({js_cond})")) != "true" {
        assert!(t0.elapsed() < Duration::from_secs(60), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn media(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/media/default").join(name)
}

fn screenshot(tab: &Tab, name: &str) {
    if let Ok(dir) = std::env::var("OSPREY_WEBUI_SCREENSHOTS") {
        let png = tab.capture_screenshot(CaptureScreenshotFormatOption::Png, None, None, true).expect("screenshot");
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir).join(name);
        std::fs::write(&path, png).expect("write screenshot");
    }
}

fn ask_with_image(tab: &Tab, question: &str) {
    let file = tab.wait_for_element("#file").expect("file input");
    file.set_input_files(&[media("red_circle_img0.png").to_str().expect("path")]).expect("pick the image");
    wait_until(tab, "the attachment chip", "document.querySelector('#attachments .chip')");
    tab.wait_for_element("#input").expect("input").click().expect("focus");
    tab.type_str(question).expect("type");
    tab.wait_for_element("#send").expect("send").click().expect("send");
}

fn last_answer(tab: &Tab) -> String {
    js(tab, "(() => { const a = [...document.querySelectorAll('.msg.assistant .content')]; return a.length ? a[a.length - 1].innerText : ''; })()")
}

#[test]
fn chat_attach_stream_stop_and_the_engine_view() {
    // Experts streamed under a budget, so the engine view has a residency map to show.
    let addr = server(Settings { expert_ram_experts: Some(2), ..Settings::default() });
    let b = browser();
    let tab = b.new_tab().expect("tab");
    tab.navigate_to(&format!("http://{addr}/")).expect("open the chat").wait_until_navigated().expect("loaded");
    wait_until(&tab, "the model name", "document.getElementById('model').textContent === 'osprey-default'");
    js(&tab, "document.getElementById('temperature').value = '0'");

    // 1. An image, picked, and the streamed answer read from the page.
    let t0 = Instant::now();
    ask_with_image(&tab, "What is in the image?");
    let mut seen = Vec::new();
    loop {
        let text = last_answer(&tab);
        if seen.last() != Some(&text) {
            seen.push(text.clone());
        }
        if text == "a red circle" && js(&tab, "document.getElementById('stop').hidden") == "true" {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no answer: {seen:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    let stats = js(&tab, "document.querySelector('.msg.assistant .stats').innerText");
    assert!(stats.contains("generated") && stats.contains("TTFT"), "{stats}");

    // 2. The same long prompt in two new chats: the second one's prefix (image included) comes from the
    //    cache. (A hybrid model resumes only at a recurrent-state snapshot, taken every 64 tokens: the
    //    system prompt makes the prompt long enough to have one.)
    js(&tab, "document.getElementById('system').value = 'You answer questions about pictures. '.repeat(12)");
    for round in 0..2 {
        tab.wait_for_element("#new-chat").expect("new chat").click().expect("new chat");
        wait_until(&tab, "an empty chat", "document.querySelectorAll('.msg').length === 0");
        ask_with_image(&tab, "What is in the image?");
        wait_until(&tab, "the answer", "document.querySelector('.msg.assistant .stats')");
        let stats = js(&tab, "document.querySelector('.msg.assistant .stats').innerText");
        assert_eq!(stats.contains("cached 0 "), round == 0, "round {round}: {stats}");
    }
    js(&tab, "document.getElementById('system').value = ''");
    screenshot(&tab, "webui-chat.png");

    // 3. A long answer, stopped midway: the engine frees the sequence.
    js(&tab, "document.getElementById('max_tokens').value = '3000'; document.getElementById('extra').value = '{\"ignore_eos\": true}'");
    tab.wait_for_element("#input").expect("input").click().expect("focus");
    tab.type_str("Tell me a long story.").expect("type");
    tab.wait_for_element("#send").expect("send").click().expect("send");
    wait_until(&tab, "the answer to stream", "document.querySelectorAll('.msg.assistant').length === 2 && [...document.querySelectorAll('.msg.assistant .content')][1].innerText.length > 20");
    assert_eq!(harness::metric(addr, "osprey_running_sequences"), 1.0, "generating while the page streams");
    tab.wait_for_element("#stop").expect("stop").click().expect("stop");
    wait_until(
        &tab,
        "the stop to show",
        "[...document.querySelectorAll('.msg.assistant .error')].some(e => e.innerText === 'stopped')",
    );
    let t0 = Instant::now();
    while harness::metric(addr, "osprey_running_sequences") != 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the stopped request still runs");
        std::thread::sleep(Duration::from_millis(50));
    }

    // 4. The engine view: a prefix-cache hit and expert residency, read from the page.
    engine_view_shows_a_hit_and_residency(&tab, addr);
    screenshot(&tab, "webui-dashboard.png");
}

/// Step 4 of [`chat_attach_stream_stop_and_the_engine_view`]: the dashboard's tiles, heat map and charts.
fn engine_view_shows_a_hit_and_residency(tab: &Tab, addr: SocketAddr) {
    tab.navigate_to(&format!("http://{addr}/dashboard")).expect("dashboard").wait_until_navigated().expect("loaded");
    wait_until(tab, "the tiles", "document.getElementById('t-prefix-hits')");
    let hits = js(tab, "document.getElementById('t-prefix-hits').innerText");
    assert!(!hits.starts_with("0 of"), "a prefix-cache hit shows: {hits}");
    let residency = js(tab, "document.getElementById('t-residency').innerText");
    assert!(residency.ends_with('%') && !residency.contains("mapped"), "{residency}");
    let cells = js(tab, "document.querySelectorAll('table.heat td.res').length");
    assert!(cells.parse::<usize>().expect("count") > 0, "the heat map shows resident experts");
    // Every row is named: decoder layers by index, a draft head's experts as the draft head.
    let (_, stats) = harness::get(addr, "/v1/engine/stats");
    let stats: serde_json::Value = serde_json::from_str(&stats).expect("stats");
    let layers = stats["experts"]["decoder_layers"].as_u64().expect("decoder layers");
    let names = js(tab, "JSON.stringify([...document.querySelectorAll('table.heat th')].map(t => t.innerText))");
    let names: Vec<String> = serde_json::from_str(&names).expect("names");
    assert!(!names.is_empty());
    for n in &names {
        let ok = n.starts_with("draft head")
            || n.strip_prefix("layer ").and_then(|i| i.parse::<u64>().ok()).is_some_and(|i| i < layers);
        assert!(ok, "heat map row {n:?} ({layers} decoder layers)");
    }
    assert!(js(tab, "document.getElementById('t-preemptions').innerText").contains('('), "preemptions shown");
    wait_until(
        tab,
        "a second poll",
        "document.querySelectorAll('#c-tps polyline')[0].getAttribute('points').length > 0",
    );
    if std::env::var("OSPREY_WEBUI_SCREENSHOTS").is_ok() {
        // Some traffic for the charts to show.
        let load: Vec<_> = (0..3)
            .map(|i| {
                std::thread::spawn(move || {
                    for j in 0..6 {
                        let body = serde_json::json!({"messages": [{"role": "user", "content": format!("Tell me a story {i} {j}.")}],
                            "max_tokens": 200, "ignore_eos": true});
                        let _ = harness::post(addr, "/v1/chat/completions", &body.to_string(), None);
                    }
                })
            })
            .collect();
        load.into_iter().for_each(|h| h.join().expect("load"));
        std::thread::sleep(Duration::from_secs(2));
    }
}

#[test]
fn with_an_api_key_the_page_asks_for_it_before_chatting() {
    let addr = server(Settings { api_key: Some("sekret".into()), ..Settings::default() });
    let b = browser();
    let tab = b.new_tab().expect("tab");
    tab.navigate_to(&format!("http://{addr}/")).expect("open").wait_until_navigated().expect("loaded");
    // The page itself loads; the API refuses it until the key is given, and the page asks.
    wait_until(&tab, "the key dialog", "document.getElementById('key-dialog').open");
    js(&tab, "document.getElementById('key-dialog').close()");
    wait_until(&tab, "the refusal", "document.getElementById('model').textContent.startsWith('401')");
    tab.wait_for_element("#input").expect("input").click().expect("focus");
    tab.type_str("Hello!").expect("type");
    tab.wait_for_element("#send").expect("send").click().expect("send");
    wait_until(&tab, "the key dialog again", "document.getElementById('key-dialog').open");
    tab.wait_for_element("#key-input").expect("key").click().expect("focus");
    tab.type_str("sekret").expect("type");
    tab.wait_for_element("#key-save").expect("save").click().expect("save");
    wait_until(&tab, "an answer with the key", "document.querySelector('.msg.assistant .stats')");
    assert_eq!(js(&tab, "localStorage.getItem('osprey.apiKey')"), "sekret", "kept in the browser");
}

#[test]
fn the_page_is_small_self_contained_and_can_be_turned_off() {
    assert!(osprey_server::webui_bytes() < 200_000, "{} bytes", osprey_server::webui_bytes());
    let addr = server(Settings::default());
    for path in ["/", "/dashboard", "/webui/chat.js", "/webui/style.css"] {
        let r = ureq::get(&format!("http://{addr}{path}")).call().expect(path);
        assert_eq!(r.status(), 200);
        assert_eq!(r.header("content-security-policy"), Some(osprey_server::WEBUI_CSP), "{path}");
        let body = r.into_string().expect("body");
        assert!(
            !body.contains("http://") && !body.contains("https://") || path.ends_with(".js"),
            "{path} loads from elsewhere"
        );
    }
    // `HEAD /` is answered, and the icon a browser asks for exists (it was the page's one console error).
    assert_eq!(ureq::head(&format!("http://{addr}/")).call().expect("HEAD /").status(), 200);
    let icon = ureq::get(&format!("http://{addr}/favicon.ico")).call().expect("favicon");
    assert_eq!(icon.header("content-type"), Some("image/svg+xml"));
    let off = server(Settings { no_webui: Some(true), ..Settings::default() });
    assert_eq!(harness::get(off, "/").0, 404);
    assert_eq!(harness::get(off, "/dashboard").0, 404);
    assert_eq!(harness::get(off, "/health").0, 200);
}

/// Issue 37, item 4, on a phone (390×844): the conversations and settings slide over from a menu button,
/// Send is on the screen, a long word wraps; a stream paints only its own conversation (switching chats
/// mid-answer once painted B's text into A); invalid "More request fields" keep the typed text and the
/// attachment and save nothing; line breaks stay; an edit can be cancelled; the Markdown an answer can
/// hold renders; the box has the focus and Attach is a button; a stopped answer has its numbers too.
#[test]
fn the_chat_on_a_phone_keeps_what_the_user_typed_and_each_stream_in_its_chat() {
    use headless_chrome::protocol::cdp::Emulation::SetDeviceMetricsOverride;
    let addr = server(Settings::default());
    let b = browser();
    let tab = b.new_tab().expect("tab");
    tab.call_method(SetDeviceMetricsOverride {
        width: 390,
        height: 844,
        device_scale_factor: 3.0,
        mobile: true,
        scale: None,
        screen_width: None,
        screen_height: None,
        position_x: None,
        position_y: None,
        dont_set_visible_size: None,
        screen_orientation: None,
        viewport: None,
        display_feature: None,
        device_posture: None,
    })
    .expect("a phone's screen");
    tab.navigate_to(&format!("http://{addr}/")).expect("open the chat").wait_until_navigated().expect("loaded");
    wait_until(&tab, "the model name", "document.getElementById('model').textContent === 'osprey-default'");
    assert_eq!(js(&tab, "document.activeElement.id"), "input", "the message box has the focus");
    assert_eq!(js(&tab, "document.getElementById('attach').tagName"), "BUTTON", "Attach is reachable by keyboard");
    assert!(
        js(&tab, "document.querySelector('.empty').innerText").contains("images"),
        "the empty chat says what the model reads"
    );

    // 1. The layout: the side panel is off-screen until the menu opens it; Send fits.
    let rect =
        |sel: &str| js(&tab, &format!("JSON.stringify(document.querySelector('{sel}').getBoundingClientRect())"));
    let right = |sel: &str| {
        serde_json::from_str::<serde_json::Value>(&rect(sel)).expect("rect")["right"].as_f64().expect("right")
    };
    assert_eq!(js(&tab, "getComputedStyle(document.getElementById('side')).display"), "none");
    assert!(right("#send") <= 390.0 && right("#send") > 300.0, "Send at {}", rect("#send"));
    assert!(right("main") >= 389.0, "the chat takes the width: {}", rect("main"));
    tab.wait_for_element("#menu").expect("menu").click().expect("open the menu");
    assert_eq!(js(&tab, "getComputedStyle(document.getElementById('side')).display"), "flex");
    tab.wait_for_element("#menu").expect("menu").click().expect("close the menu");

    // 2. Line breaks stay, a long word wraps inside the page, and the answer's numbers.
    js(&tab, "document.getElementById('temperature').value = '0'; document.getElementById('input').value = 'line one\\nline two ' + 'x'.repeat(300); document.getElementById('composer').requestSubmit()");
    wait_until(&tab, "the answer", "document.querySelector('.msg.assistant .stats')");
    assert_eq!(js(&tab, "document.querySelector('.msg.user .content').innerText.split('\\n').length"), "2");
    assert!(
        js(&tab, "document.documentElement.scrollWidth").parse::<f64>().expect("width") <= 390.0,
        "nothing runs off-screen"
    );

    // 3. Invalid extra fields: nothing is sent or saved; the text and the attachment stay.
    let saved = || js(&tab, "JSON.parse(localStorage.getItem('osprey.conversations'))[0].messages.length");
    let before = saved();
    js(&tab, "document.getElementById('extra').value = '{\"top_k\": 2'");
    let file = tab.wait_for_element("#file").expect("file input");
    file.set_input_files(&[media("red_circle_img0.png").to_str().expect("path")]).expect("pick the image");
    wait_until(&tab, "the attachment chip", "document.querySelector('#attachments .chip')");
    js(&tab, "document.getElementById('input').value = 'keep me'; document.getElementById('composer').requestSubmit()");
    wait_until(&tab, "the notice", "!document.getElementById('notice').hidden");
    assert!(js(&tab, "document.getElementById('notice').innerText").contains("More request fields"));
    assert_eq!(js(&tab, "document.getElementById('input').value"), "keep me");
    assert_eq!(js(&tab, "document.querySelectorAll('#attachments .chip').length"), "1");
    assert_eq!(saved(), before, "nothing saved");
    js(&tab, "document.getElementById('extra').value = ''; document.getElementById('input').value = ''");
    js(&tab, "document.querySelector('#attachments .chip .del').click()");

    // 4. Edit, then cancel: the conversation is as it was.
    let count = js(&tab, "document.querySelectorAll('.msg').length");
    js(&tab, "document.querySelector('.msg.user .edit').click()");
    let editing = js(&tab, "document.getElementById('input').value");
    assert!(editing.starts_with("line one\nline two"), "{editing:?}");
    js(&tab, "document.getElementById('cancel-edit').click()");
    assert_eq!(js(&tab, "document.querySelectorAll('.msg').length"), count);
    assert_eq!(js(&tab, "document.getElementById('input').value"), "");

    // 5. A long answer in chat A; chat B opened mid-stream stays empty; back in A the answer goes on; stopped.
    a_stream_stays_in_its_chat(&tab);

    // 6. The Markdown an answer may hold.
    let md = "| a | b |\\n|---|---|\\n| 1 | 2 |\\n\\n> quoted\\n\\n3. three\\n   - nested\\n4. four\\n\\nsee https://example.com/x.\\n\\n```\\ncode\\n```";
    let shape = js(&tab, &format!("(() => {{ const d = document.createElement('div'); renderMarkdown(\"{md}\", d); return [d.querySelectorAll('table td').length, d.querySelector('blockquote').innerText, d.querySelector('ol').start, d.querySelectorAll('ol > li > ul > li').length, d.querySelector('a').href, d.querySelector('pre button.copy') !== null].join(' '); }})()"));
    assert_eq!(shape, "2 quoted 3 1 https://example.com/x true");
}

/// Step 5 of [`the_chat_on_a_phone_keeps_what_the_user_typed_and_each_stream_in_its_chat`].
fn a_stream_stays_in_its_chat(tab: &Tab) {
    js(tab, "document.getElementById('max_tokens').value = '2000'; document.getElementById('extra').value = '{\"ignore_eos\": true}'");
    js(tab, "document.getElementById('input').value = 'Tell me a long story.'; document.getElementById('composer').requestSubmit()");
    wait_until(
        tab,
        "the answer to stream",
        "[...document.querySelectorAll('.msg.assistant .content')].pop().innerText.length > 20",
    );
    let chat_a = js(tab, "document.querySelector('#conversations li.current a').innerText");
    js(tab, "document.getElementById('new-chat').click()");
    let painted = js(tab, "new Promise(ok => setTimeout(() => ok(document.querySelectorAll('.msg').length), 400))");
    assert_eq!(painted, "0", "chat B shows nothing of A's stream");
    js(
        tab,
        &format!("[...document.querySelectorAll('#conversations li a')].find(a => a.innerText === {chat_a:?}).click()"),
    );
    let len = js(tab, "[...document.querySelectorAll('.msg.assistant .content')].pop().innerText.length")
        .parse::<usize>()
        .expect("length");
    wait_until(
        tab,
        "A's answer to go on",
        &format!("[...document.querySelectorAll('.msg.assistant .content')].pop().innerText.length > {len}"),
    );
    js(tab, "document.getElementById('stop').click()");
    wait_until(
        tab,
        "the stopped answer's numbers",
        "[...document.querySelectorAll('.msg.assistant .stats')].pop()?.innerText.startsWith('stopped after')",
    );
}

/// The engine view without an expert budget hides the expert sections; every chart's scale has its unit;
/// the KV tile splits running sequences from the prefix cache; and a counter that goes down (a server
/// restart between two polls) gives no rate rather than a negative one.
#[test]
fn the_engine_view_hides_what_does_not_apply_and_never_shows_a_negative_rate() {
    let addr = server(Settings::default());
    let body = serde_json::json!({"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 40});
    let _ = harness::post(addr, "/v1/chat/completions", &body.to_string(), None);
    let b = browser();
    let tab = b.new_tab().expect("tab");
    tab.navigate_to(&format!("http://{addr}/dashboard")).expect("dashboard").wait_until_navigated().expect("loaded");
    wait_until(&tab, "two polls", "series.running.length >= 2");
    assert_eq!(js(&tab, "document.getElementById('experts-section').hidden"), "true");
    assert_eq!(js(&tab, "document.getElementById('disk-figure').hidden"), "true");
    assert_eq!(js(&tab, "document.getElementById('t-residency') === null"), "true");
    let axes = js(
        &tab,
        "JSON.stringify([...document.querySelectorAll('figure:not([hidden]) svg text')].map(t => t.textContent))",
    );
    let axes: Vec<String> = serde_json::from_str(&axes).expect("axes");
    assert_eq!(axes.len(), 5, "{axes:?}");
    for (a, unit) in axes.iter().zip(["tok/s", " s", "requests", "pages", "%"]) {
        assert!(a.ends_with(unit), "{a:?} lacks its unit {unit:?}");
    }
    let kv = js(&tab, "document.getElementById('t-kv').innerText");
    assert!(kv.contains(" · ") && kv.contains(" of "), "{kv}");
    // The server "restarts": the last poll's counters are above the next ones.
    js(&tab, "last.tokens.generated_total += 1e9; last.prefix_cache.lookups += 1e9");
    let n = js(&tab, "series.tps.length").parse::<usize>().expect("n");
    wait_until(&tab, "the next poll", &format!("series.tps.length > {n}"));
    assert_eq!(
        js(&tab, "series.tps[series.tps.length - 1] === null && series.tps.every(v => v === null || v >= 0)"),
        "true"
    );
}
