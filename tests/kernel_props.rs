//! Property tests of candle-amp's CPU kernels, through the public API, on half-representable
//! values:
//!
//! - the GEMM and the GEMM convolution against candle's f32 kernels: odd sizes (1, 7, 17, up to
//!   1000+ in a dimension), transposed and strided operands, batches and broadcast batches,
//!   padding, stride, dilation and groups; the convolution's gradients against a computation by
//!   hand in f64. Both sides accumulate on identical inputs, so they differ by summation order
//!   (a few f32 ulps of the sum of |products|) and by the half output's one rounding (half an
//!   ulp of the result: 2^-9 relative in bf16, 2^-12 in f16);
//! - broadcast sums and differences against candle's values to the bit, on operands that start
//!   inside their storage, and their gradients;
//! - max and average pooling with any window, stride and padding against pools by hand: the
//!   max pool's values and gradients to the bit, the average's within half an ulp of f64.

use candle_amp::{Precision, Tensor, BF16, F16, F32};
use candle_core::{DType, Device, IndexOp, Result};
use proptest::prelude::*;

fn dev() -> Device {
    Device::Cpu
}

/// Deterministic values in [-1, 1) from a seed, already rounded to `P`.
fn values<P: Precision>(dims: &[usize], seed: u32) -> Result<Tensor<P>> {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.618_034 + seed as f32 * 1.7).sin())
        .collect();
    Tensor::<F32>::from_candle(candle_core::Tensor::from_vec(v, dims, &dev())?)?.cast::<P>()
}

/// `|got - want| <= rel * |want| + k * 2^-20 * max|want|` elementwise, in f32.
fn assert_close(got: &candle_core::Tensor, want: &candle_core::Tensor, rel: f32, k: usize) {
    let got = got.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let want = want.flatten_all().unwrap();
    let (g, w) = (
        got.to_vec1::<f32>().unwrap(),
        want.to_vec1::<f32>().unwrap(),
    );
    let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let bound = rel * b.abs() + (k as f32) * 2f32.powi(-20) * scale;
        assert!(
            (a - b).abs() <= bound,
            "element {i}: {a} vs {b} (bound {bound})"
        );
    }
}

/// The relative rounding of one output in `P`: half an ulp.
fn half_ulp<P: Precision>() -> f32 {
    match P::DTYPE {
        DType::BF16 => 2f32.powi(-8),
        DType::F16 => 2f32.powi(-11),
        _ => 0.0,
    }
}

/// `a (m, k) * b (k, n)` in `P` through candle-amp, against candle's f32 matmul, with `b` given
/// as stored (`transpose_b`: stored `(n, k)` and viewed transposed) and `a` a strided row
/// window of a wider tensor (`a_stride_pad` extra columns).
fn matmul_case<P: Precision>(
    (m, n, k): (usize, usize, usize),
    transpose_b: bool,
    a_stride_pad: usize,
) -> Result<()> {
    let wide = values::<P>(&[m, k + a_stride_pad], 1)?;
    let a = wide.narrow(1, a_stride_pad, k)?;
    let b = if transpose_b {
        values::<P>(&[n, k], 2)?.t()?
    } else {
        values::<P>(&[k, n], 2)?
    };
    let got = a.matmul(&b)?;
    let want = a
        .cast::<F32>()?
        .as_candle()
        .contiguous()?
        .matmul(&b.cast::<F32>()?.as_candle().contiguous()?)?;
    assert_close(got.as_candle(), &want, half_ulp::<P>(), k);
    Ok(())
}

/// One convolution's shapes and hyper-parameters.
#[derive(Clone, Copy, Debug)]
struct ConvCase {
    c_in_g: usize,
    c_out_g: usize,
    groups: usize,
    h: usize,
    w: usize,
    kernel: usize,
    padding: usize,
    stride: usize,
    dilation: usize,
    batch: usize,
}

