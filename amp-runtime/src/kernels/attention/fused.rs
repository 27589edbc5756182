//! The attention op on CPU: one node over `(q, k, v)`, its own backward.
//!
//! Per head and per block of [`BLOCK`] query rows the forward computes the block's scores
//! against every visible key, scales them and adds the mask in f32, takes
//! the softmax in f32 (dropout after it), rounds the probabilities to the operands' dtype for
//! the second product and writes the block's output rounded once. Only one block of scores
//! exists at a time per task: memory grows with `BLOCK * t_k`, not `t_q * t_k` (the resident
//! products add a packed copy of the keys and values, their own size, while the forward runs).
//!
//! The backward recomputes each block's probabilities (the forward keeps nothing but its
//! operands, as flash attention keeps nothing of the scores), then, with `Z` the dropout's
//! factors (1 without dropout), `dV += (P Z)^T dO`, `dP = (dO V^T) Z`, `dS = P * (dP -
//! rowsum(P * dP)) * scale` in f32, `dQ = dS K` and `dK += dS^T Q`, the products again in the
//! operands' dtype with f32 accumulation. Every product runs on the packed GEMM, or for bf16 on
//! a CPU whose bf16 GEMM is `vdpbf16ps` on the key/value head's operands packed once for all
//! its blocks, the same bits ([`super::products`]). One task owns one key/value head of one
//! batch entry (and the query heads that share it), so `dK` and `dV` are summed in f32 without
//! any reduction across tasks.

use std::mem::MaybeUninit;
use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::products::{resident, Gemm, Head, Panels, Pass, Products, Resident};
use super::{Attention, Dropout, Geometry, Mask};
use crate::kernels::elem::Real;
use crate::kernels::gemm::{Bf16Products, GemmElem, MatRef};
use crate::kernels::leaf_grads::offer;
use crate::kernels::parallel::{self, Disjoint};
use crate::kernels::widen::lane_sums2;

/// Query rows per block: the unit of work of a forward task and of the backward's loop. With
/// the causal mask a block computes only the keys its last row sees, so smaller blocks skip
/// more; on the packed GEMM each block packs its keys again, so smaller blocks pack more. 32 was
/// faster than 64 and 16 for the GPT example's heads (`(16, 4, 64, 64)`: 2.28 ms fwd+bwd
/// against 2.55 and 2.88) and than 64 at `(4, 4, 256, 64)`, causal, bf16, on a 2-core EPYC.
const BLOCK: usize = 32;

/// Scaled dot-product attention on CPU: the forward op over `(q, k, v)`.
#[derive(Clone, Debug)]
pub(super) struct Fused {
    mask: Option<Mask>,
    scale: f32,
    causal: bool,
    dropout: Option<Dropout>,
    g: Geometry,
    /// The output is `(b, t_q, h, d_v)` (the packed entry's) rather than `(b, h, t_q, d_v)`.
    tokens_major: bool,
    /// Each query row's softmax maximum and sum, `(b, h, t_q)`, kept by the forward so that
    /// the backward recomputes the probabilities in one pass, `exp(s - max) / sum`, the
    /// forward's values to the bit, rather than a softmax's four. (Flash attention keeps the
    /// log-sum-exp, `max + ln(sum)`; in f32 it rounds to the maximum where the maximum is
    /// large, as under a mask of -1e9, and `exp(s - lse)` then gives 1 for every key.)
    stats: Arc<OnceLock<Vec<RowStats>>>,
    /// Every product on the packed GEMM, never the resident products (tests only).
    gemm_only: bool,
}

/// A row's softmax maximum and sum (see [`softmax_in_place`]).
#[derive(Clone, Copy, Debug)]
struct RowStats {
    max: f32,
    sum: f32,
}

/// A rank-4 operand as the kernels read it: its elements, start offset and strides.
#[derive(Clone, Copy)]
pub(super) struct Operand<'a, T> {
    data: &'a [T],
    start: usize,
    pub stride: [usize; 4],
}

