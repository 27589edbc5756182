//! Scaled dot-product attention as one op with its own backward: PyTorch's
//! `scaled_dot_product_attention` over `(batch, heads, length, head_dim)` tensors.
//!
//! Written out of candle ops, attention is a dozen graph nodes per layer (the scores' product,
//! the scale, the mask's add, five for the softmax, the casts around it, the second product),
//! each a full `(b, h, t_q, t_k)` buffer in the forward and a zero tensor plus an add in
//! candle's backward. On CPU it is one node ([`fused`]): per head and block of query rows, the
//! block's scores against every visible key (half operands, f32 accumulation; bf16 on keys and
//! values packed once per head, [`products`]), the scale, the mask and the softmax in f32, the
//! probabilities rounded to the operands' dtype for the second product (as autocast casts the
//! softmax's output for the `matmul` after it), the output rounded once; the backward
//! recomputes the block's probabilities. On CUDA it is one node too (`cuda.rs`, feature
//! `cuda`): two cuBLAS products with the scale, masks and softmax between them in one kernel, the backward recomputing the scores. Elsewhere,
//! and on CUDA with dropout, the same semantics run as candle ops ([`composed`]), which the
//! tests also use as the composed reference. [`packed_attention`] is the same op over a packed
//! `(b, t, 3, h, d)` projection, reading it in place and writing `(b, t, h, d)`.
//!
//! Semantics, beside PyTorch's:
//! - `mask` broadcasts to `(b, h, t_q, t_k)`: a float mask is added to the scores (in f32), a
//!   `u8` mask is PyTorch's boolean mask, nonzero where a query may attend a key. It receives
//!   no gradient.
//! - `causal` hides key `j` from query `i` when `j > i + t_k - t_q`: the causal mask aligned to
//!   the bottom right corner, flash attention's convention since 2.1. With `t_q == t_k` it is
//!   PyTorch's `is_causal`; with a KV cache (`t_q < t_k`) it is what decoding needs, where
//!   PyTorch's top-left alignment would hide the cached keys from the new queries.
//! - Fewer key/value heads than query heads (grouped-query attention, PyTorch's `enable_gqa`):
//!   query head `i` reads key/value head `i / (h / h_kv)`.
//! - A query row that can see no key at all (every score `-inf`) has output 0 and sends no
//!   gradient anywhere (PyTorch's math kernel gives NaN there, its fused kernels 0). A NaN
//!   score still makes its row NaN, so the gradient scaler sees it.
//! - `dropout` drops each probability with that chance and scales the kept ones by
//!   `1 / (1 - p)` (in f32, before the probabilities are rounded), as PyTorch's `dropout_p`.
//!   Which are kept follows from one seed per call (SplitMix64 of the element's index), so the
//!   backward regenerates the forward's choice instead of storing it.

mod composed;
#[cfg(feature = "cuda")]
mod cuda;
mod fused;
mod products;
#[cfg(test)]
mod tests;

pub(crate) use composed::composed;

use candle_core::{DType, Device, Result, Tensor};

/// The options of `ops::scaled_dot_product_attention_with`: PyTorch's keyword arguments of
/// `scaled_dot_product_attention` (`attn_mask`, `scale`, `is_causal`, `dropout_p`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Attention<'a> {
    /// Added to the scores (float) or PyTorch's boolean mask (`u8`, nonzero = attend).
    pub mask: Option<&'a Tensor>,
    /// The scores' factor; `1 / sqrt(head_dim)` when `None`.
    pub scale: Option<f64>,
    /// The causal mask, aligned to the bottom right.
    pub causal: bool,
    /// The chance of dropping each probability, in [0, 1): pass 0 outside training, as
    /// PyTorch users pass `dropout_p=p if self.training else 0.0`. The kept ones are scaled by
    /// `1 / (1 - p)` in f32.
    pub dropout: f32,
}

/// `softmax(q k^T * scale + mask) v` over `(b, h, t_q, d)` queries and `(b, h_kv, t_k, d)` /
/// `(b, h_kv, t_k, d_v)` keys and values of one float dtype, as `options` say (see the module's
/// documentation). Differentiable in `q`, `k` and `v`. One op on CPU, candle ops elsewhere.
pub(crate) fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: &Attention,
) -> Result<Tensor> {
    let seed = if options.dropout > 0.0 {
        draw_seed()?
    } else {
        0
    };
    seeded(q, k, v, options, seed)
}

