//! `a + b` and `a - b` on CPU, with or without broadcasting, as one op whose backward gives a
//! gradient only to an operand that tracks: candle's `add`, `sub`, `broadcast_add` and
//! `broadcast_sub` in regions and on typed tensors.
//!
//! candle's backward of a sum stores a gradient for both operands whether they track or not
//! (a zero tensor of the operand's size plus an add each): for the attention mask added to
//! every layer's scores, a tensor of `batch x heads x seq x seq` per layer, zero-filled, added
//! to and kept until the backward ends, never read: 4% of a bf16 GPT's peak heap at width 256
//! (its time was within a step's noise). Here an operand that
//! tracks nothing (a mask, a constant bias, data) gets none ([`leaf_grads::wanted`]); a
//! broadcast operand that tracks gets the gradient summed over the dimensions it was broadcast
//! along, in f32 (candle sums a half gradient in half precision). The values are candle's to
//! the bit: each element computed in f32 and rounded once. Off the CPU the broadcast forms are
//! candle's ops, with a broadcast half operand that tracks widened first so that its gradient
//! too is summed in f32 ([`broadcast_spread`]); so are the broadcast products, quotients,
//! maxima and minima, on every device.

use crate::kernels::elem::with_floats;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};

use crate::kernels::elem::Real;
use crate::kernels::leaf_grads::wanted;
use crate::kernels::parallel;

/// `a + b`, same shapes.
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply(a, b, Sum::Add, false, || a.add(b))
}

/// `a - b`, same shapes.
pub(crate) fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply(a, b, Sum::Sub, false, || a.sub(b))
}

/// `a + b` with broadcasting.
pub(crate) fn broadcast_add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply(a, b, Sum::Add, true, || {
        broadcast_spread(a, b, "add", |a, b| a + b)
    })
}

/// `a - b` with broadcasting.
pub(crate) fn broadcast_sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    apply(a, b, Sum::Sub, true, || {
        broadcast_spread(a, b, "sub", |a, b| a - b)
    })
}

/// `a * b` with broadcasting (candle's product; see [`broadcast_spread`]).
pub(crate) fn broadcast_mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    broadcast_spread(a, b, "mul", |a, b| a * b)
}

/// `a / b` with broadcasting (candle's quotient; see [`broadcast_spread`]).
pub(crate) fn broadcast_div(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    broadcast_spread(a, b, "div", |a, b| a / b)
}

/// The elementwise maximum with broadcasting (NaN where either operand is, as
/// [`crate::kernels::extrema::maximum`]; see [`broadcast_spread`]).
pub(crate) fn broadcast_maximum(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    broadcast_spread(a, b, "maximum", crate::kernels::extrema::maximum)
}

/// The elementwise minimum with broadcasting (as [`broadcast_maximum`]).
pub(crate) fn broadcast_minimum(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    broadcast_spread(a, b, "minimum", crate::kernels::extrema::minimum)
}

/// `op` (candle's, same shapes) on `a` and `b` broadcast to their common shape, where a half
/// operand that is broadcast and tracks is broadcast in f32 and rounded back (exactly: its
/// values are half already), a copy of the result's size, so that candle's backward sums its
/// gradient over the broadcast dimensions in f32, as PyTorch's does. candle's own broadcast
/// ops sum a half gradient in half (its CUDA f16 sum accumulates in f16, its CPU sums too:
/// 300 bf16 ones sum to 256). The values are candle's broadcast op's to the bit. The sums and
/// differences take this path off the CPU only (on CPU they are [`Sum`]); products, quotients,
/// maxima and minima everywhere.
fn broadcast_spread(
    a: &Tensor,
    b: &Tensor,
    name: &'static str,
    op: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let shape = a.shape().broadcast_shape_binary_op(b.shape(), name)?;
    op(&spread(a, &shape)?, &spread(b, &shape)?)
}

