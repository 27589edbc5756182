//! Gradients in their two states: scaled (straight out of `backward`) and unscaled (checked for
//! non-finite values, safe to clip and step). The types make PyTorch's run-time errors
//! ("unscale_() has already been called", clipping scaled gradients) compile errors.

use std::collections::HashSet;

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, TensorId, Var};

use super::state::ScalerError;
use super::GradScaler;
use crate::distributed::DataParallel;
use crate::kernels::leaf_grads;
use crate::kernels::unscale::unscale_in_place;

/// The gradients of the `Var`s a loss depends on, in the variables' creation order
/// ([`creation_order`]): the order a model's constructor made its parameters, PyTorch's
/// `model.parameters()` order. It does not depend on the order the forward used them in, so
/// replicas of one model list the same parameters in the same order (data parallelism pairs
/// gradients by position), and reductions over them (a norm) are reproducible.
#[derive(Debug)]
struct GradSet {
    store: GradStore,
    ids: Vec<TensorId>,
}

impl GradSet {
    /// Runs `loss.backward()` and keeps the gradients of variables only: candle's store also
    /// holds gradients of constant inputs, which no optimizer reads and which must not decide
    /// whether a step is skipped. The variables' gradients that this crate's ops hand over
    /// directly (`kernels::leaf_grads`, sparing candle's zeros-and-add per gradient) join them,
    /// added to what candle computed for the same variable, if anything.
    fn backward(loss: &Tensor) -> Result<Self> {
        let collect = leaf_grads::Collect::begin();
        let mut all = loss.backward()?;
        let mut direct = collect.finish();
        let mut store = GradStore::default();
        let mut ids = Vec::new();
        for node in loss.sorted_nodes() {
            if node.is_variable() {
                let grad = match (all.remove(node), direct.remove(&node.id())) {
                    (Some(a), Some(b)) => Some(a.add(&b)?),
                    (a, b) => a.or(b),
                };
                if let Some(grad) = grad {
                    store.insert(node, grad);
                    ids.push(node.id());
                }
            }
        }
        if ids.is_empty() {
            return Err(ScalerError::NoGradients.into());
        }
        ids.sort_by_cached_key(|&id| creation_order(id));
        Ok(Self { store, ids })
    }

    fn get(&self, var: &Tensor) -> Option<&Tensor> {
        self.store.get(var)
    }

    fn grad(&self, id: TensorId) -> &Tensor {
        self.store.get_id(id).expect("ids and store agree")
    }

    /// Handles to the gradients, in order (sharing their storage, for in-place passes that
    /// may replace some of them; `put_back` stores the results).
    fn tensors(&self) -> Vec<Tensor> {
        self.ids.iter().map(|&id| self.grad(id).clone()).collect()
    }

    fn put_back(&mut self, grads: Vec<Tensor>) {
        for (&id, grad) in self.ids.iter().zip(grads) {
            self.store.insert_id(id, grad);
        }
    }

    fn split_off(&mut self, vars: &[Var]) -> Self {
        // GradStore removes by tensor, not by id: rebuild both halves.
        let wanted: HashSet<TensorId> = vars.iter().map(|v| v.id()).collect();
        let (moved, kept): (Vec<TensorId>, Vec<TensorId>) =
            self.ids.iter().partition(|id| wanted.contains(id));
        let subset = |ids: Vec<TensorId>| {
            let mut store = GradStore::default();
            for &id in &ids {
                store.insert_id(id, self.grad(id).clone());
            }
            Self { store, ids }
        };
        let (moved, kept) = (subset(moved), subset(kept));
        *self = kept;
        moved
    }

    fn all_reduce(&mut self, dp: &DataParallel) -> Result<()> {
        let mut grads = self.tensors();
        dp.all_reduce(&mut grads)?;
        self.put_back(grads);
        Ok(())
    }

    fn accumulate(&mut self, other: Self) -> Result<()> {
        for &id in &other.ids {
            let grad = other.grad(id);
            let sum = if let Some(sum) = self.store.get_id(id) {
                sum.add(grad)?
            } else {
                self.ids.push(id);
                grad.clone()
            };
            self.store.insert_id(id, sum);
        }
        self.ids.sort_by_cached_key(|&id| creation_order(id));
        Ok(())
    }
}