/// [`scaled_dot_product_attention`] with the dropout's seed given.
fn seeded(q: &Tensor, k: &Tensor, v: &Tensor, options: &Attention, seed: u64) -> Result<Tensor> {
    let g = Geometry::check(q, k, v)?;
    let (scale, dropout) = resolve(options, g, seed)?;
    // A learned mask runs the composed math, whose sum gives it its gradient.
    let learned = learned_mask(options);
    if !learned && crate::kernels::elem::cpu_float(q) {
        return q.apply_op3(k, v, fused::Fused::new(options, g, scale, dropout, false)?);
    }
    if !learned && on_cuda(q, dropout) {
        #[cfg(feature = "cuda")]
        return cuda::attention(q, k, v, (options.mask, scale, options.causal), g);
    }
    let keep = match dropout {
        Some(d) => Some((d.mask(g, q.device())?, d.p)),
        None => None,
    };
    composed(
        q,
        k,
        v,
        (options.mask, scale, options.causal),
        keep.as_ref().map(|(m, p)| (m, *p)),
    )
}

/// Attention over a packed `(b, t, 3, heads, d)` projection (query, key and value at index 0,
/// 1 and 2 of dimension 2: flash attention's `qkvpacked` layout), self-attention with every
/// option of [`scaled_dot_product_attention`]; the output is `(b, t, heads, d)`, the layout the
/// output projection reads. On CPU one op reading `qkv` in place and writing the output's rows
/// where they go, its gradient one `(b, t, 3, heads, d)` tensor: none of the split's and
/// merge's views and copies are graph nodes.
pub(crate) fn packed_attention(qkv: &Tensor, options: &Attention) -> Result<Tensor> {
    let name = "scaled_dot_product_attention_packed";
    let (b, t, three, h, d) = qkv.dims5().map_err(|_| {
        candle_core::Error::Msg(format!(
            "{name}: qkv must be (batch, length, 3, heads, head_dim), got {:?}",
            qkv.dims()
        ))
    })?;
    if three != 3 {
        candle_core::bail!(
            "{name}: qkv must be (batch, length, 3, heads, head_dim), the query, key and value \
             side by side in its dimension 2, got {:?} (dimension 2 is {three})",
            qkv.dims()
        );
    }
    if !qkv.dtype().is_float() {
        candle_core::bail!(
            "{name}: qkv must be a float (batch, length, 3, heads, head_dim) tensor, got {:?}",
            qkv.dtype()
        );
    }
    let seed = if options.dropout > 0.0 {
        draw_seed()?
    } else {
        0
    };
    let g = Geometry {
        b,
        h,
        hk: h,
        tq: t,
        tk: t,
        d,
        dv: d,
    };
    let (scale, dropout) = resolve(options, g, seed)?;
    let learned = learned_mask(options);
    if on_cuda(qkv, dropout) && !learned {
        #[cfg(feature = "cuda")]
        return cuda::packed(qkv, (options.mask, scale, options.causal), g);
    }
    if !crate::kernels::elem::cpu_float(qkv) || learned {
        let part = |i: usize| qkv.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2);
        return seeded(&part(0)?, &part(1)?, &part(2)?, options, seed)?.transpose(1, 2);
    }
    qkv.apply_op1(fused::Packed(fused::Fused::new(
        options, g, scale, dropout, true,
    )?))
}

/// Whether the mask is a float one that takes a gradient (a learned position bias: T5's, Swin's,
/// ALiBi's when trained): the ops, CPU and CUDA, give the mask none, so such a mask runs the
/// composed math, whose sum gives it one, as PyTorch's. It took none without a word.
fn learned_mask(options: &Attention) -> bool {
    options
        .mask
        .is_some_and(|m| m.dtype().is_float() && m.track_op())
}

