//! Where a tensor lives, as `--device` names it.

use std::fmt;
use std::str::FromStr;

/// A compute device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory and the CPU kernels.
    #[default]
    Cpu,
    /// CUDA device `N`.
    Cuda(usize),
    /// The emulated CUDA device: the CUDA backend's kernels compiled for the host, a test device.
    CudaEmu,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::CudaEmu => f.write_str("cuda-emu"),
        }
    }
}

impl FromStr for Device {
    type Err = String;

    /// `cpu`, `cuda` (device 0), `cuda:N` or `cuda-emu`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            "cuda-emu" => Ok(Device::CudaEmu),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device `{s}` (cpu, cuda, cuda:N or cuda-emu)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Device;

    #[test]
    fn devices_parse_and_print_as_the_flag_names_them() {
        for (s, d) in [
            ("cpu", Device::Cpu),
            ("CUDA", Device::Cuda(0)),
            ("cuda:1", Device::Cuda(1)),
            ("cuda-emu", Device::CudaEmu),
        ] {
            assert_eq!(s.parse::<Device>(), Ok(d));
        }
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        assert!("gpu".parse::<Device>().is_err() && "cuda:x".parse::<Device>().is_err());
    }
}