impl<'a, T> Operand<'a, T> {
    /// The query, key and value of a packed `(b, t, 3, h, d)` layout (parts 0, 1 and 2 of
    /// dimension 2), each read as `(b, h, t, d)`.
    fn parts(data: &'a [T], l: &Layout) -> (Self, Self, Self) {
        let st = l.stride();
        let part = |i: usize| Self {
            data,
            start: l.start_offset() + i * st[2],
            stride: [st[0], st[3], st[1], st[4]],
        };
        (part(0), part(1), part(2))
    }

    /// A `(b, t, h, d)` layout (the packed entry's output and its gradient), read as
    /// `(b, h, t, d)`.
    fn tokens_major(data: &'a [T], l: &Layout) -> Result<Self> {
        let mut o = Self::new(data, l)?;
        o.stride.swap(1, 2);
        Ok(o)
    }

    fn new(data: &'a [T], l: &Layout) -> Result<Self> {
        let stride: [usize; 4] = l.stride().try_into().map_err(|_| {
            candle_core::Error::Msg(format!(
                "scaled_dot_product_attention kernel: expected a rank-4 operand, got {:?}",
                l.dims()
            ))
        })?;
        Ok(Self {
            data,
            start: l.start_offset(),
            stride,
        })
    }

    /// Rows `from..` of head `(b, h)` as a `(rows, cols)` matrix.
    pub fn rows(&self, b: usize, h: usize, from: usize) -> MatRef<'a, T> {
        let s = self.stride;
        MatRef {
            data: self.data,
            offset: self.start + b * s[0] + h * s[1] + from * s[2],
            rs: s[2],
            cs: s[3],
        }
    }

    /// Head `(b, h)` transposed, `(cols, rows)`.
    pub fn transposed(&self, b: usize, h: usize) -> MatRef<'a, T> {
        let s = self.stride;
        MatRef {
            data: self.data,
            offset: self.start + b * s[0] + h * s[1],
            rs: s[3],
            cs: s[2],
        }
    }
}

/// `values` rounded to `T` into `dst`.
fn write_rounded<T: Real>(values: &[f32], dst: &mut [MaybeUninit<T>]) {
    for (d, &v) in dst.iter_mut().zip(values) {
        d.write(T::put(v));
    }
}

impl Fused {
    /// The op for one call: `options`' mask read as f32 additions for `g`, the scale and
    /// dropout already checked ([`super::resolve`]); `tokens_major` for the packed entry.
    pub(super) fn new(
        options: &Attention,
        g: Geometry,
        scale: f64,
        dropout: Option<Dropout>,
        tokens_major: bool,
    ) -> Result<Self> {
        Ok(Self {
            mask: options.mask.map(|m| Mask::new(m, g)).transpose()?,
            scale: scale as f32,
            causal: options.causal,
            dropout,
            g,
            tokens_major,
            stats: Arc::default(),
            gemm_only: false,
        })
    }

    /// How many keys query row `i` sees: all, or with `causal` those up to `i + t_k - t_q`.
    fn visible(&self, i: usize) -> usize {
        let g = self.g;
        if self.causal {
            (i + g.tk + 1).saturating_sub(g.tq).min(g.tk)
        } else {
            g.tk
        }
    }

    /// The dropout's factors for rows `from..from + rows` of head `(b, h)`, `keys` wide,
    /// row-major: 0 where dropped, `1 / (1 - p)` where kept; `None` without dropout.
    fn dropout_factors(
        &self,
        (b, h): (usize, usize),
        (from, rows): (usize, usize),
        keys: usize,
    ) -> Option<Vec<f32>> {
        let dropout = self.dropout?;
        let kept = dropout.scale();
        let factor = |r: usize, j: usize| {
            if dropout.keeps(self.g, (b, h, from + r, j)) {
                kept
            } else {
                0.0
            }
        };
        Some(
            (0..rows)
                .flat_map(|r| (0..keys).map(move |j| factor(r, j)))
                .collect(),
        )
    }

