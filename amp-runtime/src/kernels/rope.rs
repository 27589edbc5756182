//! Rotary position embeddings as one op with its own backward: candle-nn's `rope` (the head
//! dimension's two halves rotated as pairs, `(b, h, t, d)`), `rope_i` (adjacent elements as
//! pairs) and `rope_thd` (halves, `(b, t, h, d)`), with their cos/sin tables of `(t', d / 2)`
//! or per batch `(b, t', d / 2)`, `t <= t'` (the first `t` rows used).
//!
//! candle-nn's kernels compute in the input's dtype, so a half input needs half tables, and
//! they have no backward (`apply_op3_no_bwd`): a model trained through them gets no gradient
//! into its query and key projections, silently. Here the tables are read in f32 (any float
//! dtype given is widened), each pair is rotated in f32 and rounded once to the input's dtype
//! (PyTorch's autocast leaves rotary embeddings to the input's dtype too: they are
//! element-wise), and the backward is the rotation by the opposite angle, one pass. The tables
//! get no gradient: they are constants of the position. On CPU it is one op; elsewhere the same
//! arithmetic runs as candle ops in f32 ([`composed`], also the tests' reference).

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, WithDType, D};

use crate::kernels::elem::{cpu_float, with_floats, Real};
use crate::kernels::parallel;

/// Which elements pair up, and the input's layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    /// candle-nn's `rope`: `(b, h, t, d)`, element `j` with `j + d / 2` (GPT-NeoX, Llama).
    Halves,
    /// candle-nn's `rope_i`: `(b, h, t, d)`, element `2j` with `2j + 1` (GPT-J, the original).
    Interleaved,
    /// candle-nn's `rope_thd`: `(b, t, h, d)`, halves as [`Form::Halves`].
    Thd,
}

impl Form {
    /// candle-nn's name of the function.
    fn name(self) -> &'static str {
        match self {
            Form::Halves => "rope",
            Form::Interleaved => "rope_i",
            Form::Thd => "rope_thd",
        }
    }
}

/// The rotary embedding of `x` by the angles whose cosines and sines are `cos` and `sin` (see
/// the module's documentation), in `x`'s dtype. Differentiable in `x`.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, form: Form) -> Result<Tensor> {
    let geometry = Geometry::check(x, cos, sin, form)?;
    if x.elem_count() == 0 {
        // Nothing to rotate (a head dimension of 0: the kernel walks rows of `d`).
        return Ok(x.clone());
    }
    // f32 tables for the kernel and for f32 or half `x`; f64 ones for f64 `x` (never cast).
    let wide = crate::kernels::elem::wide(x.dtype());
    let (cos, sin) = (cos.to_dtype(wide)?, sin.to_dtype(wide)?);
    if !cpu_float(x) {
        return composed(x, &cos, &sin, form);
    }
    let table = |t: &Tensor| -> Result<Vec<f32>> { t.flatten_all()?.to_vec1::<f32>() };
    let op = Rope {
        cos: table(&cos)?.into(),
        sin: table(&sin)?.into(),
        geometry,
        inverse: false,
    };
    x.contiguous()?.apply_op1(op)
}

/// The sizes the kernel walks by.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    form: Form,
    /// The input's heads, positions and head dimension.
    h: usize,
    t: usize,
    d: usize,
    /// The tables' rows per batch; whether they have one set per batch.
    table_t: usize,
    batched: bool,
}

