//! Decoding media bytes into RGB frames with the `image` crate: PNG, JPEG (EXIF orientation applied),
//! WebP, GIF (first frame, or every frame as a video) and BMP.
//!
//! Alpha is composited onto white with Pillow's `alpha_composite` integer arithmetic, which is what
//! transformers does for images with transparency (`image_transforms.convert_to_rgb`). The declared size
//! is checked against a pixel cap before any pixel is decoded (decompression bombs).

use std::io::Cursor;
use std::time::Duration;

use image::{AnimationDecoder, DynamicImage, ImageDecoder, ImageFormat, ImageReader, RgbaImage};

use crate::error::{Error, Result};

/// An 8-bit RGB image, row-major `[height, width, 3]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RgbImage {
    /// Columns.
    pub width: usize,
    /// Rows.
    pub height: usize,
    /// `height·width·3` bytes.
    pub data: Vec<u8>,
}

/// Limits applied while decoding.
#[derive(Clone, Copy, Debug)]
pub struct DecodeLimits {
    /// Largest `width·height` accepted, checked on the header before decoding.
    pub max_pixels: u64,
    /// Most frames decoded from an animation.
    pub max_frames: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits { max_pixels: 64 << 20, max_frames: 768 }
    }
}

/// Pillow's `alpha_composite` of `src` over an opaque white background (PRECISION_BITS 7 arithmetic).
fn over_white(r: u8, g: u8, b: u8, a: u8) -> [u8; 3] {
    if a == 255 {
        return [r, g, b];
    }
    if a == 0 {
        return [255, 255, 255];
    }
    const PB: u32 = 7;
    let a = a as u32;
    let blend = 255 * (255 - a);
    let outa255 = a * 255 + blend;
    let coef1 = a * 255 * 255 * (1 << PB) / outa255;
    let coef2 = 255 * (1 << PB) - coef1;
    let ch = |s: u8| {
        let t = s as u32 * coef1 + 255 * coef2 + (0x80 << PB);
        ((((t >> 8) + t) >> 8) >> PB) as u8
    };
    [ch(r), ch(g), ch(b)]
}

/// An RGBA image composed over white into RGB in its own buffer: pixel `i`'s three bytes go to `3i`,
/// never past the `4i` still to be read, so no second image-sized buffer is made (a 64 Mpx RGBA image
/// peaked at ~750 MB: the decoded image, a copy, and a growing output; now its 256 MB).
fn rgba_into_rgb(img: RgbaImage) -> RgbImage {
    let (width, height) = (img.width() as usize, img.height() as usize);
    let mut data = img.into_raw();
    let n = data.len() / 4;
    for i in 0..n {
        let [r, g, b] = over_white(data[4 * i], data[4 * i + 1], data[4 * i + 2], data[4 * i + 3]);
        data[3 * i..3 * i + 3].copy_from_slice(&[r, g, b]);
    }
    data.truncate(3 * n);
    data.shrink_to_fit();
    RgbImage { width, height, data }
}

fn from_dynamic(img: DynamicImage) -> RgbImage {
    if img.color().has_alpha() {
        // `into_rgba8` takes an 8-bit RGBA image's buffer as it is (other layouts are converted).
        rgba_into_rgb(img.into_rgba8())
    } else {
        let rgb = img.to_rgb8();
        RgbImage { width: rgb.width() as usize, height: rgb.height() as usize, data: rgb.into_raw() }
    }
}

fn bad(e: impl std::fmt::Display) -> Error {
    Error::InvalidInput(format!("cannot decode image: {e}"))
}

fn check_size(w: u32, h: u32, limits: DecodeLimits) -> Result<()> {
    let px = w as u64 * h as u64;
    if px > limits.max_pixels {
        return Err(Error::MediaLimit(format!(
            "image declares {w}x{h} = {px} pixels, more than the limit of {}",
            limits.max_pixels
        )));
    }
    if px == 0 {
        return Err(Error::InvalidInput("image has no pixels".into()));
    }
    Ok(())
}