    /// The scaled and masked scores of query rows `from..to` of head `(b, h)` (its products
    /// `x`), f32 and row-major over the keys the block's last row sees (the later keys are
    /// hidden from every row of the block), `-inf` where a row's key is hidden, with how many
    /// keys that is.
    fn scores<T>(
        &self,
        (b, h): (usize, usize),
        (from, to): (usize, usize),
        x: &impl Products<T>,
    ) -> (Vec<f32>, usize) {
        let (rows, keys) = (to - from, self.visible(to - 1));
        if keys == 0 {
            return (Vec::new(), 0);
        }
        let mut s = x.scores((from, rows), keys);
        for (r, row) in s.chunks_exact_mut(keys).enumerate() {
            let i = from + r;
            let seen = self.visible(i);
            match &self.mask {
                Some(mask) => {
                    let (start, step) = mask.row(b, h, i);
                    for (j, s) in row[..seen].iter_mut().enumerate() {
                        *s = *s * self.scale + mask.values[start + j * step];
                    }
                }
                None => row[..seen].iter_mut().for_each(|s| *s *= self.scale),
            }
            row[seen..].fill(f32::NEG_INFINITY);
        }
        (s, keys)
    }

    /// The probabilities of query rows `from..to` of head `(b, h)` (see [`Self::scores`]), each
    /// row's softmax statistics written to `stats`.
    fn probabilities<T>(
        &self,
        (b, h): (usize, usize),
        (from, to): (usize, usize),
        x: &impl Products<T>,
        stats: &mut [MaybeUninit<RowStats>],
    ) -> (Vec<f32>, usize) {
        let (mut p, keys) = self.scores((b, h), (from, to), x);
        if keys == 0 {
            stats.fill(MaybeUninit::new(NO_KEY));
            return (p, keys);
        }
        for (row, stats) in p.chunks_exact_mut(keys).zip(stats) {
            stats.write(softmax_in_place(row));
        }
        (p, keys)
    }

    /// The probabilities again from the forward's statistics of each row: the forward's own
    /// `exp(s - max) / sum`, so the same values to the bit.
    fn probabilities_again<T>(
        &self,
        (b, h): (usize, usize),
        (from, to): (usize, usize),
        x: &impl Products<T>,
        stats: &[RowStats],
    ) -> (Vec<f32>, usize) {
        let (mut p, keys) = self.scores((b, h), (from, to), x);
        if keys > 0 {
            for (row, stats) in p.chunks_exact_mut(keys).zip(stats) {
                exponentials(row, stats.max);
                for s in row.iter_mut() {
                    *s /= stats.sum;
                }
            }
        }
        (p, keys)
    }

    /// The resident products, where the operands take them and `on_the_gemm` (tests) did not
    /// rule them out.
    fn resident<T: GemmElem>(&self, operands: &[Operand<T>]) -> Option<Bf16Products> {
        if self.gemm_only {
            None
        } else {
            resident(self.g, operands)
        }
    }

    /// The same op with every product on the packed GEMM (the reference the resident products
    /// are tested against).
    #[cfg(test)]
    pub(super) fn on_the_gemm(mut self) -> Self {
        self.gemm_only = true;
        self
    }