/// Convolutions with channels per group below `channels`, heights below `side` and widths below
/// `side` or 16-33, batches below `batch`, up to 2 groups, kernel 1-3, padding 0-2, stride and
/// dilation 1-2, whose (dilated) window fits the padded image.
fn conv_geometry(channels: usize, side: usize, batch: usize) -> impl Strategy<Value = ConvCase> {
    (
        (1..channels, 1..channels, 1usize..3),
        // Rows of 8 or more output pixels: im2col's row copies; shorter: its gathers.
        (1..side, prop_oneof![1..side, 16usize..34]),
        1usize..4,
        (0usize..3, 1usize..3, 1usize..3),
        1..batch,
    )
        .prop_map(
            |((c_in_g, c_out_g, groups), (h, w), kernel, (padding, stride, dilation), batch)| {
                ConvCase {
                    c_in_g,
                    c_out_g,
                    groups,
                    h,
                    w,
                    kernel,
                    padding,
                    stride,
                    dilation,
                    batch,
                }
            },
        )
        .prop_filter("the window fits the padded image", |c| {
            let span = c.dilation * (c.kernel - 1) + 1;
            c.h + 2 * c.padding >= span && c.w + 2 * c.padding >= span
        })
}

fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(1usize),
        Just(7),
        Just(17),
        Just(33),
        2usize..70,
        Just(1031)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn matmul_matches_f32_in_both_half_types(
        (m, n, k) in (dim(), dim(), dim()).prop_filter("keep it quick", |(m, n, k)| m * n * k <= 1 << 21),
        transpose_b in any::<bool>(),
        pad in 0usize..3,
    ) {
        matmul_case::<BF16>((m, n, k), transpose_b, pad).unwrap();
        matmul_case::<F16>((m, n, k), transpose_b, pad).unwrap();
    }

    #[test]
    fn batched_and_broadcast_matmul_match_f32(
        batch in 1usize..5,
        (m, n, k) in (1usize..40, 1usize..40, 1usize..80),
    ) {
        let a = values::<BF16>(&[batch, m, k], 3).unwrap();
        let b = values::<BF16>(&[k, n], 4).unwrap();
        let got = a.broadcast_matmul(&b).unwrap();
        let want = a.cast::<F32>().unwrap().as_candle()
            .broadcast_matmul(b.cast::<F32>().unwrap().as_candle()).unwrap();
        assert_close(got.as_candle(), &want, half_ulp::<BF16>(), k);
        // One batch item against its own 2-D product.
        let one = a.i(batch - 1).unwrap().matmul(&b).unwrap();
        assert_close(one.as_candle(), &want.i(batch - 1).unwrap(), half_ulp::<BF16>(), k);
    }

    #[test]
    fn conv2d_matches_candles_f32_conv2d(c in conv_geometry(5, 12, 4)) {
        let ConvCase { c_in_g, groups, h, w, kernel, padding, stride, dilation, batch, .. } = c;
        let (c_in, c_out) = (c_in_g * groups, c.c_out_g * groups);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = values::<F32>(&[batch, c_in, h, w], 5).unwrap();
            let k = values::<F32>(&[c_out, c_in_g, kernel, kernel], 6).unwrap();
            let (got, rel) = match dtype {
                DType::BF16 => (x.cast::<BF16>().unwrap().conv2d(&k.cast::<BF16>().unwrap(), padding, stride, dilation, groups).unwrap().cast::<F32>().unwrap(), half_ulp::<BF16>()),
                DType::F16 => (x.cast::<F16>().unwrap().conv2d(&k.cast::<F16>().unwrap(), padding, stride, dilation, groups).unwrap().cast::<F32>().unwrap(), half_ulp::<F16>()),
                _ => (x.conv2d(&k, padding, stride, dilation, groups).unwrap(), 0.0),
            };
            // The reference on the same rounded values.
            let round = |t: &Tensor<F32>| t.as_candle().to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
            let want = round(&x).conv2d(&round(&k), padding, stride, dilation, groups).unwrap();
            assert_close(got.as_candle(), &want, rel, c_in_g * kernel * kernel);
        }
    }

    /// Both gradients of the GEMM convolution, f32 and bf16, grouped, strided, padded and
    /// dilated, against a computation by hand in f64 on the same rounded values (candle's own
    /// backward fails on shapes a stride does not tile, such as 3x2 at stride 2).
    #[test]
    fn conv2d_gradients_match_a_computation_by_hand(c in conv_geometry(4, 10, 3)) {
        let ConvCase { c_in_g, c_out_g, groups, h, w, kernel, padding, stride, dilation, batch } = c;
        let (c_in, c_out) = (c_in_g * groups, c_out_g * groups);
        let geometry = (padding, stride, dilation, groups);
        for dtype in [DType::F32, DType::BF16] {
            let var = |dims: &[usize], seed| candle_core::Var::from_tensor(&values::<F32>(dims, seed).unwrap().as_candle().to_dtype(dtype).unwrap()).unwrap();
            let (x, k) = (var(&[batch, c_in, h, w], 12), var(&[c_out, c_in_g, kernel, kernel], 13));
            let y = match dtype {
                DType::BF16 => Tensor::<BF16>::from_candle(x.as_tensor().clone()).unwrap().conv2d(&Tensor::<BF16>::from_candle(k.as_tensor().clone()).unwrap(), padding, stride, dilation, groups).unwrap().into_candle(),
                _ => Tensor::<F32>::from_candle(x.as_tensor().clone()).unwrap().conv2d(&Tensor::<F32>::from_candle(k.as_tensor().clone()).unwrap(), padding, stride, dilation, groups).unwrap().into_candle(),
            };
            let r = values::<F32>(y.dims(), 14).unwrap().as_candle().to_dtype(dtype).unwrap();
            let grads = (&y * &r).unwrap().to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
            let (want_x, want_k) = conv2d_grads_by_hand(x.as_tensor(), k.as_tensor(), &r, geometry).unwrap();
            let rel = if dtype == DType::BF16 { half_ulp::<BF16>() } else { 0.0 };
            let (oh, ow) = (y.dim(2).unwrap(), y.dim(3).unwrap());
            assert_close(grads.get(x.as_tensor()).unwrap(), &want_x, rel, c_out_g * kernel * kernel);
            assert_close(grads.get(k.as_tensor()).unwrap(), &want_k, rel, batch * oh * ow);
        }
    }
}