/// Where a variable stands in the order tensors were made: candle numbers every tensor from one
/// process-wide counter as it makes it, and a replica built by the same code makes its
/// parameters in the same order, whatever other tensors are made in between (other threads'
/// replicas included). `TensorId` hides the number (no `Ord`) but prints it, `TensorId(17)`;
/// should that ever change, the key is the same for every id and the order the one found
/// (the test below fails first).
fn creation_order(id: TensorId) -> u64 {
    let printed = format!("{id:?}");
    printed
        .trim_start_matches("TensorId(")
        .trim_end_matches(')')
        .parse()
        .unwrap_or(u64::MAX)
}

/// Gradients of a scaled loss: every value is multiplied by the scale that
/// [`GradScaler::scale`] used. Unscale them ([`GradScaler::unscale`]) to clip or inspect them,
/// or hand them straight to [`GradScaler::step`], which unscales.
///
/// Holds the gradients of the `Var`s the loss depends on. Combine micro-batches with
/// [`accumulate`](Self::accumulate); give each optimizer its own gradients (and so its own skip
/// decision) with [`split_off`](Self::split_off).
#[derive(Debug)]
pub struct ScaledGrads {
    set: GradSet,
    /// The scale the loss was multiplied by; `None` when the scaler was disabled.
    scale: Option<f32>,
}

impl ScaledGrads {
    pub(super) fn backward(loss: &Tensor, scale: Option<f32>) -> Result<Self> {
        Ok(Self {
            set: GradSet::backward(loss)?,
            scale,
        })
    }

    /// The (scaled) gradient of `var`, if the loss depends on it.
    pub fn get(&self, var: &Tensor) -> Option<&Tensor> {
        self.set.get(var)
    }

    /// The scale these gradients carry (1 when the scaler was disabled).
    pub fn scale(&self) -> f32 {
        self.scale.unwrap_or(1.0)
    }

    /// The scale the loss was multiplied by, `None` from a disabled scaler.
    pub(super) fn carried_scale(&self) -> Option<f32> {
        self.scale
    }

    /// Adds the gradients of another micro-batch (gradient accumulation, PyTorch's repeated
    /// `scaler.scale(loss).backward()` between steps). Both must carry the same scale: calling
    /// `update()` between micro-batches is an error, as it would mix two scales.
    pub fn accumulate(&mut self, other: ScaledGrads) -> Result<()> {
        if self.scale.map(f32::to_bits) != other.scale.map(f32::to_bits) {
            return Err(ScalerError::Mismatch(format!(
                "cannot accumulate gradients scaled by {} into gradients scaled by {}; \
                 call update() only after the optimizer step",
                other.scale(),
                self.scale()
            ))
            .into());
        }
        self.set.accumulate(other.set)
    }

    /// Moves the gradients of `vars` (an optimizer's parameters) into a new set, so that each
    /// optimizer is skipped only for non-finite values in its own gradients, as in PyTorch.
    pub fn split_off(&mut self, vars: &[Var]) -> ScaledGrads {
        ScaledGrads {
            set: self.set.split_off(vars),
            scale: self.scale,
        }
    }

    /// Replaces each gradient by its mean over the ranks of `dp` (data parallel; every rank
    /// calls it with the gradients of the same parameters, see [`crate::distributed`]). Still
    /// scaled: the ranks' scalers hold the same scale when they started from the same state.
    pub fn all_reduce(&mut self, dp: &DataParallel) -> Result<()> {
        self.set.all_reduce(dp)
    }

    /// Unscales in place with the fused kernel and records which gradients were non-finite.
    /// Unscaled by the scaler `by` ([`ScalerIdentity`]).
    pub(super) fn unscale(mut self, by: ScalerIdentity) -> Result<UnscaledGrads> {
        let mut nonfinite = HashSet::new();
        if let Some(scale) = self.scale {
            let inv_scale = (1.0 / f64::from(scale)) as f32;
            let mut grads = self.set.tensors();
            if grads.iter().any(|g| g.dtype() == DType::F16) {
                // PyTorch's rule: an unscaled f16 gradient underflows where the scaled one did
                // not, the loss of precision scaling exists to avoid.
                return Err(ScalerError::Mismatch(
                    "f16 parameters' gradients cannot be unscaled (PyTorch: \"Attempting to \
                     unscale FP16 gradients\"): keep f32 master weights and let the region \
                     run the ops in f16"
                        .to_string(),
                )
                .into());
            }
            let found = unscale_in_place(&mut grads, inv_scale)?;
            self.set.put_back(grads);
            for (&id, found) in self.set.ids.iter().zip(found) {
                if found {
                    nonfinite.insert(id);
                }
            }
        }
        Ok(UnscaledGrads {
            set: self.set,
            nonfinite,
            elsewhere: false,
            checked: self.scale.is_some(),
            by,
        })
    }
}