const PNG_SIGNATURE: &[u8; 8] = b"\x89PNG\r\n\x1a\n";

/// A PNG without its compressed metadata: `iCCP` (the decoder inflates an ICC profile eagerly, up to its
/// allocation limit, while reading the header: a few kilobytes of zlib can hold hundreds of megabytes,
/// and 160 such frames once held a worker for 25 s), `zTXt`, `iTXt` and `tEXt`. osprey applies no colour
/// profile (transformers does not either), so dropping them changes no pixel. Other formats, and PNGs
/// without such chunks, are returned as they are; a malformed chunk list is left to the decoder.
pub fn strip_png_metadata(bytes: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    use std::borrow::Cow;
    if !bytes.starts_with(PNG_SIGNATURE) {
        return Cow::Borrowed(bytes);
    }
    let mut chunks = Vec::new();
    let mut at = PNG_SIGNATURE.len();
    while at + 12 <= bytes.len() {
        let len = u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize;
        let end = at.saturating_add(12).saturating_add(len);
        if end > bytes.len() {
            return Cow::Borrowed(bytes);
        }
        let kind = &bytes[at + 4..at + 8];
        chunks.push((at..end, matches!(kind, b"iCCP" | b"zTXt" | b"iTXt" | b"tEXt")));
        at = end;
        if kind == b"IEND" {
            break;
        }
    }
    if !chunks.iter().any(|(_, drop)| *drop) {
        return Cow::Borrowed(bytes);
    }
    let mut out = Vec::with_capacity(bytes.len());
    out.extend_from_slice(PNG_SIGNATURE);
    for (range, drop) in chunks {
        if !drop {
            out.extend_from_slice(&bytes[range]);
        }
    }
    out.extend_from_slice(&bytes[at..]);
    Cow::Owned(out)
}

/// `(width, height)` an image file declares in its header, without decoding it.
pub fn declared_size(bytes: &[u8]) -> Result<(u32, u32)> {
    if let Some(kind) = video_container(bytes) {
        return Err(container_error(kind));
    }
    let bytes = &*strip_png_metadata(bytes);
    let reader = ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(bad)?;
    if reader.format().is_none() {
        return Err(Error::InvalidInput("unsupported or unrecognised image format".into()));
    }
    reader.into_dimensions().map_err(bad)
}

/// Decodes one still image (the first frame of an animation), EXIF orientation applied.
pub fn decode_image(bytes: &[u8], limits: DecodeLimits) -> Result<RgbImage> {
    let bytes = &*strip_png_metadata(bytes);
    let reader = ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(bad)?;
    if reader.format().is_none() {
        return Err(Error::InvalidInput("unsupported or unrecognised image format".into()));
    }
    let mut decoder = reader.into_decoder().map_err(bad)?;
    let (w, h) = decoder.dimensions();
    check_size(w, h, limits)?;
    let orientation = decoder.orientation().map_err(bad)?;
    let mut img = DynamicImage::from_decoder(decoder).map_err(bad)?;
    img.apply_orientation(orientation);
    Ok(from_dynamic(img))
}

/// A decoded animation: frames and their rate.
#[derive(Clone, Debug)]
pub struct Frames {
    /// Frames in order.
    pub frames: Vec<RgbImage>,
    /// Frames per second derived from the frame delays (`None` when the file gives no delays).
    pub fps: Option<f64>,
}

fn container_error(kind: &str) -> Error {
    Error::InvalidMedia(format!(
        "{kind} video is not supported by this build (no system video decoder); send the video as a list of frame images or as an animated GIF/WebP"
    ))
}