    fn forward<T: GemmElem>(&self, q: Operand<T>, k: Operand<T>, v: Operand<T>) -> Vec<T> {
        let g = self.g;
        let blocks = g.tq.div_ceil(BLOCK);
        let len = g.b * g.h * g.tq * g.dv;
        if len == 0 {
            // No output value (an empty batch or length, or values of size 0).
            return Vec::new();
        }
        // With the resident products, each key/value head packed once for all its blocks.
        let resident = self.resident(&[q, k, v]);
        let mut panels: Vec<Panels> = Vec::new();
        if let Some(products) = resident {
            panels.resize_with(g.b * g.hk, Panels::default);
            parallel::for_each_chunk_mut(&mut panels, 1, |i, head| {
                head[0] = Panels::new(products, Pass::Forward, (g, i / g.hk, i % g.hk), [k, v]);
            });
        }
        let mut out: Vec<T> = Vec::with_capacity(len);
        let dst = Disjoint::new(&mut out.spare_capacity_mut()[..len]);
        let rows = g.b * g.h * g.tq;
        let mut stats: Vec<RowStats> = Vec::with_capacity(rows);
        let stats_rows = Disjoint::new(&mut stats.spare_capacity_mut()[..rows]);
        parallel::for_each_index(g.b * g.h * blocks, |task| {
            let (bh, block) = (task / blocks, task % blocks);
            let (b, h) = (bh / g.h, bh % g.h);
            let from = block * BLOCK;
            let to = (from + BLOCK).min(g.tq);
            // SAFETY: task `(b, h, block)` alone handles rows `from..to` of head `(b, h)`.
            let stats = unsafe { stats_rows.part(bh * g.tq + from, to - from) };
            let head = Head {
                g,
                b,
                h,
                kv: h / g.group(),
                q,
                k,
                v,
            };
            let o = match resident {
                Some(products) => self.block_output(
                    &Resident {
                        products,
                        head,
                        panels: &panels[b * g.hk + head.kv],
                    },
                    (b, h),
                    (from, to),
                    stats,
                ),
                None => self.block_output(&Gemm(head), (b, h), (from, to), stats),
            };
            if self.tokens_major {
                for (i, row) in (from..to).zip(o.chunks_exact(g.dv)) {
                    // SAFETY: task `(b, h, block)` alone writes row `i` of head `h` at `(b, i)`.
                    let out = unsafe { dst.part(((b * g.tq + i) * g.h + h) * g.dv, g.dv) };
                    write_rounded(row, out);
                }
            } else {
                // SAFETY: task `(b, h, block)` alone writes rows `from..to` of head `(b, h)`.
                let rows = unsafe { dst.part((bh * g.tq + from) * g.dv, o.len()) };
                write_rounded(&o, rows);
            }
        });
        // SAFETY: the tasks' rows cover every head's `t_q` rows, and each was written (output
        // and statistics).
        unsafe {
            out.set_len(len);
            stats.set_len(rows);
        }
        // A second forward of the same op (none is made) would keep the first's statistics.
        let _ = self.stats.set(stats);
        out
    }

    /// The output of query rows `from..to` of head `(b, h)`, f32 `(rows, d_v)`, from its
    /// products `x`; the rows' softmax statistics written to `stats`.
    fn block_output<T>(
        &self,
        x: &impl Products<T>,
        (b, h): (usize, usize),
        (from, to): (usize, usize),
        stats: &mut [MaybeUninit<RowStats>],
    ) -> Vec<f32> {
        let (mut p, keys) = self.probabilities((b, h), (from, to), x, stats);
        if let Some(z) = self.dropout_factors((b, h), (from, to - from), keys) {
            p.iter_mut().zip(&z).for_each(|(p, z)| *p *= z);
        }
        x.outputs(&p, to - from, keys)
    }

    /// `[dq | dk | dv]`, flattened in the operands' shapes (contiguous), from the output's
    /// gradient `dout`.
    fn backward<T: GemmElem>(
        &self,
        q: Operand<T>,
        k: Operand<T>,
        v: Operand<T>,
        dout: Operand<T>,
    ) -> Vec<T> {
        let g = self.g;
        let (nq, nk, nv) = (
            g.b * g.h * g.tq * g.d,
            g.b * g.hk * g.tk * g.d,
            g.b * g.hk * g.tk * g.dv,
        );
        let len = nq + nk + nv;
        if len == 0 {
            return Vec::new();
        }
        let resident = self.resident(&[q, k, v, dout]);
        let mut out: Vec<T> = Vec::with_capacity(len);
        let dst = Disjoint::new(&mut out.spare_capacity_mut()[..len]);
        parallel::for_each_index(g.b * g.hk, |task| {
            let (b, kv) = (task / g.hk, task % g.hk);
            let panels = resident.map(|p| (p, Panels::new(p, Pass::Backward, (g, b, kv), [k, v])));
            let mut dk = vec![0f32; g.tk * g.d];
            let mut dv = vec![0f32; g.tk * g.dv];
            for h in kv * g.group()..(kv + 1) * g.group() {
                let head = Head {
                    g,
                    b,
                    h,
                    kv,
                    q,
                    k,
                    v,
                };
                for from in (0..g.tq).step_by(BLOCK) {
                    let rows = (from, (from + BLOCK).min(g.tq));
                    let sums = (&mut dk[..], &mut dv[..]);
                    let dq = match &panels {
                        Some((products, panels)) => {
                            let x = Resident {
                                products: *products,
                                head,
                                panels,
                            };
                            self.block_grads(&x, dout, (b, h), rows, sums)
                        }
                        None => self.block_grads(&Gemm(head), dout, (b, h), rows, sums),
                    };
                    // SAFETY: this task alone handles query head `(b, h)` (its key/value head's
                    // group), so it alone writes these rows of dq.
                    let rows =
                        unsafe { dst.part((b * g.h + h) * g.tq * g.d + from * g.d, dq.len()) };
                    write_rounded(&dq, rows);
                }
            }
            let head = b * g.hk + kv;
            // SAFETY: this task alone handles key/value head `(b, kv)`.
            let (dk_rows, dv_rows) = unsafe {
                (
                    dst.part(nq + head * g.tk * g.d, dk.len()),
                    dst.part(nq + nk + head * g.tk * g.dv, dv.len()),
                )
            };
            write_rounded(&dk, dk_rows);
            write_rounded(&dv, dv_rows);
        });
        // SAFETY: the tasks cover every query head's rows and every key/value head.
        unsafe { out.set_len(len) };
        out
    }