/// Unscaled gradients, checked for inf and NaN: the state in which clipping, inspecting and
/// stepping are meaningful. Produced by [`GradScaler::unscale`], consumed by
/// [`GradScaler::step`]; the non-finite check was recorded at unscale time, so clipping
/// afterwards does not change whether the step is skipped (as in PyTorch).
#[derive(Debug)]
pub struct UnscaledGrads {
    set: GradSet,
    nonfinite: HashSet<TensorId>,
    /// Another rank of the scaler's collective found inf or NaN in its gradients.
    elsewhere: bool,
    /// The gradients were checked (an enabled scaler's); a disabled scaler steps whatever
    /// they hold, as PyTorch's.
    checked: bool,
    /// The scaler that unscaled them, whose `update()` saw their check: only it steps them.
    by: ScalerIdentity,
}

impl UnscaledGrads {
    /// The gradient of `var`, if the loss depends on it.
    pub fn get(&self, var: &Tensor) -> Option<&Tensor> {
        self.set.get(var)
    }

    /// Whether any gradient held inf or NaN before unscaling (here, or on another rank of the
    /// scaler's collective): the step will be skipped.
    pub fn found_inf(&self) -> bool {
        !self.nonfinite.is_empty() || self.elsewhere
    }

    /// Records that another rank found inf or NaN: this rank skips the step too.
    pub(super) fn found_elsewhere(&mut self) {
        self.elsewhere = true;
    }

    /// Replaces each gradient by its mean over the ranks of `dp`, as
    /// [`ScaledGrads::all_reduce`]. A gradient whose mean is not finite (inf or NaN on any
    /// rank) joins the non-finite record, the same on every rank since every rank gets the
    /// same mean: the ranks skip the step together even when the scaler has no collective
    /// (PyTorch's DDP reduces before `unscale_`, where the check then sees every rank's
    /// values). Before, a rank whose own gradients were finite stepped with the NaN mean.
    pub fn all_reduce(&mut self, dp: &DataParallel) -> Result<()> {
        self.set.all_reduce(dp)?;
        if !self.checked {
            return Ok(());
        }
        let mut grads = self.set.tensors();
        // A multiplication by 1 changes no value: the fused pass's check alone.
        let found = unscale_in_place(&mut grads, 1.0)?;
        for (&id, found) in self.set.ids.iter().zip(found) {
            if found {
                self.nonfinite.insert(id);
            }
        }
        Ok(())
    }

    /// Whether there are gradients and every element of every one is exactly 0 (a reduction per
    /// gradient: the scaler asks only when the loss scale is below 1).
    pub(super) fn all_zero(&self) -> Result<bool> {
        let tensors = self.set.tensors();
        for t in &tensors {
            let largest = t
                .abs()?
                .max_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_scalar::<f32>()?;
            if largest > 0.0 {
                return Ok(false);
            }
        }
        Ok(!tensors.is_empty())
    }

    /// The ids of the variables whose gradients held inf or NaN.
    pub(super) fn nonfinite_ids(&self) -> Vec<candle_core::TensorId> {
        self.nonfinite.iter().copied().collect()
    }

    /// The gradients as candle's store, e.g. for an optimizer driven by hand.
    pub fn grad_store(&self) -> &GradStore {
        &self.set.store
    }

    /// Like [`ScaledGrads::split_off`], keeping each gradient's non-finite record.
    pub fn split_off(&mut self, vars: &[Var]) -> UnscaledGrads {
        let set = self.set.split_off(vars);
        let nonfinite = set
            .ids
            .iter()
            .filter(|id| self.nonfinite.remove(id))
            .copied()
            .collect();
        UnscaledGrads {
            set,
            nonfinite,
            elsewhere: self.elsewhere,
            checked: self.checked,
            by: self.by.copied(),
        }
    }

