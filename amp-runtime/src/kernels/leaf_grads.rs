//! Gradients of variables handed straight to the gradient scaler's backward, past candle's
//! accumulation.
//!
//! candle's `backward` stores every gradient by allocating a zero tensor of its shape and adding
//! the gradient to it (`GradStore::or_insert`, then `add`), also for a variable used once: for
//! each weight, a memset and an add of the weight's size per step (a tenth of the `amp_recipe`
//! bf16 step's CPU time on 2 cores). While a [`Collect`] is alive on a thread (the scaler's
//! `ScaledLoss::backward` holds one around candle's `backward`), this crate's ops with their own
//! backward (half `Linear`, conv2d) give the gradients of their *variable* operands to [`offer`]
//! instead of returning them to candle: they are kept here (added together when a variable
//! feeds several such ops) and handed to the scaler when the backward ends, which adds any
//! gradient candle computed for the same variable through other ops. A variable's gradient is
//! never read during the backward (nothing is upstream of a leaf), so taking it out of candle's
//! store changes no other gradient. Without a collector (candle's own `loss.backward()`,
//! candle-nn's `backward_step`) the ops return their gradients to candle as before.

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

/// The gradient `grad` of the operand `operand`, from an op's backward: `None` when it was kept
/// for the collector (a variable, a collector alive), `Some(grad)` to return to candle otherwise.
pub(crate) fn offer(operand: &Tensor, grad: Tensor) -> Result<Option<Tensor>> {
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
        let t = Tensor::new(&[1f32, 2.0], &dev)?;
        let g = || Tensor::new(&[0.5f32, -1.0], &dev);
        assert!(offer(&w, g()?)?.is_some(), "no collector: back to candle");
        let collect = Collect::begin();
        assert!(offer(&w, g()?)?.is_none());
        assert!(offer(&w, g()?)?.is_none());
        assert!(offer(&t, g()?)?.is_some(), "not a variable: back to candle");
        let map = collect.finish();
        assert_eq!(map[&w.id()].to_vec1::<f32>()?, [1.0, -2.0]);
        assert!(offer(&w, g()?)?.is_some(), "collector finished");
        // A collector dropped without finishing (a failed backward) leaves nothing behind.
        let outer = Collect::begin();
        drop(Collect::begin());
        assert!(offer(&w, g()?)?.is_none(), "the outer one collects again");
        assert_eq!(outer.finish().len(), 1);
        Ok(())
    }
}