/// Whether the CUDA op runs: CUDA operands of f32, f16 or bf16, without dropout (which runs
/// composed, drawing its keep mask on the host).
fn on_cuda(x: &Tensor, dropout: Option<Dropout>) -> bool {
    cfg!(feature = "cuda")
        && x.device().is_cuda()
        && dropout.is_none()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
}

/// The scale (given or `1 / sqrt(head_dim)`) and dropout of one call, each checked, and the
/// mask checked against the geometry.
fn resolve(options: &Attention, g: Geometry, seed: u64) -> Result<(f64, Option<Dropout>)> {
    let scale = match options.scale {
        // Applied in f32: 1e300 is finite as an f64 and infinite there.
        Some(s) if !crate::kernels::elem::finite_in_f32(s) => {
            candle_core::bail!("scaled_dot_product_attention: the scale must be finite, got {s}")
        }
        Some(s) => s,
        #[allow(clippy::cast_precision_loss)] // head sizes are far inside f64's exact range
        None if g.d > 0 => 1.0 / (g.d as f64).sqrt(),
        None => 1.0,
    };
    let p = options.dropout;
    if !(0.0..1.0).contains(&p) {
        candle_core::bail!(
            "scaled_dot_product_attention: the dropout probability must be in [0, 1), got {p}"
        );
    }
    if let Some(mask) = options.mask {
        check_mask(mask, g)?;
    }
    Ok((scale, (p > 0.0).then_some(Dropout { p, seed })))
}

/// A seed for one call's dropout, from candle's random source (which the other dropouts use).
fn draw_seed() -> Result<u64> {
    let halves = Tensor::rand(0f32, 1f32, 2, &Device::Cpu)?.to_vec1::<f32>()?;
    Ok(u64::from(halves[0].to_bits()) << 32 | u64::from(halves[1].to_bits()))
}

/// The shapes of one attention call.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    b: usize,
    h: usize,
    /// Key/value heads; divides `h`.
    hk: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
}

impl Geometry {
    /// The geometry of `q`, `k`, `v`, or an error naming what does not fit.
    fn check(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Self> {
        let name = "scaled_dot_product_attention";
        for (t, what) in [(q, "query"), (k, "key"), (v, "value")] {
            if t.rank() != 4 {
                candle_core::bail!(
                    "{name}: the {what} must be (batch, heads, length, head_dim), got shape {:?}",
                    t.dims()
                );
            }
            if !t.dtype().is_float() || t.dtype() != q.dtype() {
                candle_core::bail!(
                    "{name}: query, key and value must be of one float dtype, got {:?}, {:?} \
                     and {:?}",
                    q.dtype(),
                    k.dtype(),
                    v.dtype()
                );
            }
            if !t.device().same_device(q.device()) {
                candle_core::bail!("{name}: query, key and value must be on one device");
            }
        }
        let (b, h, tq, d) = q.dims4()?;
        let (bk, hk, tk, dk) = k.dims4()?;
        let (bv, hv, tv, dv) = v.dims4()?;
        if bk != b || bv != b {
            candle_core::bail!("{name}: batch sizes differ: query {b}, key {bk}, value {bv}");
        }
        if dk != d {
            candle_core::bail!("{name}: the key's head_dim {dk} differs from the query's {d}");
        }
        if (hv, tv) != (hk, tk) {
            candle_core::bail!(
                "{name}: key and value differ in heads or length: key {:?}, value {:?}",
                k.dims(),
                v.dims()
            );
        }
        if hk == 0 {
            candle_core::bail!(
                "{name}: the key and value have no head (dimension 1 of {:?} is 0)",
                k.dims()
            );
        }
        if h % hk != 0 {
            candle_core::bail!(
                "{name}: the query's {h} heads are not a multiple of the key's and value's {hk}"
            );
        }
        Ok(Self {
            b,
            h,
            hk,
            tq,
            tk,
            d,
            dv,
        })
    }

    /// How many query heads share one key/value head.
    fn group(&self) -> usize {
        self.h / self.hk
    }

    /// The shape the mask broadcasts to.
    fn scores(&self) -> (usize, usize, usize, usize) {
        (self.b, self.h, self.tq, self.tk)
    }
}

/// A mask must be a float (additive) or `u8` (boolean) tensor broadcasting to the scores.
fn check_mask(mask: &Tensor, g: Geometry) -> Result<()> {
    let name = "scaled_dot_product_attention";
    if !(mask.dtype().is_float() || mask.dtype() == DType::U8) {
        candle_core::bail!(
            "{name}: the mask must be a float tensor (added to the scores) or a u8 tensor \
             (nonzero where a query may attend a key), got {:?}",
            mask.dtype()
        );
    }
    if mask.rank() > 4 || mask.broadcast_as(g.scores()).is_err() {
        candle_core::bail!(
            "{name}: a mask of shape {:?} does not broadcast to the scores' {:?}",
            mask.dims(),
            g.scores()
        );
    }
    Ok(())
}

/// A mask's values as f32 additions to the scores (a `u8` mask as 0 or `-inf`), with the
/// strides that broadcast them to `(b, h, t_q, t_k)` (0 along broadcast dimensions).
#[derive(Clone, Debug)]
struct Mask {
    values: Vec<f32>,
    strides: [usize; 4],
}

impl Mask {
    fn new(mask: &Tensor, g: Geometry) -> Result<Self> {
        let values: Vec<f32> = if mask.dtype() == DType::U8 {
            let keep = mask.flatten_all()?.to_vec1::<u8>()?;
            keep.into_iter()
                .map(|k| if k == 0 { f32::NEG_INFINITY } else { 0.0 })
                .collect()
        } else {
            mask.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?
        };
        Ok(Self {
            values,
            strides: Self::strides(mask.dims(), g),
        })
    }

