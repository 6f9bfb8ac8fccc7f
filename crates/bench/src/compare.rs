//! `osprey bench compare A.json B.json`: the ratios B / A of every number two runs share, whatever
//! bench wrote them (a `bench serve --out` file, or the JSON `bench forward` / `bench experts` print).
//! Per-request samples are left out: a run is compared by its summary.

use serde_json::Value;

/// Every numeric leaf of `v` by its dotted path, skipping arrays (samples) and the run's options.
fn leaves(v: &Value, path: &str, out: &mut Vec<(String, f64)>) {
    match v {
        Value::Number(n) => {
            if let Some(x) = n.as_f64() {
                out.push((path.to_string(), x));
            }
        }
        Value::Object(m) => {
            for (k, x) in m {
                if matches!(k.as_str(), "samples" | "options" | "command" | "machine") {
                    continue;
                }
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                leaves(x, &p, out);
            }
        }
        _ => {}
    }
}

/// The comparison as a Markdown table: metric, A, B, B / A.
pub fn compare(a: &Value, b: &Value) -> String {
    let (mut la, mut lb) = (Vec::new(), Vec::new());
    leaves(a, "", &mut la);
    leaves(b, "", &mut lb);
    let mut out = String::from("| metric | A | B | B / A |\n| --- | --- | --- | --- |\n");
    let mut shared = 0;
    for (k, x) in &la {
        if let Some((_, y)) = lb.iter().find(|(kb, _)| kb == k) {
            shared += 1;
            let ratio = if *x != 0.0 { format!("{:.3}", y / x) } else { "—".to_string() };
            out.push_str(&format!("| {k} | {x:.4} | {y:.4} | {ratio} |\n"));
        }
    }
    if shared == 0 {
        out.push_str("| (the two files share no numbers) | | | |\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn shared_numbers_are_compared_and_samples_left_out() {
        let a = json!({"report": {"summary": {"ttft_s": {"p50": 0.2}, "throughput_tok_s": 10.0}, "samples": [{"ttft_s": 1.0}]}});
        let b = json!({"report": {"summary": {"ttft_s": {"p50": 0.1}, "throughput_tok_s": 25.0}, "samples": []}});
        let t = compare(&a, &b);
        assert!(t.contains("| report.summary.ttft_s.p50 | 0.2000 | 0.1000 | 0.500 |"), "{t}");
        assert!(t.contains("| report.summary.throughput_tok_s | 10.0000 | 25.0000 | 2.500 |"), "{t}");
        assert!(!t.contains("samples"));
    }
}