    /// The gradients of query rows `from..to` of head `(b, h)` (returned, f32), and their
    /// contributions to the key/value head's `dk` and `dv` (added), from its products `x`.
    fn block_grads<T: GemmElem>(
        &self,
        x: &impl Products<T>,
        dout: Operand<T>,
        (b, h): (usize, usize),
        (from, to): (usize, usize),
        (dk, dv): (&mut [f32], &mut [f32]),
    ) -> Vec<f32> {
        let g = self.g;
        let rows = to - from;
        let (p, keys) = if let Some(stats) = self.stats.get() {
            let at = (b * g.h + h) * g.tq;
            self.probabilities_again((b, h), (from, to), x, &stats[at + from..at + to])
        } else {
            // No forward values (an empty output, `d_v` = 0): the softmax again.
            let mut stats = vec![MaybeUninit::uninit(); rows];
            self.probabilities((b, h), (from, to), x, &mut stats)
        };
        if keys == 0 {
            return vec![0.0; rows * g.d];
        }
        // dV += (P Z)^T dO, with P Z rounded as the forward's product read it.
        let z = self.dropout_factors((b, h), (from, rows), keys);
        match &z {
            Some(z) => {
                let dropped: Vec<f32> = p.iter().zip(z).map(|(p, z)| p * z).collect();
                x.add_value_grads(&dropped, dout, (from, rows), keys, dv);
            }
            None => x.add_value_grads(&p, dout, (from, rows), keys, dv),
        }
        // dP = (dO V^T) Z, then dS = P * (dP - rowsum(P * dP)) * scale, in place.
        let mut ds = x.prob_grads(dout, (from, rows), keys);
        if let Some(z) = &z {
            ds.iter_mut().zip(z).for_each(|(d, z)| *d *= z);
        }
        for (p, ds) in p.chunks_exact(keys).zip(ds.chunks_exact_mut(keys)) {
            let dot = lane_sums2(p, ds, |p, dp| (p * dp, 0.0)).0 as f32;
            for (p, dp) in p.iter().zip(ds.iter_mut()) {
                *dp = p * (*dp - dot) * self.scale;
            }
        }
        // dQ = dS K; dK += dS^T Q.
        x.score_grads(&ds, (from, rows), keys, dk)
    }
}

/// The statistics of a row that sees no key: its probabilities are 0 (each `-inf` score gives
/// 0, divided by 1).
const NO_KEY: RowStats = RowStats {
    max: f32::NEG_INFINITY,
    sum: 1.0,
};

