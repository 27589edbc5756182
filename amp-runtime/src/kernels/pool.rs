//! 2-D max pooling on CPU with any window, stride and padding, forward and backward.
//!
//! candle's `max_pool2d` has no backward when the stride differs from the window (ResNet's 3x3
//! stride-2 stem pool) and no padding. This op pools `(batch, channels, h, w)` in its input's
//! dtype, padding with -inf as PyTorch does; its backward sends each output's gradient to the
//! first position holding the window's maximum (PyTorch's choice too), summing where windows
//! overlap.

use super::{parallel, Real};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, WithDType};

/// Window `(h, w)`, stride `(h, w)` and padding (both sides of both dimensions) of a max pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pool2d {
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: usize,
}

impl Pool2d {
    fn out(&self, (h, w): (usize, usize)) -> (usize, usize) {
        (
            (h + 2 * self.padding - self.kernel.0) / self.stride.0 + 1,
            (w + 2 * self.padding - self.kernel.1) / self.stride.1 + 1,
        )
    }

    fn fits(&self, (h, w): (usize, usize)) -> bool {
        self.kernel.0 > 0
            && self.kernel.1 > 0
            && self.stride.0 > 0
            && self.stride.1 > 0
            && h + 2 * self.padding >= self.kernel.0
            && w + 2 * self.padding >= self.kernel.1
    }

    /// For output `(oy, ox)` of one plane, the offset of the first maximum in the plane.
    fn argmax<T: Real>(
        &self,
        plane: &[T],
        (h, w): (usize, usize),
        oy: usize,
        ox: usize,
    ) -> Option<usize> {
        let mut best: Option<(usize, f32)> = None;
        for i in 0..self.kernel.0 {
            let Some(y) = (oy * self.stride.0 + i)
                .checked_sub(self.padding)
                .filter(|&y| y < h)
            else {
                continue;
            };
            for j in 0..self.kernel.1 {
                let Some(x) = (ox * self.stride.1 + j)
                    .checked_sub(self.padding)
                    .filter(|&x| x < w)
                else {
                    continue;
                };
                let v = plane[y * w + x].get();
                // NaN wins, as in PyTorch: it propagates.
                if best.is_none_or(|(_, b)| v > b || v.is_nan() && !b.is_nan()) {
                    best = Some((y * w + x, v));
                }
            }
        }
        best.map(|(at, _)| at)
    }
}

/// Max pooling of `x` as this op on CPU (float dtypes); elsewhere candle's, which needs no
/// padding (and, to train, stride = window).
pub(crate) fn max_pool2d(x: &Tensor, p: Pool2d) -> Result<Tensor> {
    if let (true, &[_, _, h, w]) = (super::cpu_float(x), x.dims()) {
        if !p.fits((h, w)) {
            candle_core::bail!(
                "max_pool2d: a {:?} window with stride {:?} does not fit a {h}x{w} input padded \
                 by {}",
                p.kernel,
                p.stride,
                p.padding
            );
        }
        x.contiguous()?.apply_op1(MaxPool(p))
    } else if p.padding == 0 {
        x.max_pool2d_with_stride(p.kernel, p.stride)
    } else {
        candle_core::bail!("max_pool2d with padding is implemented on CPU only")
    }
}

struct MaxPool(Pool2d);

fn planes(l: &Layout) -> (usize, usize, usize) {
    let d = l.dims();
    (d[0] * d[1], d[2], d[3])
}

impl MaxPool {
    fn forward<T: Real + Send + Sync>(&self, x: &[T], l: &Layout) -> Vec<T> {
        let p = self.0;
        let (n, h, w) = planes(l);
        let (oh, ow) = p.out((h, w));
        let mut y = vec![T::put(0.0); n * oh * ow];
        parallel::for_each_chunk_mut(&mut y, oh * ow, |c, out| {
            let plane = &x[c * h * w..][..h * w];
            for oy in 0..oh {
                for ox in 0..ow {
                    out[oy * ow + ox] = p
                        .argmax(plane, (h, w), oy, ox)
                        .map_or(T::put(f32::NEG_INFINITY), |at| plane[at]);
                }
            }
        });
        y
    }
}

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        "amp-max-pool2d"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let p = self.0;
        let d = l.dims();
        let out = with_floats!("max pool", s, l, |x| WithDType::to_cpu_storage_owned(
            self.forward(x, l)
        ));
        let (oh, ow) = p.out((d[2], d[3]));
        Ok((out, Shape::from((d[0], d[1], oh, ow))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(arg.apply_op2_no_bwd(
            &grad.contiguous()?,
            &MaxPoolGrad(self.0),
        )?))
    }
}

