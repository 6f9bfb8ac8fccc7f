//! One module per command (as cargo's `commands/`): `main` parses and dispatches, each command's
//! module holds its flags and its work. The global flags reach every command as a [`Global`].

pub mod bench;
pub mod roofline;
pub mod run;
pub mod serve;

use anyhow::{Context, Result};

/// The flags every command takes (`--threads`, `--device`, `--activations`, `--gemm`).
#[derive(Clone, Debug, Default)]
pub struct Global {
    /// Compute threads.
    pub threads: Option<usize>,
    /// Compute device.
    pub device: Option<String>,
    /// Activations of the matmuls.
    pub activations: Option<String>,
    /// The best prefill GEMM allowed.
    pub gemm: Option<String>,
}

impl Global {
    /// The flags again, for a command that runs osprey in a child process (`bench experts --budgets`).
    pub fn args(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(t) = self.threads {
            out.extend(["--threads".to_string(), t.to_string()]);
        }
        for (flag, v) in [("--device", &self.device), ("--activations", &self.activations), ("--gemm", &self.gemm)] {
            if let Some(v) = v {
                out.extend([flag.to_string(), v.clone()]);
            }
        }
        out
    }
}

/// `osprey quantize`: a dense checkpoint (directory or Hugging Face id) into NVFP4.
pub fn quantize(model: &std::path::Path, out: &std::path::Path, all_linear: bool, lm_head: bool) -> Result<()> {
    let opts = osprey_models::QuantizeOptions { all_linear, lm_head };
    let mut progress = osprey::Progress::new("quantizing");
    osprey_models::quantize_dir(&osprey::hub::resolve(model)?, out, opts, &mut |d, n| progress.update(d, n))?;
    tracing::info!(out = %out.display(), "wrote the NVFP4 checkpoint");
    Ok(())
}

/// `osprey pull`: the model's snapshot directory, downloaded unless the cache has it.
pub fn pull(id: &str) -> Result<()> {
    let dir = osprey::hub::pull_id(id)?;
    println!("{}", dir.display());
    Ok(())
}

/// `osprey run`: the model loaded (by directory or id, with its draft head when drafting), one prompt.
pub fn run_one(mut a: run::RunArgs, g: &Global) -> Result<()> {
    a.model = osprey::hub::resolve(&a.model)?;
    let backend = osprey::open_backend(g.device.as_deref(), g.activations.as_deref())?;
    let load = || -> Result<osprey_models::Model> {
        let cfg = osprey_models::ModelConfig::from_dir(&a.model)?;
        let ck = osprey_models::Checkpoint::open(&a.model)?;
        let opts = osprey_models::LoadOptions { draft_head: a.speculative_tokens > 0, ..Default::default() };
        Ok(osprey_models::load_with_options(&cfg, &ck, opts, backend.clone(), &mut |_, _| {})?)
    };
    let m = load().with_context(|| format!("loading {}", a.model.display()))?;
    run::run(a, m, backend)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 34: `bench experts --budgets` re-ran itself without `--device`; a child gets every global flag.
    #[test]
    fn a_child_process_gets_every_global_flag() {
        let g = Global {
            threads: Some(2),
            device: Some("cpu".into()),
            activations: Some("f32".into()),
            gemm: Some("bf16".into()),
        };
        assert_eq!(g.args(), ["--threads", "2", "--device", "cpu", "--activations", "f32", "--gemm", "bf16"]);
        assert!(Global::default().args().is_empty());
    }
}
