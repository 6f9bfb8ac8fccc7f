//! The bench crate's integration tests in one binary (issue 34): the report and the synthetic checkpoints.

mod device;
mod report;
mod roofline;
mod synth;