    /// Scales all gradients so that their joint L2 norm is at most `max_norm`, like
    /// `torch.nn.utils.clip_grad_norm_`, and returns the norm before clipping.
    ///
    /// The norm is accumulated in f64 over the gradients in their variables' creation order; the coefficient
    /// `max_norm / (norm + 1e-6)` is applied in place when below 1. With non-finite gradients
    /// the norm is inf or NaN, as in PyTorch; the step is skipped anyway. `max_norm = inf`
    /// clips nothing and returns the norm, as in PyTorch (a way to measure it).
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        if max_norm.is_nan() || max_norm < 0.0 {
            return Err(ScalerError::Invalid {
                field: "max_norm",
                reason: format!("must be a number >= 0 (inf clips nothing), got {max_norm}"),
            }
            .into());
        }
        let mut sum_sq = 0.0f64;
        for &id in &self.set.ids {
            let grad = self.set.grad(id);
            sum_sq += grad
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
        let total = sum_sq.sqrt();
        let coef = (max_norm / (total + 1e-6)) as f32;
        // A NaN norm scales too (by NaN), as PyTorch's clamp would.
        if coef < 1.0 || coef.is_nan() {
            let mut grads = self.set.tensors();
            unscale_in_place(&mut grads, coef)?;
            self.set.put_back(grads);
        }
        Ok(total)
    }

    /// Clamps every gradient element to `[-clip_value, clip_value]`, like
    /// `torch.nn.utils.clip_grad_value_` (`inf` clamps nothing, as there).
    pub fn clip_grad_value(&mut self, clip_value: f64) -> Result<()> {
        if clip_value.is_nan() || clip_value < 0.0 {
            return Err(ScalerError::Invalid {
                field: "clip_value",
                reason: format!("must be a number >= 0 (inf clamps nothing), got {clip_value}"),
            }
            .into());
        }
        let grads = self.set.tensors();
        let clamped = grads
            .iter()
            .map(|g| g.clamp(-clip_value, clip_value))
            .collect::<Result<Vec<_>>>()?;
        self.set.put_back(clamped);
        Ok(())
    }
}

/// Gradients [`GradScaler::step`] accepts: [`ScaledGrads`] (unscaled inside `step`) or
/// [`UnscaledGrads`] (already checked). Sealed.
pub trait Gradients: sealed::Sealed {
    #[doc(hidden)]
    fn into_unscaled(self, scaler: &mut GradScaler) -> Result<UnscaledGrads>;
}

impl Gradients for ScaledGrads {
    fn into_unscaled(self, scaler: &mut GradScaler) -> Result<UnscaledGrads> {
        scaler.unscale(self)
    }
}

impl Gradients for UnscaledGrads {
    /// Only the scaler that unscaled them steps them (a disabled one steps any, as the
    /// optimizer alone would): another's `update()` would not see their check, and its scale
    /// would never move.
    fn into_unscaled(self, scaler: &mut GradScaler) -> Result<UnscaledGrads> {
        if scaler.is_enabled() && &self.by != scaler.identity() {
            return Err(ScalerError::Mismatch(
                "these gradients were unscaled by another GradScaler: step them with the scaler \
                 whose unscale() made them, which recorded their inf/NaN check for its update()"
                    .to_string(),
            )
            .into());
        }
        Ok(self)
    }
}

/// Which [`GradScaler`] unscaled a set of gradients: a number of its own, fresh for every
/// scaler built and every clone of one.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct ScalerIdentity(u64);

impl ScalerIdentity {
    pub(super) fn fresh() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Self(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// The same identity (gradients keep their scaler's; a scaler's clone gets a fresh one).
    pub(super) fn copied(&self) -> Self {
        Self(self.0)
    }
}

impl Clone for ScalerIdentity {
    /// A clone of a scaler is another scaler.
    fn clone(&self) -> Self {
        Self::fresh()
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::ScaledGrads {}
    impl Sealed for super::UnscaledGrads {}
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::creation_order;

    /// Tensors made later come later, whatever is made in between: what pairs replicas'
    /// parameters (and what fails first should candle stop printing its ids as numbers).
    #[test]
    fn creation_order_follows_the_order_tensors_are_made() -> candle_core::Result<()> {
        let a = Var::new(&[1f32], &Device::Cpu)?;
        let between = (a.as_tensor() * 2.0)?;
        let b = Var::new(&[1f32], &Device::Cpu)?;
        let keys = [a.id(), between.id(), b.id()].map(creation_order);
        assert!(keys[0] < keys[1] && keys[1] < keys[2], "{keys:?}");
        assert_ne!(keys[2], u64::MAX);
        Ok(())
    }
}