/// The gradients of `sum(r * conv2d(x, k))` by hand, in f64: `(d/dx, d/dk)`, each output's
/// weight `r` sent back along every product that formed it.
fn conv2d_grads_by_hand(
    x: &candle_core::Tensor,
    k: &candle_core::Tensor,
    r: &candle_core::Tensor,
    (padding, stride, dilation, groups): (usize, usize, usize, usize),
) -> Result<(candle_core::Tensor, candle_core::Tensor)> {
    let flat = |t: &candle_core::Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
    let (xv, kv, rv) = (flat(x)?, flat(k)?, flat(r)?);
    let (&[batch, c_in, h, w], &[c_out, c_in_g, kh, kw], &[_, _, oh, ow]) =
        (x.dims(), k.dims(), r.dims())
    else {
        candle_core::bail!("conv2d_grads_by_hand: 4-D tensors")
    };
    let (mut gx, mut gk) = (vec![0f64; xv.len()], vec![0f64; kv.len()]);
    let c_out_g = c_out / groups;
    for (b, co, oy, ox) in indices4(batch, c_out, oh, ow) {
        let weight = rv[((b * c_out + co) * oh + oy) * ow + ox];
        let g = co / c_out_g;
        for (ci, ky, kx) in (0..c_in_g)
            .flat_map(|ci| (0..kh).flat_map(move |ky| (0..kw).map(move |kx| (ci, ky, kx))))
        {
            let y = (oy * stride + ky * dilation) as isize - padding as isize;
            let xx = (ox * stride + kx * dilation) as isize - padding as isize;
            if y < 0 || xx < 0 || y >= h as isize || xx >= w as isize {
                continue;
            }
            let xi = ((b * c_in + g * c_in_g + ci) * h + y as usize) * w + xx as usize;
            let ki = ((co * c_in_g + ci) * kh + ky) * kw + kx;
            gx[xi] += weight * kv[ki];
            gk[ki] += weight * xv[xi];
        }
    }
    let to = |v: Vec<f64>, like: &candle_core::Tensor| {
        candle_core::Tensor::from_vec(v, like.shape(), &dev())?.to_dtype(DType::F32)
    };
    Ok((to(gx, x)?, to(gk, k)?))
}

