//! A value computed by candle's ops, with a gradient rule of its own.
//!
//! candle differentiates a composition as composed: where that is not PyTorch's gradient (a
//! kink such as `abs` at 0, a tie of maxima, a factor 0 meeting an infinity) an op computes its
//! value from `x.detach()` as it likes and attaches its rule here. The result is
//! `value - zero(x)`, `zero` an op whose value is 0 of `value`'s shape and whose backward is the
//! rule's (negated, as it is subtracted). `v - 0` is `v` for every value, -0.0 and NaN
//! included, so the value is exactly what was computed. `x` gets the rule's gradient alone;
//! another input the value was computed from (a loss's target) keeps the composition's.

use std::sync::Arc;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// The gradient of `x` (the first argument) from the output's gradient (the second).
type Rule = dyn Fn(&Tensor, &Tensor) -> Result<Tensor> + Send + Sync;

/// `value`, computed from `x.detach()`, with `rule(x, grad)` as `x`'s gradient.
pub(crate) fn with_gradient(
    x: &Tensor,
    value: Tensor,
    rule: impl Fn(&Tensor, &Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !x.track_op() {
        return Ok(value);
    }
    let zero = x.apply_op1(Zero {
        shape: value.shape().clone(),
        dtype: value.dtype(),
        rule: Arc::new(rule),
    })?;
    if value.elem_count() == 0 {
        // candle's binary ops return their left operand for an empty result, which would drop
        // `zero`, and with it every gradient upstream of `x` (a weight before an empty batch's
        // loss got none; PyTorch's is zeros). The empty zero is the value itself: no element
        // to differ, and `x`'s gradient, empty as `x` is, flows through it.
        return Ok(zero);
    }
    value.sub(&zero)
}

/// The zero the value is subtracted from (see the module docs).
struct Zero {
    shape: Shape,
    dtype: DType,
    rule: Arc<Rule>,
}

impl Zero {
    fn zeros<D: BackendDevice>(&self, device: &D) -> Result<(D::Storage, Shape)> {
        Ok((
            device.zeros_impl(&self.shape, self.dtype)?,
            self.shape.clone(),
        ))
    }
}

impl CustomOp1 for Zero {
    fn name(&self) -> &'static str {
        "custom-gradient"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.zeros(s.device())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.zeros(s.device())
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // `grad` is the zero's, the output's negated; the rule is linear in it.
        let g = (self.rule)(x, grad)?.neg()?;
        Ok(Some(g.to_dtype(x.dtype())?))
    }
}

/// `result`, a binary op's of `a` and `b`, kept in the graph of both operands when it holds no
/// element. candle's binary ops return their left operand for an empty result (`(0, 1) * (1,
/// 3)` is the left's broadcast), so the right one, and whatever it was computed from, got no
/// gradient at all where PyTorch's is zeros (an optimizer then skipped the weight, weight decay
/// included). The empty result is then an op over both whose gradients are zeros.
pub(crate) fn keep_operands(result: Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if result.elem_count() > 0 || !(a.track_op() || b.track_op()) {
        return Ok(result);
    }
    a.apply_op2(
        b,
        EmptyOf {
            shape: result.shape().clone(),
            dtype: result.dtype(),
        },
    )
}

/// The empty result of [`keep_operands`]: no element, zero gradients for both operands.
struct EmptyOf {
    shape: Shape,
    dtype: DType,
}

impl candle_core::CustomOp2 for EmptyOf {
    fn name(&self) -> &'static str {
        "empty-result"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((
            s.device().zeros_impl(&self.shape, self.dtype)?,
            self.shape.clone(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            s.device().zeros_impl(&self.shape, self.dtype)?,
            self.shape.clone(),
        ))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((
            crate::kernels::leaf_grads::offer(a, || a.zeros_like())?,
            crate::kernels::leaf_grads::offer(b, || b.zeros_like())?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The value comes back bit for bit (NaN, -0.0, infinities), and the gradient is the
    /// rule's, not the value's composition's.
    #[test]
    fn the_value_is_kept_and_the_gradient_is_the_rule_s() -> Result<()> {
        let x = Var::new(&[-0.0f32, f32::NAN, f32::INFINITY, 2.0], &Device::Cpu)?;
        let value = x.as_tensor().detach().sqr()?;
        let y = with_gradient(x.as_tensor(), value.clone(), |x, g| {
            g.broadcast_mul(&x.ones_like()?.affine(3.0, 0.0)?)
        })?;
        let (got, want) = (y.to_vec1::<f32>()?, value.to_vec1::<f32>()?);
        assert!(
            got.iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits()),
            "{got:?}"
        );
        let w = Tensor::new(&[1f32, 2.0, 3.0, 4.0], &Device::Cpu)?;
        let grads = (y * w)?.sum_all()?.backward()?;
        assert_eq!(
            grads.get(&x).unwrap().to_vec1::<f32>()?,
            [3.0, 6.0, 9.0, 12.0]
        );
        // Nothing tracked: the value alone.
        let plain = Tensor::new(&[1f32], &Device::Cpu)?;
        let y = with_gradient(&plain, plain.exp()?, |_, g| Ok(g.clone()))?;
        assert!(!y.track_op());
        Ok(())
    }
}