/// Softmax of one row in place, in f32: `exp(s - max) / sum`; returns the row's maximum and
/// sum. A row with a NaN becomes NaN (the gradient scaler must see it; its statistics are NaN,
/// so the backward's recomputation is NaN too); a row whose scores are all `-inf` (no key
/// visible) becomes 0 ([`NO_KEY`]); a `-inf` score (a hidden key) gets exactly 0. Each pass is
/// a plain loop over the row with the branch-free `exp` of the activations (a few ulp), so that
/// it vectorises: the library's `expf` and a loop with branches took a third of the op's time.
fn softmax_in_place(row: &mut [f32]) -> RowStats {
    if row.iter().any(|s| s.is_nan()) {
        row.fill(f32::NAN);
        return RowStats {
            max: f32::NAN,
            sum: f32::NAN,
        };
    }
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for chunk in row.chunks(LANES) {
        for (m, &s) in lanes.iter_mut().zip(chunk) {
            *m = m.max(s);
        }
    }
    let max = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        row.fill(0.0);
        return NO_KEY;
    }
    exponentials(row, max);
    let sum = lane_sums2(row, row, |e, _| (e, 0.0)).0 as f32;
    for s in row.iter_mut() {
        *s /= sum;
    }
    RowStats { max, sum }
}

/// `exp(s - max)` of each score in place, exactly 0 for a `-inf` score.
fn exponentials(row: &mut [f32], max: f32) {
    for s in row.iter_mut() {
        let e = crate::kernels::activation::exp(*s - max);
        *s = if *s == f32::NEG_INFINITY { 0.0 } else { e };
    }
}

/// Lanes of the row maximum's partial maxima (one AVX-512 vector).
const LANES: usize = 16;

/// The three operands' storages as one float type, or an error.
macro_rules! with_operands {
    ($s1:expr, $l1:expr, $s2:expr, $l2:expr, $s3:expr, $l3:expr, |$q:ident, $k:ident, $v:ident| $body:expr) => {
        match ($s1, $s2, $s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                let ($q, $k, $v) = (Operand::new(q, $l1)?, Operand::new(k, $l2)?, Operand::new(v, $l3)?);
                $body
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                let ($q, $k, $v) = (Operand::new(q, $l1)?, Operand::new(k, $l2)?, Operand::new(v, $l3)?);
                $body
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                let ($q, $k, $v) = (Operand::new(q, $l1)?, Operand::new(k, $l2)?, Operand::new(v, $l3)?);
                $body
            }
            _ => candle_core::bail!(
                "scaled_dot_product_attention kernel: query, key and value must be f32, f16 or \
                 bf16, of one dtype"
            ),
        }
    };
}

impl CustomOp3 for Fused {
    fn name(&self) -> &'static str {
        "amp-scaled-dot-product-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = self.g;
        let shape = Shape::from((g.b, g.h, g.tq, g.dv));
        let out = with_operands!(s1, l1, s2, l2, s3, l3, |q, k, v| {
            candle_core::WithDType::to_cpu_storage_owned(self.forward(q, k, v))
        });
        Ok((out, shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let packed = q.apply_op3_no_bwd(
            k,
            v,
            &FusedGrad {
                attention: self.clone(),
                dout: grad.clone(),
            },
        )?;
        let (nq, nk) = (q.elem_count(), k.elem_count());
        let part = |t: &Tensor, at: usize| packed.narrow(0, at, t.elem_count())?.reshape(t.shape());
        Ok((
            offer(q, || part(q, 0))?,
            offer(k, || part(k, nq))?,
            offer(v, || part(v, nq + nk))?,
        ))
    }
}

/// The backward of [`Fused`]: `[dq | dk | dv]` flattened, from the output's gradient.
struct FusedGrad {
    attention: Fused,
    dout: Tensor,
}

impl CustomOp3 for FusedGrad {
    fn name(&self) -> &'static str {
        "amp-scaled-dot-product-attention-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (dout, ldout) = self.dout.storage_and_layout();
        let Storage::Cpu(dout) = &*dout else {
            candle_core::bail!("scaled_dot_product_attention: the gradient is not on the CPU")
        };
        let grads = with_operands!(s1, l1, s2, l2, s3, l3, |q, k, v| {
            let Some(d) = candle_core::WithDType::cpu_storage_as_slice(dout).ok() else {
                candle_core::bail!(
                    "scaled_dot_product_attention: the gradient's dtype {:?} is not the \
                     operands'",
                    candle_core::backend::BackendStorage::dtype(dout)
                )
            };
            let d = Operand::new(d, ldout)?;
            candle_core::WithDType::to_cpu_storage_owned(self.attention.backward(q, k, v, d))
        });
        let g = self.attention.g;
        let len = g.b * (g.h * g.tq * g.d + g.hk * g.tk * (g.d + g.dv));
        Ok((grads, Shape::from(len)))
    }
}