impl Geometry {
    /// `x`'s and the tables' shapes checked as candle-nn checks them, each mismatch an error
    /// naming the shapes.
    fn check(x: &Tensor, cos: &Tensor, sin: &Tensor, form: Form) -> Result<Self> {
        let name = form.name();
        let (b, a1, a2, d) = x.dims4().map_err(|_| {
            candle_core::Error::Msg(format!(
                "{name}: the input must be 4-d ({}), got {:?}",
                if form == Form::Thd {
                    "b, t, heads, d"
                } else {
                    "b, heads, t, d"
                },
                x.shape()
            ))
        })?;
        let (h, t) = if form == Form::Thd {
            (a2, a1)
        } else {
            (a1, a2)
        };
        if !x.dtype().is_float() {
            candle_core::bail!(
                "{name}: the input must be a float tensor, got {:?}",
                x.dtype()
            );
        }
        if cos.shape() != sin.shape() || !cos.dtype().is_float() || !sin.dtype().is_float() {
            candle_core::bail!(
                "{name}: cos and sin must be float tables of one shape, got {:?} {:?} and {:?} \
                 {:?}",
                cos.shape(),
                cos.dtype(),
                sin.shape(),
                sin.dtype()
            );
        }
        let (table_t, half, batched) = match *cos.dims() {
            [tt, half] => (tt, half, false),
            [bb, tt, half] if bb == b => (tt, half, true),
            _ => candle_core::bail!(
                "{name}: cos/sin must be (t, d / 2) or (batch, t, d / 2) for an input {:?}, got \
                 {:?}",
                x.shape(),
                cos.shape()
            ),
        };
        if d % 2 != 0 || 2 * half != d || table_t < t {
            candle_core::bail!(
                "{name}: cos/sin {:?} do not fit an input {:?}: they need d / 2 = {} columns and \
                 at least t = {t} rows (the head dimension must be even)",
                cos.shape(),
                x.shape(),
                d as f64 / 2.0
            );
        }
        Ok(Self {
            form,
            h,
            t,
            d,
            table_t,
            batched,
        })
    }

    /// The table row of the input's row `r` (rows of `d` elements in memory order).
    fn table_row(&self, r: usize) -> usize {
        let (b, t) = match self.form {
            Form::Halves | Form::Interleaved => (r / (self.h * self.t), r % self.t),
            Form::Thd => (r / (self.t * self.h), (r / self.h) % self.t),
        };
        if self.batched {
            b * self.table_t + t
        } else {
            t
        }
    }
}

/// The op: `x` rotated by the tables' angles, or by their opposites (`inverse`, the backward).
#[derive(Clone)]
struct Rope {
    cos: std::sync::Arc<[f32]>,
    sin: std::sync::Arc<[f32]>,
    geometry: Geometry,
    inverse: bool,
}

impl Rope {
    /// One row: `o` from `x`, both of `d` f32 values, the angles' row `c`, `s` (`d / 2` each).
    fn rotate(&self, x: &[f32], o: &mut [f32], c: &[f32], s: &[f32]) {
        let half = c.len();
        let sign = if self.inverse { -1.0 } else { 1.0 };
        match self.geometry.form {
            Form::Halves | Form::Thd => {
                let (x1, x2) = x.split_at(half);
                let (o1, o2) = o.split_at_mut(half);
                for j in 0..half {
                    let (c, s) = (c[j], sign * s[j]);
                    o1[j] = x1[j] * c - x2[j] * s;
                    o2[j] = x2[j] * c + x1[j] * s;
                }
            }
            Form::Interleaved => {
                for j in 0..half {
                    let (c, s) = (c[j], sign * s[j]);
                    let (a, b) = (x[2 * j], x[2 * j + 1]);
                    o[2 * j] = a * c - b * s;
                    o[2 * j + 1] = a * s + b * c;
                }
            }
        }
    }

    fn run<T: Real + Send + Sync>(&self, x: &[T]) -> Vec<T> {
        let Geometry { d, .. } = self.geometry;
        let half = d / 2;
        // Whole rows per task, about 16K elements.
        let rows = (16_384 / d).max(1);
        parallel::filled(x.len(), rows * d, |chunk, out: &mut [T]| {
            let (mut wx, mut wo) = (vec![0f32; d], vec![0f32; d]);
            for (k, o) in out.chunks_mut(d).enumerate() {
                let r = chunk * rows + k;
                let at = self.geometry.table_row(r) * half;
                T::widen(&x[r * d..][..d], &mut wx);
                self.rotate(
                    &wx,
                    &mut wo,
                    &self.cos[at..][..half],
                    &self.sin[at..][..half],
                );
                T::narrow(&wo, o);
            }
        })
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "amp-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = with_floats!("rope", s, l, |x| WithDType::to_cpu_storage_owned(
            self.run(x)
        ));
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let inverse = Self {
            inverse: !self.inverse,
            ..self.clone()
        };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&inverse)?))
    }
}