/// `t` broadcast to `shape`: a view, except for a half `t` that tracks and is broadcast, which
/// is broadcast in f32 and rounded back (exactly: its values are half already), a copy of
/// `shape`'s size, so that candle's backward sums its gradient over the broadcast dimensions
/// in f32 (of a view, it sums in the view's dtype, half).
pub(crate) fn spread(t: &Tensor, shape: &Shape) -> Result<Tensor> {
    let half = matches!(t.dtype(), DType::F16 | DType::BF16);
    if half && t.shape() != shape && t.track_op() {
        t.to_dtype(DType::F32)?
            .broadcast_as(shape)?
            .to_dtype(t.dtype())
    } else {
        t.broadcast_as(shape)
    }
}

/// Through [`Sum`] for two float tensors of one dtype on CPU whose shapes are equal (or
/// broadcast, when `broadcast`); candle's op (`fallback`, with its errors) otherwise.
fn apply(
    a: &Tensor,
    b: &Tensor,
    sum: Sum,
    broadcast: bool,
    fallback: impl FnOnce() -> Result<Tensor>,
) -> Result<Tensor> {
    let fits = crate::kernels::elem::cpu_float(a)
        && crate::kernels::elem::cpu_float(b)
        && a.dtype() == b.dtype()
        && (a.shape() == b.shape()
            || broadcast
                && a.shape()
                    .broadcast_shape_binary_op(b.shape(), sum.name())
                    .is_ok());
    if fits {
        a.contiguous()?.apply_op2(&b.contiguous()?, sum)
    } else {
        fallback()
    }
}

/// The sum or the difference of two contiguous operands, broadcast to their common shape.
#[derive(Clone, Copy, Debug)]
enum Sum {
    Add,
    Sub,
}

impl Sum {
    fn name(self) -> &'static str {
        match self {
            Self::Add => "add",
            Self::Sub => "sub",
        }
    }

    /// The sign `b` enters with.
    fn sign(self) -> f32 {
        match self {
            Self::Add => 1.0,
            Self::Sub => -1.0,
        }
    }

    /// Every element of the common `shape` from `a` and `b` (contiguous, at the layouts' own
    /// shapes), in f32, rounded once.
    fn values<T: Real + Send + Sync>(
        self,
        (a, la): (&[T], &Layout),
        (b, lb): (&[T], &Layout),
        shape: &Shape,
    ) -> Result<Vec<T>> {
        let sign = self.sign();
        if la.shape() == lb.shape() {
            return Ok(crate::kernels::widen::zip_map(a, b, |x, y| x + sign * y));
        }
        let (la, lb) = (la.broadcast_as(shape)?, lb.broadcast_as(shape)?);
        let dims = shape.dims();
        let row = dims.last().copied().unwrap_or(1).max(1);
        let rows_per_task = (ROW_CHUNK / row).max(1);
        let a_rows = Rows::new(&la, dims);
        let b_rows = Rows::new(&lb, dims);
        Ok(parallel::filled(
            shape.elem_count(),
            rows_per_task * row,
            |task, out| {
                let (mut wa, mut wb, mut wo) = (vec![0f32; row], vec![0f32; row], vec![0f32; row]);
                for (i, o) in out.chunks_mut(row).enumerate() {
                    let r = task * rows_per_task + i;
                    a_rows.widen(a, r, &mut wa);
                    b_rows.widen(b, r, &mut wb);
                    for ((o, &x), &y) in wo.iter_mut().zip(&wa).zip(&wb) {
                        *o = x + sign * y;
                    }
                    T::narrow(&wo, o);
                }
            },
        ))
    }
}

/// Elements of the output per task when the operands are broadcast.
const ROW_CHUNK: usize = 1 << 14;

/// How one operand, broadcast to the output's shape, gives the output's rows (its last
/// dimension): where each row starts in the operand's elements (its contiguous slice, from the
/// layout's start), and whether it is the operand's own contiguous row or one value repeated
/// (broadcast along the last dimension).
struct Rows {
    /// The output's dimensions but the last, and the operand's strides for them (0 where it
    /// is broadcast).
    outer: Vec<(usize, usize)>,
    repeated: bool,
}