/// Every `(a, b, c, d)` below the bounds, in row-major order.
fn indices4(
    a: usize,
    b: usize,
    c: usize,
    d: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    (0..a).flat_map(move |i| {
        (0..b).flat_map(move |j| (0..c).flat_map(move |k| (0..d).map(move |l| (i, j, k, l))))
    })
}

/// A shape of rank 1 to 4 for a broadcast sum, and the other operand's: each dimension kept or
/// made 1, and some leading ones dropped.
fn broadcast_shapes() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    prop::collection::vec(prop_oneof![1usize..6, Just(17)], 1..5).prop_flat_map(|out| {
        let rank = out.len();
        (
            Just(out),
            prop::collection::vec(any::<bool>(), rank),
            0..rank,
        )
            .prop_map(|(out, keep, drop)| {
                let other = out
                    .iter()
                    .zip(&keep)
                    .map(|(&d, &k)| if k { d } else { 1 })
                    .skip(drop)
                    .collect();
                (out, other)
            })
    })
}

/// `values` in `dtype` of `dims`, the rows `offset..` of a taller tensor: contiguous, but
/// starting inside its storage (a narrowed view, as a split of a fused projection gives).
fn offset_values(
    dims: &[usize],
    offset: usize,
    seed: u32,
    dtype: DType,
) -> Result<candle_core::Tensor> {
    let mut tall = dims.to_vec();
    tall[0] += offset;
    values::<F32>(&tall, seed)?
        .as_candle()
        .to_dtype(dtype)?
        .narrow(0, offset, dims[0])
}

/// Values of `n` in [-2, 2] on a grid of quarters: many ties in a max-pool window.
fn coarse(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 0.618_034 + seed as f32 * 1.7).sin() * 8.0).round() / 4.0)
        .collect()
}

/// The in-bounds positions of each window of a `(h, w)` plane (row-major offsets, in
/// row-major order), output by output: the -inf or zero padding is left out.
fn windows_by_hand(
    (h, w): (usize, usize),
    (kernel, stride, padding): (usize, usize, usize),
) -> Vec<Vec<usize>> {
    let out = |n: usize| (n + 2 * padding - kernel) / stride + 1;
    let inside = |o: usize, k: usize, n: usize| {
        let at = (o * stride + k) as isize - padding as isize;
        (0..n as isize).contains(&at).then_some(at as usize)
    };
    let mut windows = Vec::new();
    for oy in 0..out(h) {
        for ox in 0..out(w) {
            let window = (0..kernel)
                .filter_map(|ky| inside(oy, ky, h))
                .flat_map(|y| {
                    (0..kernel)
                        .filter_map(move |kx| inside(ox, kx, w))
                        .map(move |x| y * w + x)
                })
                .collect();
            windows.push(window);
        }
    }
    windows
}

/// A pool layer run on a candle tensor of any float dtype, through the typed API.
enum Pool {
    Max(candle_amp::nn::MaxPool2d),
    Avg(candle_amp::nn::AvgPool2d),
}

impl Pool {
    fn forward(&self, x: &candle_core::Tensor) -> candle_core::Tensor {
        macro_rules! run {
            ($p:ty) => {{
                let x = Tensor::<$p>::from_candle(x.clone()).unwrap();
                match self {
                    Self::Max(pool) => pool.forward(&x),
                    Self::Avg(pool) => pool.forward(&x),
                }
                .unwrap()
                .into_candle()
            }};
        }
        match x.dtype() {
            DType::BF16 => run!(BF16),
            DType::F16 => run!(F16),
            _ => run!(F32),
        }
    }
}

