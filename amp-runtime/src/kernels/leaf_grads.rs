//! Gradients of variables handed straight to the gradient scaler's backward, past candle's
//! accumulation.
//!
//! candle's `backward` stores every gradient by allocating a zero tensor of its shape and adding
//! the gradient to it (`GradStore::or_insert`, then `add`), also for a variable used once: for
//! each weight, a memset and an add of the weight's size per step (a tenth of the `amp_recipe`
//! bf16 step's CPU time on 2 cores). While a [`Collect`] is alive on a thread (the scaler's
//! `ScaledLoss::backward` holds one around candle's `backward`), this crate's ops with their own
//! backward (half `Linear`, conv2d, the bias add, layer and batch norm, `Embedding`) give the gradients of their *variable*
//! operands to [`offer`] instead of returning them to candle: they are kept here (added together
//! when a variable feeds several such ops) and handed to the scaler when the backward ends, which adds any
//! gradient candle computed for the same variable through other ops. A variable's gradient is
//! never read during the backward (nothing is upstream of a leaf), so taking it out of candle's
//! store changes no other gradient. Without a collector (candle's own `loss.backward()`,
//! candle-nn's `backward_step`) the ops return their gradients to candle as before.
//!
//! [`wanted`], which `offer` goes through, is the other half: no gradient at all for an operand
//! that tracks nothing (data, a target, a frozen weight, an attention or dropout mask).

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::HashMap;

use candle_core::{Result, Tensor, TensorId};

thread_local! {
    /// One map per live collector, innermost last.
    static PENDING: RefCell<Vec<HashMap<TensorId, Tensor>>> = const { RefCell::new(Vec::new()) };
}

/// Collects the variables' gradients [`offer`]ed on this thread while it is alive.
pub(crate) struct Collect {
    /// The collector's depth on this thread's stack.
    depth: usize,
}

impl Collect {
    pub(crate) fn begin() -> Self {
        let depth = PENDING.with(|p| {
            let mut p = p.borrow_mut();
            p.push(HashMap::new());
            p.len()
        });
        Self { depth }
    }

    /// The gradients collected, by variable.
    pub(crate) fn finish(self) -> HashMap<TensorId, Tensor> {
        let map = PENDING.with(|p| {
            let mut p = p.borrow_mut();
            p.truncate(self.depth);
            p.pop().unwrap_or_default()
        });
        std::mem::forget(self);
        map
    }
}

impl Drop for Collect {
    /// A backward that failed drops what it collected.
    fn drop(&mut self) {
        PENDING.with(|p| p.borrow_mut().truncate(self.depth - 1));
    }
}

/// An op's gradient for `operand`, computed by `grad` only when candle's backward wants one:
/// when `operand` is a variable or was computed from one. candle records an op only when one of
/// its operands tracks, so an operand that does not (a batch of data, a frozen weight) never
/// leads to a variable; candle would still store whatever gradient the backward returns for it
/// (a zero tensor of its size plus an add) where nothing reads it, so none is computed. This is
/// how a first layer's input gradient, a full GEMM (or a col2im GEMM for a conv), is skipped,
/// as PyTorch skips it for a tensor that does not require grad. Every backward of this crate's
/// multi-operand ops goes through here (one-operand ops are recorded only when their operand
/// tracks).
///
/// The gradient comes back detached. A backward computed with candle's ops (off the CPU: the
/// cuBLAS pointwise conv's copies of its operands, casts, reshapes) records them as a graph,
/// and candle detaches a node's gradient only when it reaches the node: a variable's is never
/// reached, so its graph, with every buffer in it, lived in the gradient store until the
/// optimizer's step (on an H100, 2.5 GB more fp16 peak on ResNet-50 at batch 256). Gradients of
/// gradients are not supported (candle detaches the others too).
pub(crate) fn wanted(
    operand: &Tensor,
    grad: impl FnOnce() -> Result<Tensor>,
) -> Result<Option<Tensor>> {
    if operand.track_op() {
        grad().map(|g| Some(g.detach()))
    } else {
        Ok(None)
    }
}

/// The gradient of the operand `operand` from an op's backward, computed by `grad` if it is
/// [`wanted`]: `None` when it is not, or when it was kept for the collector (a variable, a
/// collector alive), `Some(grad)` to return to candle otherwise.
pub(crate) fn offer(
    operand: &Tensor,
    grad: impl FnOnce() -> Result<Tensor>,
) -> Result<Option<Tensor>> {
    let Some(grad) = wanted(operand, grad)? else {
        return Ok(None);
    };
    if !operand.is_variable() {
        return Ok(Some(grad));
    }
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        let Some(map) = p.last_mut() else {
            return Ok(Some(grad));
        };
        match map.entry(operand.id()) {
            Entry::Occupied(mut sum) => {
                let total = sum.get().add(&grad)?;
                sum.insert(total);
            }
            Entry::Vacant(slot) => {
                slot.insert(grad);
            }
        }
        Ok(None)
    })
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    #[test]
    fn variables_are_kept_and_summed_only_while_collecting() -> Result<()> {
        let dev = Device::Cpu;
        let w = Var::new(&[1f32, 2.0], &dev)?;
        // Computed from a variable: wants a gradient, and is not one.
        let t = (w.as_tensor() * 2.0)?;
        let g = || Tensor::new(&[0.5f32, -1.0], &dev);
        assert!(offer(&w, g)?.is_some(), "no collector: back to candle");
        let collect = Collect::begin();
        assert!(offer(&w, g)?.is_none());
        assert!(offer(&w, g)?.is_none());
        assert!(offer(&t, g)?.is_some(), "not a variable: back to candle");
        let map = collect.finish();
        assert_eq!(map[&w.id()].to_vec1::<f32>()?, [1.0, -2.0]);
        assert!(offer(&w, g)?.is_some(), "collector finished");
        // A collector dropped without finishing (a failed backward) leaves nothing behind.
        let outer = Collect::begin();
        drop(Collect::begin());
        assert!(offer(&w, g)?.is_none(), "the outer one collects again");
        assert_eq!(outer.finish().len(), 1);
        Ok(())
    }

    /// A gradient computed with candle's ops comes back without their graph: nothing of its
    /// computation is kept alive by the gradient store.
    #[test]
    fn gradients_come_back_detached() -> Result<()> {
        let w = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let computed = || w.as_tensor() * 2.0;
        assert!(computed()?.track_op(), "the computation records a graph");
        let g = wanted(&w, computed)?.expect("a variable wants its gradient");
        assert!(!g.track_op(), "the gradient holds no graph");
        assert_eq!(g.to_vec1::<f32>()?, [2.0, 4.0]);
        Ok(())
    }

    /// A tensor that is neither a variable nor computed from one (data, a frozen weight) gets
    /// no gradient, and the function that would compute it is not called.
    #[test]
    fn an_operand_that_tracks_nothing_gets_no_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let data = Tensor::new(&[1f32, 2.0], &dev)?;
        let frozen = (&data * 2.0)?;
        let never = || -> Result<Tensor> { panic!("computed a gradient nobody wants") };
        assert!(wanted(&data, never)?.is_none());
        assert!(wanted(&frozen, never)?.is_none());
        let _collect = Collect::begin();
        assert!(offer(&data, never)?.is_none());
        let w = Var::new(&[1f32, 2.0], &dev)?;
        assert!(wanted(&w, || Ok(data.clone()))?.is_some());
        assert!(wanted(&(w.as_tensor() + 1.0)?, || Ok(data.clone()))?.is_some());
        Ok(())
    }
}