impl Rows {
    fn new(layout: &Layout, dims: &[usize]) -> Self {
        let rank = dims.len();
        let strides = layout.stride();
        let outer = if rank == 0 {
            Vec::new()
        } else {
            dims[..rank - 1]
                .iter()
                .copied()
                .zip(strides[..rank - 1].iter().copied())
                .collect()
        };
        let repeated = rank > 0 && dims[rank - 1] > 1 && strides[rank - 1] == 0;
        Self { outer, repeated }
    }

    /// Row `r` of the output's shape, read from `data` and widened into `out` (the row's
    /// length).
    fn widen<T: Real>(&self, data: &[T], r: usize, out: &mut [f32]) {
        let mut offset = 0;
        let mut rest = r;
        for &(dim, stride) in self.outer.iter().rev() {
            offset += (rest % dim) * stride;
            rest /= dim;
        }
        if self.repeated {
            out.fill(data[offset].get());
        } else {
            T::widen(&data[offset..offset + out.len()], out);
        }
    }
}

impl CustomOp2 for Sum {
    fn name(&self) -> &'static str {
        match self {
            Self::Add => "amp-add",
            Self::Sub => "amp-sub",
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = *self;
        let shape = if l1.shape() == l2.shape() {
            l1.shape().clone()
        } else {
            l1.shape()
                .broadcast_shape_binary_op(l2.shape(), op.name())?
        };
        let out = with_floats!(op.name(), s1, l1, s2, l2, |a, b| {
            WithDType::to_cpu_storage_owned(op.values((a, l1), (b, l2), &shape)?)
        });
        Ok((out, shape))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_a = wanted(a, || summed_to(grad, a.shape()))?;
        let grad_b = wanted(b, || {
            let g = summed_to(grad, b.shape())?;
            match self {
                Self::Add => Ok(g),
                Self::Sub => crate::kernels::affine(&g, -1.0, -0.0),
            }
        })?;
        Ok((grad_a, grad_b))
    }
}

/// `a + b` (`a - b` with `Sub`) in f32 for operands of one shape, one f32 and the other f16 or
/// bf16: the promote-class sum of a region (an f32 residual stream plus a half branch), with
/// the half operand read as it is instead of cast to f32 first. The values are the cast-then-sum
/// ones to the bit (widening is exact; one f32 sum per element); one graph node where the cast
/// was a second (its own f32 copy in the forward, a zero tensor and an add in candle's
/// backward). On CPU and CUDA; `None` elsewhere or for other operands, for the caller's
/// cast-then-sum.
pub(crate) fn widening_sum(a: &Tensor, b: &Tensor, sub: bool) -> Result<Option<Tensor>> {
    let half = |t: &Tensor| matches!(t.dtype(), DType::F16 | DType::BF16);
    let mixed = (a.dtype() == DType::F32 && half(b)) || (half(a) && b.dtype() == DType::F32);
    let device = a.device().is_cpu() || (cfg!(feature = "cuda") && a.device().is_cuda());
    if !(mixed && device && a.shape() == b.shape() && a.device().same_device(b.device())) {
        return Ok(None);
    }
    let op = Widening(if sub { Sum::Sub } else { Sum::Add });
    a.contiguous()?.apply_op2(&b.contiguous()?, op).map(Some)
}

/// The op of [`widening_sum`].
struct Widening(Sum);

/// `x + sign * y` in f32 over contiguous elements of any two float types.
fn widening_values<X: Real, Y: Real>(x: &[X], y: &[Y], sign: f32) -> Vec<f32> {
    x.iter()
        .zip(y)
        .map(|(x, y)| x.get() + sign * y.get())
        .collect()
}