    /// The strides that broadcast a contiguous mask of `dims` (a checked mask's) to
    /// `(b, h, t_q, t_k)`: 0 along broadcast dimensions.
    fn strides(dims: &[usize], g: Geometry) -> [usize; 4] {
        let mut padded = [1usize; 4];
        padded[4 - dims.len()..].copy_from_slice(dims);
        let target = [g.b, g.h, g.tq, g.tk];
        let mut strides = [0usize; 4];
        let mut step = 1;
        for i in (0..4).rev() {
            strides[i] = if padded[i] == 1 && target[i] != 1 {
                0
            } else {
                step
            };
            step *= padded[i];
        }
        strides
    }

    /// The mask's value for key `j` of row `(b, h, i)` is `values[start + j * step]`.
    fn row(&self, b: usize, h: usize, i: usize) -> (usize, usize) {
        let s = self.strides;
        (b * s[0] + h * s[1] + i * s[2], s[3])
    }
}

/// Dropout on the probabilities: which are kept, by element, from one seed.
#[derive(Clone, Copy, Debug)]
struct Dropout {
    p: f32,
    seed: u64,
}

impl Dropout {
    /// Whether the probability of key `j` for query `i` of head `(b, h)` is kept: the
    /// element's SplitMix64 draw, as a 24-bit uniform in [0, 1), at least `p` (as candle-nn's
    /// `dropout` keeps a uniform draw at least `p`).
    fn keeps(self, g: Geometry, (b, h, i, j): (usize, usize, usize, usize)) -> bool {
        let index = (((b * g.h + h) * g.tq + i) * g.tk + j) as u64;
        let mut z = self
            .seed
            .wrapping_add(index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        #[allow(clippy::cast_precision_loss)] // 24 bits: exact in f32
        let uniform = (z >> 40) as f32 / (1u64 << 24) as f32;
        uniform >= self.p
    }

    /// The kept probabilities' factor, `1 / (1 - p)` in f32.
    fn scale(self) -> f32 {
        (1.0 / (1.0 - f64::from(self.p))) as f32
    }

    /// The keep mask as a `(b, h, t_q, t_k)` `u8` tensor on `device` (the composed path).
    fn mask(self, g: Geometry, device: &Device) -> Result<Tensor> {
        let mut keep = Vec::with_capacity(g.b * g.h * g.tq * g.tk);
        for b in 0..g.b {
            for h in 0..g.h {
                for i in 0..g.tq {
                    keep.extend((0..g.tk).map(|j| u8::from(self.keeps(g, (b, h, i, j)))));
                }
            }
        }
        Tensor::from_vec(keep, (g.b, g.h, g.tq, g.tk), device)
    }
}