/// `(x, grad_y) -> grad_x`.
struct MaxPoolGrad(Pool2d);

impl MaxPoolGrad {
    fn run<T: Real + Send + Sync>(&self, x: &[T], lx: &Layout, g: &[T]) -> Vec<T> {
        let p = self.0;
        let (n, h, w) = planes(lx);
        let (oh, ow) = p.out((h, w));
        let mut gx = vec![T::put(0.0); n * h * w];
        parallel::for_each_chunk_mut(&mut gx, h * w, |c, out| {
            let plane = &x[c * h * w..][..h * w];
            let grads = &g[c * oh * ow..][..oh * ow];
            let mut acc = vec![0f32; h * w];
            for oy in 0..oh {
                for ox in 0..ow {
                    if let Some(at) = p.argmax(plane, (h, w), oy, ox) {
                        acc[at] += grads[oy * ow + ox].get();
                    }
                }
            }
            for (o, a) in out.iter_mut().zip(acc) {
                *o = T::put(a);
            }
        });
        gx
    }
}

impl CustomOp2 for MaxPoolGrad {
    fn name(&self) -> &'static str {
        "amp-max-pool2d-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = with_floats!("max pool grad", s1, l1, s2, l2, |x, g| {
            WithDType::to_cpu_storage_owned(self.run(x, l1, g))
        });
        Ok((out, l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;

    /// Forward against candle's max pool; the gradient against a hand computation: each
    /// output's gradient lands on its window's maximum (PyTorch's rule; candle's own backward
    /// divides it by the window's area, so it is no reference here).
    #[test]
    fn max_pool_matches_candle_and_a_hand_computation() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::randn(0f32, 1.0, (2, 3, 6, 6), &dev)?;
        let p = Pool2d {
            kernel: (2, 2),
            stride: (2, 2),
            padding: 0,
        };
        let y = max_pool2d(&x, p)?;
        let want = x.max_pool2d(2)?;
        assert_eq!(
            y.flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?
        );
        let w = Tensor::randn(0f32, 1.0, y.shape(), &dev)?;
        let g = (&y * &w)?.sum_all()?.backward()?;
        let g = g.get(&x).unwrap().flatten_all()?.to_vec1::<f32>()?;
        let (xs, ws) = (
            x.flatten_all()?.to_vec1::<f32>()?,
            w.flatten_all()?.to_vec1::<f32>()?,
        );
        let mut expected = vec![0f32; xs.len()];
        for plane in 0..6 {
            for oy in 0..3 {
                for ox in 0..3 {
                    let at = (0..4)
                        .map(|k| plane * 36 + (2 * oy + k / 2) * 6 + 2 * ox + k % 2)
                        .max_by(|&a, &b| xs[a].total_cmp(&xs[b]))
                        .unwrap();
                    expected[at] += ws[plane * 9 + oy * 3 + ox];
                }
            }
        }
        assert_eq!(g, expected);

        // 4x4 plane 0..16, 3x3 window, stride 2, padding 1: outputs 2x2 at the maxima 5, 7, 13,
        // 15 (row-major values), each gradient to its own maximum.
        let v: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let x = Var::from_tensor(&Tensor::from_vec(v, (1, 1, 4, 4), &dev)?)?;
        let p = Pool2d {
            kernel: (3, 3),
            stride: (2, 2),
            padding: 1,
        };
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let xd = x.to_dtype(dtype)?;
            let y = max_pool2d(&xd, p)?;
            assert_eq!(
                y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                [5., 7., 13., 15.]
            );
        }
        let y = max_pool2d(&x, p)?;
        let g = y.sum_all()?.backward()?;
        let mut want = vec![0f32; 16];
        for at in [5, 7, 13, 15] {
            want[at] = 1.0;
        }
        assert_eq!(g.get(&x).unwrap().flatten_all()?.to_vec1::<f32>()?, want);
        Ok(())
    }
}