/// [`rope`] as candle ops on `x` widened to f32 and f32 tables, rounded back once: the path off
/// the CPU, and the tests' reference.
pub(crate) fn composed(x: &Tensor, cos: &Tensor, sin: &Tensor, form: Form) -> Result<Tensor> {
    let g = Geometry::check(x, cos, sin, form)?;
    let wide = crate::kernels::elem::wide(x.dtype());
    let xw = x.to_dtype(wide)?;
    // Each table to `d` columns in the pairs' order, shaped to broadcast against the input.
    let full = |table: &Tensor| -> Result<Tensor> {
        let table = table.to_dtype(wide)?.narrow(D::Minus2, 0, g.t)?;
        let full = match form {
            Form::Halves | Form::Thd => Tensor::cat(&[&table, &table], D::Minus1)?,
            Form::Interleaved => {
                let dims = table.dims().to_vec();
                let mut to = dims.clone();
                *to.last_mut().expect("2 or 3 dims") *= 2;
                Tensor::stack(&[&table, &table], D::Minus1)?.reshape(to)?
            }
        };
        // (t, d) or (b, t, d) to (b | 1, h | 1, t, d), or (b | 1, t, 1, d) for Thd.
        let full = if g.batched { full } else { full.unsqueeze(0)? };
        match form {
            Form::Thd => full.unsqueeze(2),
            _ => full.unsqueeze(1),
        }
    };
    let (c, s) = (full(cos)?, full(sin)?);
    // The partner of each element, signed: (-x2, x1) for halves, (-x_{2j+1}, x_2j) for pairs.
    let partner = match form {
        Form::Halves | Form::Thd => {
            let half = g.d / 2;
            let (x1, x2) = (
                xw.narrow(D::Minus1, 0, half)?,
                xw.narrow(D::Minus1, half, half)?,
            );
            Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?
        }
        Form::Interleaved => {
            let mut pairs = xw.dims().to_vec();
            let last = pairs.pop().expect("4 dims");
            pairs.extend([last / 2, 2]);
            let p = xw.reshape(pairs)?;
            let (a, b) = (p.narrow(D::Minus1, 0, 1)?, p.narrow(D::Minus1, 1, 1)?);
            Tensor::cat(&[&b.neg()?, &a], D::Minus1)?.reshape(xw.shape())?
        }
    };
    (xw.broadcast_mul(&c)? + partner.broadcast_mul(&s)?)?.to_dtype(x.dtype())
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;

    /// Tables of `rows` positions for head dimension `d`, as Llama builds them (theta 10000).
    fn tables(rows: usize, d: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        let inv: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / d as f32))
            .collect();
        let inv = Tensor::from_vec(inv, (1, d / 2), dev)?;
        let pos = Tensor::arange(0u32, rows as u32, dev)?
            .to_dtype(DType::F32)?
            .reshape((rows, 1))?;
        let angles = pos.broadcast_mul(&inv)?;
        Ok((angles.cos()?, angles.sin()?))
    }

    /// candle-nn's function of a form.
    type CandleRope = fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;

    fn forms() -> [(Form, CandleRope); 3] {
        [
            (Form::Halves, candle_nn::rotary_emb::rope),
            (Form::Interleaved, candle_nn::rotary_emb::rope_i),
            (Form::Thd, candle_nn::rotary_emb::rope_thd),
        ]
    }

    /// In f32 the op is candle-nn's function (whose kernels are the reference for the
    /// arithmetic), for 2-d and per-batch tables, with longer tables than the input.
    #[test]
    fn f32_values_are_candle_nn_s() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, t, d) = (2, 3, 5, 8);
        let (cos, sin) = tables(t + 3, d, &dev)?;
        let x = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev)?;
        for (form, candle) in forms() {
            let x = if form == Form::Thd {
                x.reshape((b, t, h, d))?
            } else {
                x.clone()
            };
            let (c, s) = (cos.narrow(0, 0, t)?, sin.narrow(0, 0, t)?);
            let want = candle(&x, &c, &s)?;
            let got = rope(&x, &cos, &sin, form)?;
            let err = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(err < 1e-6, "{form:?}: {err}");
            assert!(
                (composed(&x, &cos, &sin, form)? - &want)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?
                    < 1e-6,
                "{form:?} composed"
            );
            // Per-batch tables: batch 1's rows shifted by one position.
            let cb = Tensor::stack(&[&c, &cos.narrow(0, 1, t)?], 0)?;
            let sb = Tensor::stack(&[&s, &sin.narrow(0, 1, t)?], 0)?;
            let want = candle(&x, &cb, &sb)?;
            let err = (rope(&x, &cb, &sb, form)? - &want)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(err < 1e-6, "{form:?} batched: {err}");
        }
        Ok(())
    }

    /// A half input: the f32 rotation of its values, rounded once; its gradient the composed
    /// f32 arithmetic's (the rotation by the opposite angle), in the input's dtype. candle's
    /// own function would need half tables and gives no gradient.
    #[test]
    fn half_values_rounded_once_and_gradients_those_of_the_composed_math() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, t, d) = (2, 2, 7, 6);
        let (cos, sin) = tables(t, d, &dev)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (form, _) in forms() {
                let shape = if form == Form::Thd {
                    (b, t, h, d)
                } else {
                    (b, h, t, d)
                };
                let x32 = Tensor::randn(0f32, 1.0, shape, &dev)?;
                let x = Var::from_tensor(&x32.to_dtype(dtype)?)?;
                let y = rope(&x, &cos, &sin, form)?;
                assert_eq!(y.dtype(), dtype);
                // Rounded once: the f32 result of the rounded input, rounded.
                let want = composed(&x.to_dtype(DType::F32)?, &cos, &sin, form)?.to_dtype(dtype)?;
                let diff = (y.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?;
                let ulp = if dtype == DType::F32 { 1e-6 } else { 0.02 };
                assert!(diff <= ulp, "{form:?} {dtype:?}: {diff}");
                // Gradient of sum(y * w) against the composed math's, in f32.
                let w = Tensor::randn(0f32, 1.0, shape, &dev)?;
                let g = (y.to_dtype(DType::F32)? * &w)?.sum_all()?.backward()?;
                let gx = g.get(&x).expect("a gradient reaches x");
                assert_eq!(gx.dtype(), dtype);
                let xr = Var::from_tensor(&x.to_dtype(DType::F32)?)?;
                let gr = (composed(&xr, &cos, &sin, form)? * &w)?
                    .sum_all()?
                    .backward()?;
                let want = gr.get(&xr).expect("reference gradient");
                let diff = (gx.to_dtype(DType::F32)? - want)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?;
                let tol = if dtype == DType::F32 { 1e-5 } else { 0.05 };
                assert!(diff <= tol, "{form:?} {dtype:?} grad: {diff}");
            }
        }
        Ok(())
    }

    /// A rotation keeps each pair's length: a hand check independent of both implementations.
    #[test]
    fn each_pair_keeps_its_length_and_position_zero_is_the_identity() -> Result<()> {
        let dev = Device::Cpu;
        let (cos, sin) = tables(4, 4, &dev)?;
        let x = Tensor::new(&[1f32, 2., 3., 4.], &dev)?.reshape((1, 1, 1, 4))?;
        let x = x.broadcast_as((1, 1, 4, 4))?.contiguous()?;
        let y = rope(&x, &cos, &sin, Form::Halves)?
            .squeeze(0)?
            .to_vec3::<f32>()?;
        // Position 0: angle 0, the identity.
        assert_eq!(y[0][0], vec![1., 2., 3., 4.]);
        for row in &y[0] {
            // Pairs (0, 2) and (1, 3).
            let n0 = row[0] * row[0] + row[2] * row[2];
            let n1 = row[1] * row[1] + row[3] * row[3];
            assert!(
                (n0 - 10.0).abs() < 1e-5 && (n1 - 20.0).abs() < 1e-5,
                "{row:?}"
            );
        }
        Ok(())
    }

    #[test]
    fn mismatched_tables_are_errors_naming_the_shapes() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((1, 2, 5, 8), DType::F32, &dev)?;
        let (cos, sin) = tables(4, 8, &dev)?;
        let e = rope(&x, &cos, &sin, Form::Halves).unwrap_err().to_string();
        assert!(e.contains("at least t = 5 rows"), "{e}");
        let (cos, sin) = tables(5, 6, &dev)?;
        let e = rope(&x, &cos, &sin, Form::Halves).unwrap_err().to_string();
        assert!(e.contains("d / 2 = 4 columns"), "{e}");
        let odd = Tensor::zeros((1, 2, 5, 7), DType::F32, &dev)?;
        let e = rope(&odd, &cos, &sin, Form::Interleaved)
            .unwrap_err()
            .to_string();
        assert!(e.contains("must be even"), "{e}");
        let e = rope(&x.flatten_all()?, &cos, &sin, Form::Thd)
            .unwrap_err()
            .to_string();
        assert!(e.contains("4-d (b, t, heads, d)"), "{e}");
        Ok(())
    }
}