/// The packed entry's op over `qkv` `(b, t, 3, h, d)`: [`Fused`] reading the three parts in
/// place, writing a `(b, t, h, d)` output.
pub(super) struct Packed(pub(super) Fused);

/// The packed storage's three parts as operands of one float type, or an error.
macro_rules! with_packed {
    ($s:expr, $l:expr, |$q:ident, $k:ident, $v:ident| $body:expr) => {
        match $s {
            CpuStorage::F32(x) => {
                let ($q, $k, $v) = Operand::parts(x, $l);
                $body
            }
            CpuStorage::F16(x) => {
                let ($q, $k, $v) = Operand::parts(x, $l);
                $body
            }
            CpuStorage::BF16(x) => {
                let ($q, $k, $v) = Operand::parts(x, $l);
                $body
            }
            _ => candle_core::bail!(
                "scaled_dot_product_attention_packed kernel: qkv must be f32, f16 or bf16"
            ),
        }
    };
}

impl CustomOp1 for Packed {
    fn name(&self) -> &'static str {
        "amp-scaled-dot-product-attention-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = self.0.g;
        let out = with_packed!(s, l, |q, k, v| {
            candle_core::WithDType::to_cpu_storage_owned(self.0.forward(q, k, v))
        });
        Ok((out, Shape::from((g.b, g.tq, g.h, g.dv))))
    }

    fn bwd(&self, qkv: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        offer(qkv, || {
            qkv.apply_op1_no_bwd(&PackedGrad {
                attention: self.0.clone(),
                dout: grad.clone(),
            })
        })
    }
}

/// The backward of [`Packed`]: the gradient of `qkv`, `(b, t, 3, h, d)`, from the output's.
struct PackedGrad {
    attention: Fused,
    dout: Tensor,
}

impl PackedGrad {
    /// `[dq | dk | dv]`, each `(b, h, t, d)`, interleaved into `(b, t, 3, h, d)`.
    fn interleave<T: Copy>(&self, parts: &[T]) -> Vec<T> {
        let g = self.attention.g;
        let n = g.b * g.h * g.tq * g.d;
        let mut out = Vec::with_capacity(3 * n);
        for b in 0..g.b {
            for t in 0..g.tq {
                for part in 0..3 {
                    for h in 0..g.h {
                        let at = part * n + ((b * g.h + h) * g.tq + t) * g.d;
                        out.extend_from_slice(&parts[at..at + g.d]);
                    }
                }
            }
        }
        out
    }
}

impl CustomOp1 for PackedGrad {
    fn name(&self) -> &'static str {
        "amp-scaled-dot-product-attention-packed-grad"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (dout, ldout) = self.dout.storage_and_layout();
        let Storage::Cpu(dout) = &*dout else {
            candle_core::bail!(
                "scaled_dot_product_attention_packed: the gradient is not on the CPU"
            )
        };
        let grads = with_packed!(s, l, |q, k, v| {
            let Some(d) = candle_core::WithDType::cpu_storage_as_slice(dout).ok() else {
                candle_core::bail!(
                    "scaled_dot_product_attention_packed: the gradient's dtype {:?} is not qkv's",
                    candle_core::backend::BackendStorage::dtype(dout)
                )
            };
            let d = Operand::tokens_major(d, ldout)?;
            let parts = self.attention.backward(q, k, v, d);
            candle_core::WithDType::to_cpu_storage_owned(self.interleave(&parts))
        });
        Ok((grads, l.shape().clone()))
    }
}