/// Container formats we recognise but do not decode (no system video decoder in this build).
fn video_container(bytes: &[u8]) -> Option<&'static str> {
    if bytes.len() >= 12 && &bytes[4..8] == b"ftyp" {
        Some("MP4/MOV")
    } else if bytes.starts_with(&[0x1A, 0x45, 0xDF, 0xA3]) {
        Some("WebM/Matroska")
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"AVI " {
        Some("AVI")
    } else {
        None
    }
}

/// What an animation decoder may allocate at once: a frame and the canvas it is composited on, each at
/// most the pixel limit in RGBA. A frame's own header can declare any size inside a small canvas (a
/// 300-byte GIF declared a 62,965 × 62,197 frame, found by the `media` fuzz target), and decoders built
/// directly, unlike `ImageReader`, start with no limits at all.
fn alloc_limits(limits: DecodeLimits) -> image::Limits {
    let mut l = image::Limits::default();
    l.max_alloc = Some(limits.max_pixels.saturating_mul(4 * 4));
    l
}

/// Decodes every frame of an animated GIF or WebP (a still image gives one frame). Video containers
/// (MP4, WebM, AVI) are refused with a clear error: send frames or an animated GIF/WebP instead.
pub fn decode_animation(bytes: &[u8], limits: DecodeLimits) -> Result<Frames> {
    if let Some(kind) = video_container(bytes) {
        return Err(container_error(kind));
    }
    let bytes = &*strip_png_metadata(bytes);
    let format = image::guess_format(bytes).map_err(bad)?;
    let collect = |frames: image::Frames<'_>| -> Result<Frames> {
        let mut out = Vec::new();
        let mut total = Duration::ZERO;
        for f in frames {
            let f = f.map_err(bad)?;
            if out.len() == limits.max_frames {
                return Err(Error::MediaLimit(format!("animation has more than {} frames", limits.max_frames)));
            }
            total += Duration::from(f.delay());
            let buf = f.into_buffer();
            check_size(buf.width(), buf.height(), limits)?;
            out.push(rgba_into_rgb(buf));
        }
        if out.is_empty() {
            return Err(Error::InvalidInput("animation has no frames".into()));
        }
        let secs = total.as_secs_f64();
        let fps = (secs > 0.0).then(|| out.len() as f64 / secs);
        Ok(Frames { frames: out, fps })
    };
    match format {
        ImageFormat::Gif => {
            let mut d = image::codecs::gif::GifDecoder::new(Cursor::new(bytes)).map_err(bad)?;
            let (w, h) = d.dimensions();
            check_size(w, h, limits)?;
            d.set_limits(alloc_limits(limits)).map_err(bad)?;
            collect(d.into_frames())
        }
        ImageFormat::WebP => {
            let mut d = image::codecs::webp::WebPDecoder::new(Cursor::new(bytes)).map_err(bad)?;
            let (w, h) = d.dimensions();
            check_size(w, h, limits)?;
            d.set_limits(alloc_limits(limits)).map_err(bad)?;
            if d.has_animation() {
                collect(d.into_frames())
            } else {
                Ok(Frames { frames: vec![decode_image(bytes, limits)?], fps: None })
            }
        }
        _ => Ok(Frames { frames: vec![decode_image(bytes, limits)?], fps: None }),
    }
}