/// A pool's window geometry for the property tests: kernel 1-4, stride 1-3, padding up to half
/// the window (PyTorch's limit), planes at least as large as the padded window needs.
fn pool_geometry() -> impl Strategy<Value = (usize, usize, usize, usize, usize, usize)> {
    (1usize..4, 1usize..4, 1usize..5)
        .prop_flat_map(|(planes, stride, k)| (Just(planes), Just(stride), Just(k), 0..=k / 2))
        .prop_flat_map(|(planes, stride, k, p)| {
            let least = k.saturating_sub(2 * p).max(1);
            (
                Just(planes),
                Just(stride),
                Just(k),
                Just(p),
                least..13,
                least..13,
            )
        })
}

/// `pool` of `xs` (`planes` planes of `(h, w)`) in `dtype`: the output as f32, and the gradient
/// of `sum(r * pool(x))` for the weights `r` = [`coarse`] values, with those weights.
fn pool_and_grad(
    pool: &Pool,
    xs: &[f32],
    (planes, h, w): (usize, usize, usize),
    dtype: DType,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let flat = |t: &candle_core::Tensor| {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let x = candle_core::Tensor::from_vec(xs.to_vec(), (1, planes, h, w), &dev()).unwrap();
    let x = candle_core::Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
    let y = pool.forward(x.as_tensor());
    let r = coarse(y.elem_count(), 11);
    let rt = candle_core::Tensor::from_vec(r.clone(), y.shape(), &dev())
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let grads = (&y * &rt)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    (flat(&y), flat(grads.get(x.as_tensor()).unwrap()), r)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// `+` and `-` with broadcasting, on operands that start inside their storage, give candle's
    /// values to the bit in every float dtype; the gradients of tracked operands are the
    /// incoming gradient and its sum over the broadcast dimensions (against an f64 sum).
    #[test]
    fn broadcast_sums_match_candle_and_sum_their_gradients(
        (out, other) in broadcast_shapes(),
        (offset_a, offset_b) in (0usize..3, 0usize..3),
        swap in any::<bool>(),
    ) {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let a = offset_values(&out, offset_a, 7, dtype).unwrap();
            let b = offset_values(&other, offset_b, 8, dtype).unwrap();
            let (a, b) = if swap { (b, a) } else { (a, b) };
            macro_rules! check {
                ($p:ty) => {{
                    let (ta, tb) = (Tensor::<$p>::from_candle(a.clone()).unwrap(), Tensor::<$p>::from_candle(b.clone()).unwrap());
                    for (got, want) in [
                        (ta.broadcast_add(&tb).unwrap(), a.broadcast_add(&b).unwrap()),
                        (ta.broadcast_sub(&tb).unwrap(), a.broadcast_sub(&b).unwrap()),
                    ] {
                        let bits = |t: &candle_core::Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                        prop_assert_eq!(got.dims(), want.dims());
                        prop_assert_eq!(bits(got.as_candle()), bits(&want), "{:?}", dtype);
                    }
                }};
            }
            match dtype {
                DType::BF16 => check!(BF16),
                DType::F16 => check!(F16),
                _ => check!(F32),
            }
        }
        // Gradients, in bf16: `sum(r * (a - b))` gives `a` the weights `r` and `b` minus their
        // sums over where it was broadcast.
        let va = candle_core::Var::from_tensor(&offset_values(&out, 0, 7, DType::BF16).unwrap()).unwrap();
        let vb = candle_core::Var::from_tensor(&offset_values(&other, 0, 8, DType::BF16).unwrap()).unwrap();
        let (ta, tb) = (Tensor::<BF16>::from_candle(va.as_tensor().clone()).unwrap(), Tensor::<BF16>::from_candle(vb.as_tensor().clone()).unwrap());
        let r = offset_values(&out, 0, 9, DType::BF16).unwrap();
        let y = ta.broadcast_sub(&tb).unwrap();
        let grads = (y.as_candle() * &r).unwrap().to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
        let ga = grads.get(va.as_tensor()).unwrap();
        prop_assert_eq!(ga.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), r.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
        // -r summed over the broadcast dimensions, in f64.
        let lead = out.len() - other.len();
        let mut want = r.to_dtype(DType::F64).unwrap();
        for d in (0..out.len()).rev() {
            if d < lead {
                want = want.sum(d).unwrap();
            } else if other[d - lead] == 1 {
                want = want.sum_keepdim(d).unwrap();
            }
        }
        let want = want.neg().unwrap().to_dtype(DType::F32).unwrap();
        let summed = out.iter().product::<usize>() / other.iter().product::<usize>();
        let gb = grads.get(vb.as_tensor()).unwrap();
        prop_assert_eq!(gb.dims(), &other[..]);
        assert_close(gb, &want, half_ulp::<BF16>(), summed);
    }

    /// Max pooling with any window, stride and padding, in every float dtype, against a pool
    /// by hand: each output the first maximum of its window to the bit, and the gradient of
    /// `sum(r * pool(x))` each `r` added onto its output's maximum (overlapping windows add up).
    #[test]
    fn max_pool_matches_a_pool_by_hand((planes, stride, kernel, padding, h, w) in pool_geometry()) {
        let pool = Pool::Max(candle_amp::nn::MaxPool2d::with_stride(kernel, stride).with_padding(padding));
        let xs = coarse(planes * h * w, 10);
        let windows = windows_by_hand((h, w), (kernel, stride, padding));
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let (got, grad, r) = pool_and_grad(&pool, &xs, (planes, h, w), dtype);
            prop_assert_eq!(got.len(), planes * windows.len());
            let mut want_grad = vec![0f32; planes * h * w];
            for (o, (window, r)) in windows.iter().cycle().zip(&r).enumerate() {
                let plane = &xs[o / windows.len() * h * w..][..h * w];
                // The first maximum: ties keep the earlier position.
                let at = window.iter().copied().reduce(|a, b| if plane[b] > plane[a] { b } else { a }).unwrap();
                prop_assert_eq!(got[o].to_bits(), plane[at].to_bits(), "{:?} output {}", dtype, o);
                want_grad[o / windows.len() * h * w + at] += r;
            }
            // Quarters summed over at most a few windows are exact in every dtype.
            prop_assert_eq!(grad, want_grad, "{:?}", dtype);
        }
    }

    /// Average pooling with any window, stride and zero padding (counted in the area, PyTorch's
    /// default), in every float dtype, against a pool by hand in f64: each output the window's
    /// mean rounded once (to within half an ulp), and the gradient of `sum(r * pool(x))` each
    /// `r / area` added onto every position of its window.
    #[test]
    fn avg_pool_matches_a_pool_by_hand((planes, stride, kernel, padding, h, w) in pool_geometry()) {
        let pool = Pool::Avg(candle_amp::nn::AvgPool2d::with_stride(kernel, stride).with_padding(padding));
        let xs = coarse(planes * h * w, 10);
        let windows = windows_by_hand((h, w), (kernel, stride, padding));
        let area = (kernel * kernel) as f64;
        for (dtype, rel) in [(DType::F32, 2f64.powi(-23)), (DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
            let (got, grad, r) = pool_and_grad(&pool, &xs, (planes, h, w), dtype);
            prop_assert_eq!(got.len(), planes * windows.len());
            let mut want_grad = vec![0f64; planes * h * w];
            for (o, (window, r)) in windows.iter().cycle().zip(&r).enumerate() {
                let base = o / windows.len() * h * w;
                let mean = window.iter().map(|&at| f64::from(xs[base + at])).sum::<f64>() / area;
                prop_assert!((f64::from(got[o]) - mean).abs() <= rel * mean.abs(), "{:?} output {}: {} vs {}", dtype, o, got[o], mean);
                for &at in window {
                    want_grad[base + at] += f64::from(*r) / area;
                }
            }
            for (i, (g, want)) in grad.iter().zip(&want_grad).enumerate() {
                prop_assert!((f64::from(*g) - want).abs() <= rel * want.abs() + 1e-7, "{:?} gradient {}: {} vs {}", dtype, i, g, want);
            }
        }
    }
}