impl CustomOp2 for Widening {
    fn name(&self) -> &'static str {
        match self.0 {
            Sum::Add => "amp-widening-add",
            Sum::Sub => "amp-widening-sub",
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("{}: contiguous operands expected", self.name())
        };
        let sign = self.0.sign();
        let out = match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::BF16(b)) => {
                widening_values(&a[a0..a1], &b[b0..b1], sign)
            }
            (CpuStorage::F32(a), CpuStorage::F16(b)) => {
                widening_values(&a[a0..a1], &b[b0..b1], sign)
            }
            (CpuStorage::BF16(a), CpuStorage::F32(b)) => {
                widening_values(&a[a0..a1], &b[b0..b1], sign)
            }
            (CpuStorage::F16(a), CpuStorage::F32(b)) => {
                widening_values(&a[a0..a1], &b[b0..b1], sign)
            }
            _ => candle_core::bail!("{}: an f32 and a half operand expected", self.name()),
        };
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::kernels::cuda::binary::widening_sum((s1, l1), (s2, l2), self.0.sign())
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // The f32 gradient, rounded to a half operand's dtype (the cast's backward).
        let grad_a = wanted(a, || crate::kernels::convert::to_dtype(grad, a.dtype()))?;
        let grad_b = wanted(b, || {
            let g = match self.0 {
                Sum::Add => grad.clone(),
                Sum::Sub => crate::kernels::affine(grad, -1.0, -0.0)?,
            };
            crate::kernels::convert::to_dtype(&g, b.dtype())
        })?;
        Ok((grad_a, grad_b))
    }
}

