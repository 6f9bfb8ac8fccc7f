//! NVFP4 quantisation and dequantisation against the numpy reference (tools/nvfp4_ref.py), byte for byte,
//! and NVFP4 checkpoints through the loader.

mod common;

use common::Ref;
use osprey_kernels::nvfp4::dequant_row;
use osprey_models::quant::quantize_nvfp4;

#[test]
fn quantisation_and_dequantisation_equal_the_numpy_reference_exactly() {
    let r = Ref::load_file("nvfp4.safetensors");
    for name in ["a", "b"] {
        let (_, shape, _) = r.raw(&format!("{name}.w"));
        let (rows, cols) = (shape[0], shape[1]);
        let q = quantize_nvfp4(&r.f32s(&format!("{name}.w")), rows, cols);
        assert_eq!(q.packed, r.raw(&format!("{name}.packed")).2, "{name} packed codes");
        assert_eq!(q.scales, r.raw(&format!("{name}.scales")).2, "{name} e4m3 scales");
        assert_eq!(q.global, r.f32s(&format!("{name}.global"))[0], "{name} global scale");
        let want = r.f32s(&format!("{name}.dequant"));
        let mut got = vec![0f32; rows * cols];
        for row in 0..rows {
            let (p, s) = (&q.packed[row * cols / 2..(row + 1) * cols / 2], &q.scales[row * cols / 16..(row + 1) * cols / 16]);
            dequant_row(p, s, q.global, &mut got[row * cols..(row + 1) * cols]);
        }
        assert_eq!(got, want, "{name} dequantised values");
    }
}