#[cfg(test)]
mod tests {
    /// CRC-32 (PNG's, over the chunk type and data).
    fn crc32(kind: &[u8], data: &[u8]) -> u32 {
        let mut c = 0xFFFF_FFFFu32;
        for &b in kind.iter().chain(data) {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
            }
        }
        !c
    }

    use super::*;

    fn png(img: &RgbaImage) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, ImageFormat::Png).expect("encode");
        out.into_inner()
    }

    #[test]
    fn alpha_is_composited_on_white_and_opaque_pixels_are_kept() {
        let mut img = RgbaImage::new(3, 1);
        img.put_pixel(0, 0, image::Rgba([10, 20, 30, 255]));
        img.put_pixel(1, 0, image::Rgba([0, 0, 0, 0]));
        img.put_pixel(2, 0, image::Rgba([0, 0, 0, 128]));
        let out = decode_image(&png(&img), DecodeLimits::default()).expect("decode");
        assert_eq!(&out.data[..6], &[10, 20, 30, 255, 255, 255]);
        // Pillow: black at alpha 128 over white = 127.
        assert_eq!(&out.data[6..], &[127, 127, 127]);
    }

    /// The resident peak of decoding one 64 Mpx RGBA PNG, in MB above what the process held (the peak
    /// is reset through `/proc/self/clear_refs` once the PNG is encoded). Run alone:
    /// `cargo test -p osprey-models --lib -- --ignored --nocapture peak_of_a_64_mpx`.
    #[test]
    #[ignore]
    fn peak_of_a_64_mpx_rgba_decode() {
        let status = |key: &str| -> u64 {
            let s = std::fs::read_to_string("/proc/self/status").expect("status");
            let line = s.lines().find(|l| l.starts_with(key)).expect("field");
            line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("kB")
        };
        let bytes = {
            let img = RgbaImage::from_fn(8000, 8000, |x, y| image::Rgba([x as u8, y as u8, 7, (x ^ y) as u8]));
            png(&img)
        };
        std::fs::write("/proc/self/clear_refs", "5").expect("reset the peak");
        let before = status("VmRSS:");
        let out = decode_image(&bytes, DecodeLimits::default()).expect("decode");
        let peak = status("VmHWM:");
        eprintln!(
            "64 Mpx RGBA decode: peak {} MB above {} MB ({} MB of RGB kept)",
            (peak - before) / 1024,
            before / 1024,
            out.data.len() >> 20
        );
    }

    /// The in-place composition equals composing each pixel on its own, over every alpha and a spread
    /// of colours (pixel `i` written at `3i` never overtakes the `4i` still to be read).
    #[test]
    fn rgba_composed_in_its_own_buffer_equals_pixel_by_pixel() {
        let mut img = RgbaImage::new(64, 17);
        for (i, p) in img.pixels_mut().enumerate() {
            *p = image::Rgba([(i * 37) as u8, (i * 101) as u8, (i * 7) as u8, i as u8]);
        }
        let want: Vec<u8> = img.pixels().flat_map(|p| over_white(p[0], p[1], p[2], p[3])).collect();
        let got = rgba_into_rgb(img);
        assert_eq!((got.width, got.height), (64, 17));
        assert_eq!(got.data, want);
    }

    #[test]
    fn every_supported_still_format_decodes_to_the_same_pixels() {
        let mut img = RgbaImage::new(5, 3);
        for (i, p) in img.pixels_mut().enumerate() {
            *p = image::Rgba([(i * 13) as u8, (i * 7) as u8, 200, 255]);
        }
        let want = decode_image(&png(&img), DecodeLimits::default()).expect("png");
        for fmt in [ImageFormat::Bmp, ImageFormat::WebP, ImageFormat::Gif] {
            let mut out = Cursor::new(Vec::new());
            let rgb = DynamicImage::ImageRgba8(img.clone());
            // GIF quantises colours; BMP and lossless WebP are exact.
            if fmt == ImageFormat::Gif {
                rgb.write_to(&mut out, fmt).expect("encode");
                let got = decode_image(out.get_ref(), DecodeLimits::default()).expect("gif");
                assert_eq!((got.width, got.height), (5, 3));
                continue;
            }
            rgb.write_to(&mut out, fmt).expect("encode");
            assert_eq!(decode_image(out.get_ref(), DecodeLimits::default()).expect("decode"), want, "{fmt:?}");
        }
    }

    #[test]
    fn animated_gif_frames_and_rate_and_containers_refused() {
        use image::codecs::gif::GifEncoder;
        let mut out = Vec::new();
        {
            let mut enc = GifEncoder::new(&mut out);
            for v in [0u8, 100, 200] {
                let buf = RgbaImage::from_pixel(4, 2, image::Rgba([v, v, v, 255]));
                let frame = image::Frame::from_parts(buf, 0, 0, image::Delay::from_numer_denom_ms(500, 1));
                enc.encode_frame(frame).expect("frame");
            }
        }
        let f = decode_animation(&out, DecodeLimits::default()).expect("gif");
        assert_eq!(f.frames.len(), 3);
        assert_eq!(f.fps, Some(2.0));
        assert_eq!((f.frames[1].width, f.frames[1].height), (4, 2));
        assert!(f.frames[2].data[0] >= 195, "{:?}", &f.frames[2].data[..3]);
        // The first frame of the same GIF as a still image.
        assert_eq!(decode_image(&out, DecodeLimits::default()).expect("still").data[0], f.frames[0].data[0]);
        let too_many = decode_animation(&out, DecodeLimits { max_frames: 2, ..DecodeLimits::default() });
        assert!(too_many.is_err());
        let mp4 = [0u8, 0, 0, 24, b'f', b't', b'y', b'p', b'i', b's', b'o', b'm'];
        let e = decode_animation(&mp4, DecodeLimits::default()).expect_err("mp4").to_string();
        assert!(e.contains("MP4") && e.contains("frame"), "{e}");
    }

    #[test]
    fn a_gif_frame_larger_than_its_canvas_is_refused_before_allocating() {
        // Found by the `media` fuzz target: an 8×8 canvas whose third frame declares 62,965 × 62,197
        // pixels; decoding it allocated ~15 GB. The corpus file starts with the target's selector byte.
        let bytes = &include_bytes!("../../../../fuzz/corpus/media/crash_gif_huge_frame")[1..];
        let t0 = std::time::Instant::now();
        let e = decode_animation(bytes, DecodeLimits::default()).expect_err("refused");
        assert!(e.to_string().contains("limit"), "{e}");
        assert!(t0.elapsed().as_secs() < 5);
    }

    #[test]
    fn pixel_cap_is_checked_before_decoding_and_garbage_is_an_error() {
        let img = RgbaImage::new(100, 100);
        let e = decode_image(&png(&img), DecodeLimits { max_pixels: 9_999, max_frames: 1 }).expect_err("cap");
        assert!(e.to_string().contains("10000 pixels"), "{e}");
        assert!(decode_image(b"not an image at all", DecodeLimits::default()).is_err());
        // An iCCP chunk whose profile inflates to 64 MiB of zeros: stripped unread, same pixels.
        let plain = png(&RgbaImage::from_pixel(3, 2, image::Rgba([9, 8, 7, 255])));
        let bomb = {
            use std::io::Write;
            let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
            z.write_all(&vec![0u8; 64 << 20]).expect("deflate");
            let mut data = b"icc\0\0".to_vec();
            data.extend(z.finish().expect("deflate"));
            let mut chunk = (data.len() as u32).to_be_bytes().to_vec();
            chunk.extend_from_slice(b"iCCP");
            chunk.extend_from_slice(&data);
            chunk.extend_from_slice(&crc32(b"iCCP", &data).to_be_bytes());
            let mut b = plain[..33].to_vec(); // signature + IHDR
            b.extend(chunk);
            b.extend_from_slice(&plain[33..]);
            b
        };
        assert!(bomb.len() < 200_000, "{}", bomb.len());
        assert_eq!(strip_png_metadata(&bomb).as_ref(), plain.as_slice());
        let t = std::time::Instant::now();
        assert_eq!(
            decode_image(&bomb, DecodeLimits::default()).expect("decodes"),
            decode_image(&plain, DecodeLimits::default()).expect("decodes")
        );
        assert!(t.elapsed().as_millis() < 500, "the profile was not inflated");
        let mut bytes = png(&RgbaImage::new(8, 8));
        bytes.truncate(bytes.len() / 2);
        assert!(decode_image(&bytes, DecodeLimits::default()).is_err());
    }
}