/// `grad` summed over the dimensions an operand of `shape` was broadcast along (in f32 for a
/// half gradient), or `grad` itself when the shapes agree.
fn summed_to(grad: &Tensor, shape: &Shape) -> Result<Tensor> {
    if grad.shape() == shape {
        return Ok(grad.clone());
    }
    let (gd, sd) = (grad.dims(), shape.dims());
    let left = gd.len() - sd.len();
    let dims: Vec<usize> = (0..gd.len())
        .filter(|&d| d < left || (sd[d - left] == 1 && gd[d] != 1))
        .collect();
    let sum = crate::kernels::convert::to_dtype(grad, DType::F32)?.sum_keepdim(dims)?;
    crate::kernels::convert::to_dtype(&sum.reshape(shape)?, grad.dtype())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};
    use half::bf16;

    use super::*;

    fn tensor(values: &[f32], shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::new(values, &Device::Cpu)?
            .reshape(shape)?
            .to_dtype(dtype)
    }

    /// The widening sum against the cast-then-sum it stands for: f32 values bit for bit, the
    /// f32 operand's gradient the output's, the half operand's the output's rounded to its dtype
    /// (negated for `-`), in both orders, for bf16 and f16, narrowed operands included; other
    /// operands are left to the caller (`None`).
    #[test]
    fn the_widening_sum_is_the_cast_then_the_sum() -> Result<()> {
        let xs: Vec<f32> = (0..30).map(|i| i as f32 * 0.37 - 3.1).collect();
        let ys: Vec<f32> = (0..36).map(|i| 1.3 - i as f32 * 0.113).collect();
        for half in [DType::BF16, DType::F16] {
            for sub in [false, true] {
                for half_first in [false, true] {
                    let wide = Var::from_tensor(&tensor(&xs, &[5, 6], DType::F32)?)?;
                    let narrow = Var::from_tensor(&tensor(&ys, &[6, 6], half)?.narrow(0, 1, 5)?)?;
                    let (a, b) = if half_first {
                        (narrow.as_tensor(), wide.as_tensor())
                    } else {
                        (wide.as_tensor(), narrow.as_tensor())
                    };
                    let ours = widening_sum(a, b, sub)?.expect("an f32 and a half operand");
                    let (a32, b32) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
                    let theirs = if sub { (&a32 - &b32)? } else { (&a32 + &b32)? };
                    assert_eq!(ours.dtype(), DType::F32);
                    let (o, t) = (
                        ours.flatten_all()?.to_vec1::<f32>()?,
                        theirs.flatten_all()?.to_vec1::<f32>()?,
                    );
                    assert!(o.iter().zip(&t).all(|(x, y)| x.to_bits() == y.to_bits()));
                    let r = tensor(
                        &xs.iter().map(|x| x * 0.01 + 0.5).collect::<Vec<_>>(),
                        &[5, 6],
                        DType::F32,
                    )?;
                    let (g_ours, g_theirs) = (
                        (&ours * &r)?.sum_all()?.backward()?,
                        (&theirs * &r)?.sum_all()?.backward()?,
                    );
                    for v in [&wide, &narrow] {
                        let (x, y) = (
                            g_ours.get(v).expect("ours"),
                            g_theirs.get(v).expect("theirs"),
                        );
                        assert_eq!(x.dtype(), v.dtype());
                        let (x, y) = (
                            x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                            y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                        );
                        assert!(
                            x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()),
                            "{half:?} sub {sub}"
                        );
                    }
                }
            }
        }
        let a = tensor(&xs, &[5, 6], DType::F32)?;
        for b in [
            tensor(&xs, &[5, 6], DType::F32)?,
            tensor(&xs[..6], &[6], DType::BF16)?,
        ] {
            assert!(
                widening_sum(&a, &b, false)?.is_none(),
                "{:?} {:?}",
                b.dtype(),
                b.dims()
            );
        }
        Ok(())
    }

    /// Values against a hand computation in f32 rounded once, with the mask broadcast along
    /// leading dimensions, along the last one, and not at all, in every float dtype.
    #[test]
    fn sums_round_once_in_every_dtype_and_shape() -> Result<()> {
        let xs: Vec<f32> = (0..24).map(|i| i as f32 * 0.37 - 3.1).collect();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let a = tensor(&xs, &[2, 3, 4], dtype)?;
            let round = |v: f32| {
                Tensor::new(v, &Device::Cpu)
                    .and_then(|t| t.to_dtype(dtype)?.to_dtype(DType::F32)?.to_scalar::<f32>())
            };
            let av = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            for (b_shape, index) in [
                (vec![3, 4], (|i: usize| i % 12) as fn(usize) -> usize),
                (vec![2, 3, 1], |i| i / 4),
                (vec![2, 3, 4], |i| i),
                (vec![1], |_| 0),
            ] {
                let n: usize = b_shape.iter().product();
                let bs: Vec<f32> = (0..n).map(|i| 1.3 - i as f32 * 0.11).collect();
                let b = tensor(&bs, &b_shape, dtype)?;
                let bv = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                for (sum, sign) in [
                    (broadcast_add(&a, &b)?, 1.0),
                    (broadcast_sub(&a, &b)?, -1.0),
                ] {
                    assert_eq!((sum.dtype(), sum.dims()), (dtype, &[2, 3, 4][..]));
                    let got = sum.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    for (i, g) in got.iter().enumerate() {
                        let want = round(av[i] + sign * bv[index(i)])?;
                        assert_eq!(g.to_bits(), want.to_bits(), "{dtype:?} {b_shape:?} {i}");
                    }
                }
            }
            // Operands that start inside their storage (contiguous narrowed views).
            let wide = tensor(&xs, &[6, 4], dtype)?;
            let (top, bottom) = (wide.narrow(0, 3, 3)?, wide.narrow(0, 1, 1)?);
            let got = broadcast_add(&top, &bottom)?
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?;
            let w = wide.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            for (i, row) in got.iter().enumerate() {
                for (j, g) in row.iter().enumerate() {
                    let want = round(w[3 + i][j] + w[1][j])?;
                    assert_eq!(g.to_bits(), want.to_bits(), "{dtype:?} narrowed ({i}, {j})");
                }
            }
            // Without broadcasting, shapes must agree: candle's error.
            assert!(add(&a, &tensor(&xs[..12], &[3, 4], dtype)?).is_err());
        }
        Ok(())
    }

    /// A tracked operand gets the gradient, summed (in f32) over what it was broadcast along, and
    /// negated for `sub`'s right side; one that tracks nothing gets none, where candle's `add`
    /// stores one.
    #[test]
    fn only_operands_that_track_get_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::ones((3, 4, 5), DType::BF16, &dev)?)?;
        let bias = Var::from_tensor(&Tensor::ones((4, 1), DType::BF16, &dev)?)?;
        let mask = Tensor::ones((3, 4, 5), DType::BF16, &dev)?;
        let y = broadcast_sub(&add(x.as_tensor(), &mask)?, bias.as_tensor())?;
        let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let gx = grads.get(x.as_tensor()).expect("x's gradient");
        let gx = gx.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(gx, [1.0; 60]);
        let gb = grads.get(bias.as_tensor()).expect("bias's gradient");
        assert_eq!(gb.dtype(), DType::BF16);
        // Each bias element was broadcast over 3 x 5 positions, subtracted.
        let gb = gb.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(gb, [-15.0; 4]);
        assert!(grads.get(&mask).is_none(), "the mask tracks nothing");
        let candle = (x.as_tensor() + &mask)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .backward()?;
        assert!(candle.get(&mask).is_some(), "candle's add stores one");
        // A long broadcast sum stays exact in f32 where bf16 accumulation would stall at 256.
        let w = Var::from_tensor(&Tensor::zeros(1, DType::BF16, &dev)?)?;
        let long = broadcast_add(&Tensor::zeros(1000, DType::BF16, &dev)?, w.as_tensor())?;
        let grads = long.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let gw = grads.get(w.as_tensor()).expect("w's gradient");
        assert_eq!(gw.to_vec1::<bf16>()?, [bf16::from_f32(1000.0)]);
        Ok(())
    }

    /// A broadcast half operand's gradient is summed in f32 (300 rows of bf16 ones give 300;
    /// candle's own broadcast sums it in bf16 and gives 256), the values are candle's to the
    /// bit, and the difference's gradient carries the sign.
    #[test]
    fn the_composed_broadcast_sums_gradients_in_f32() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::ones((300, 2), DType::BF16, &dev)?;
        let b = Var::from_tensor(&Tensor::new(&[0.5f32, -2.0], &dev)?.to_dtype(DType::BF16)?)?;
        let grad_of = |y: &Tensor| -> Result<Vec<f32>> {
            let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
            grads
                .get(&b)
                .expect("a gradient")
                .to_dtype(DType::F32)?
                .to_vec1()
        };
        let ours = broadcast_spread(&a, &b, "add", |a, b| a + b)?;
        let candle = a.broadcast_add(&b)?;
        let bits = |t: &Tensor| -> Result<Vec<u16>> {
            Ok(t.flatten_all()?
                .to_vec1::<bf16>()?
                .iter()
                .map(|v| v.to_bits())
                .collect())
        };
        assert_eq!(bits(&ours)?, bits(&candle)?);
        assert_eq!(grad_of(&ours)?, [300.0, 300.0]);
        assert_eq!(
            grad_of(&candle)?,
            [256.0, 256.0],
            "candle sums a bf16 gradient in bf16"
        );
        let ours = broadcast_spread(&a, &b, "sub", |a, b| a - b)?;
        assert_eq!(bits(&ours)?, bits(&a.broadcast_sub(&b)?)?);
        assert_eq!(grad_of(&ours)?, [-300.0, -300.0]);
        // Products everywhere: d(a * b)/db = a, summed over the 300 rows.
        let ours = broadcast_mul(&a, &b)?;
        assert_eq!(bits(&ours)?, bits(&a.broadcast_mul(&b)?)?);
        assert_eq!(grad_of(&ours)?, [300.0, 300.0]);
        assert_eq!(grad_of(&a.broadcast_mul(&b)?)?, [256.0, 256.0]);
        let ours = broadcast_div(&a, &b)?;
        assert_eq!(bits(&ours)?, bits(&a.broadcast_div(&b)?)?);
        // The broadcast alone (typed and region `broadcast_as`/`broadcast_left`).
        let shape = Shape::from((300, 2));
        assert_eq!(grad_of(&spread(&b, &shape)?)?, [300.0, 300.0]);
        assert_eq!(grad_of(&b.broadcast_as(shape)?)?, [256.0, 256.0]);
        Ok(())
    }
}
