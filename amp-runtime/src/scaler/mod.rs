//! Dynamic loss scaling with PyTorch's `torch.amp.GradScaler` semantics, number for number,
//! behind a typestate API.
//!
//! ```no_run
//! # use amp_runtime::{GradScaler, Tensor, F32};
//! # use candle_nn::Optimizer;
//! # fn demo(mut opt: candle_nn::SGD, losses: Vec<Tensor<F32>>) -> candle_core::Result<()> {
//! let mut scaler = GradScaler::new();
//! for loss in losses {
//!     let grads = scaler.scale(&loss)?.backward()?; // ScaledGrads
//!     let mut grads = scaler.unscale(grads)?;       // UnscaledGrads: clipping lives here
//!     grads.clip_grad_norm(1.0)?;
//!     let outcome = scaler.step(&mut opt, grads)?;  // skipped on inf/NaN, weights untouched
//!     scaler.update();
//!     if outcome.is_skipped() { /* e.g. log it */ }
//! }
//! # Ok(()) }
//! ```
//!
//! What PyTorch checks at run time is a type error here: `unscale` and `step` consume the
//! gradients (unscaling or stepping twice is a use of a moved value), clipping exists only on
//! [`UnscaledGrads`], and the [`StepOutcome`] must be used.

mod grads;
mod state;

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use candle_nn::Optimizer;

pub use grads::{Gradients, ScaledGrads, UnscaledGrads};
pub use state::{ScalerError, ScalerState};

use grads::ScalerIdentity;
use state::{invalid_scale, is_valid_scale};

use crate::distributed::Collective;
use crate::precision::Precision;

/// `tracing` target of the scaler's events (skipped steps, scale changes).
pub const TRACING_TARGET: &str = "candle_amp::grad_scaler";

/// Dynamic loss scaler: PyTorch's `GradScaler` (see the [module docs](self)).
///
/// The scale is an f32. Each iteration: [`scale`](Self::scale) the loss, `backward()` it,
/// optionally [`unscale`](Self::unscale) to clip, [`step`](Self::step) each optimizer,
/// [`update`](Self::update) once. After a step with inf/NaN gradients the scale is multiplied
/// by `backoff_factor`; after `growth_interval` finite steps in a row by `growth_factor`
/// (unless that would overflow f32).
///
/// Gradients belong to one scaler: those its `scale()` made are unscaled by it, and those its
/// `unscale()` made are stepped by it (a clone is another scaler); another's are an error.
#[derive(Clone, Debug)]
pub struct GradScaler {
    state: ScalerState,
    enabled: bool,
    /// Whether a non-finite gradient was seen since the last `update()`; `None` until an
    /// unscale or step records a check.
    found_inf: Option<bool>,
    /// Updates in a row that found inf/NaN (not checkpointed: it only words an error).
    consecutive_skips: u64,
    /// The variables whose gradients were non-finite at the last skipped step.
    last_nonfinite: Vec<candle_core::TensorId>,
    /// The data-parallel group whose ranks skip or step together.
    collective: Option<Arc<dyn Collective>>,
    /// The optimizers stepped since the last `update()`: a second step of one before it is
    /// an error, as PyTorch's. candle-amp's optimizers are told apart by an identity of their
    /// own ([`crate::optim::identify`]); others by their address, which a move changes and a
    /// new optimizer in a dropped one's place may share.
    stepped: Vec<Stepped>,
    /// Tells its [`UnscaledGrads`] from another scaler's.
    identity: ScalerIdentity,
}

impl Default for GradScaler {
    fn default() -> Self {
        Self::new()
    }
}

/// An optimizer [`GradScaler::step`] has stepped (see `GradScaler::stepped`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stepped {
    Own(u64),
    Address(usize),
}

/// Whether [`GradScaler::step`] ran the optimizer.
#[must_use = "a skipped step leaves the weights unchanged; check it or bind it to `_`"]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOutcome {
    /// The gradients were finite; the optimizer stepped.
    Stepped,
    /// Some gradient held inf or NaN; the optimizer did not run and the weights are untouched.
    Skipped,
}

impl StepOutcome {
    pub fn is_skipped(self) -> bool {
        self == Self::Skipped
    }

    pub fn is_stepped(self) -> bool {
        self == Self::Stepped
    }
}

/// A loss multiplied by the scale, as an f32 tensor (an f16 loss times 65536 would overflow).
#[derive(Clone, Debug)]
pub struct ScaledLoss {
    tensor: Tensor,
    scale: Option<f32>,
}

impl ScaledLoss {
    /// Backpropagates the scaled loss; the gradients come back scaled.
    pub fn backward(&self) -> Result<ScaledGrads> {
        ScaledGrads::backward(&self.tensor, self.scale)
    }

    /// The scaled loss tensor (f32; the loss itself when the scaler is disabled).
    pub fn as_tensor(&self) -> &Tensor {
        &self.tensor
    }
}

/// A loss [`GradScaler::scale`] accepts: a typed [`Tensor<P>`](crate::Tensor) of any precision,
/// or a plain candle tensor.
pub trait Loss {
    fn loss_tensor(&self) -> &Tensor;
}

impl<P: Precision> Loss for crate::tensor::Tensor<P> {
    fn loss_tensor(&self) -> &Tensor {
        self.as_candle()
    }
}

impl Loss for Tensor {
    fn loss_tensor(&self) -> &Tensor {
        self
    }
}

impl GradScaler {
    /// A scaler with PyTorch's defaults: init_scale 65536, growth_factor 2, backoff_factor
    /// 0.5, growth_interval 2000, enabled.
    ///
    /// # Panics
    /// Never: the defaults pass the builder's checks.
    pub fn new() -> Self {
        Self::builder()
            .build()
            .expect("the default configuration is valid")
    }

    /// A builder starting from the defaults of [`new`](Self::new).
    pub fn builder() -> GradScalerBuilder {
        GradScalerBuilder::default()
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Which scaler this is, for the gradients it unscales.
    fn identity(&self) -> &ScalerIdentity {
        &self.identity
    }

    /// The current scale (1 when disabled, as PyTorch's `get_scale()`).
    pub fn scale_value(&self) -> f32 {
        if self.enabled {
            self.state.scale
        } else {
            1.0
        }
    }

    /// Consecutive finite steps since the scale last changed (0 when disabled).
    pub fn growth_tracker(&self) -> u32 {
        if self.enabled {
            self.state.growth_tracker
        } else {
            0
        }
    }

    /// The names, in `vars`, of the parameters whose gradients held inf or NaN at the last
    /// skipped [`step`](Self::step) (sorted; empty before any skip). With the finite check on
    /// ([`crate::report::set_check_finite`]), [`crate::report::first_nonfinite`] says which op
    /// of the forward made the first one.
    pub fn nonfinite_params(&self, vars: &candle_nn::VarMap) -> Vec<String> {
        let data = vars
            .data()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut names: Vec<String> = data
            .iter()
            .filter(|(_, v)| self.last_nonfinite.contains(&v.as_tensor().id()))
            .map(|(name, _)| name.clone())
            .collect();
        names.sort();
        names
    }

    /// Steps skipped because of non-finite gradients since the scaler was built (or the count
    /// stored in a loaded state).
    pub fn skipped_steps(&self) -> u64 {
        self.state.skipped_steps
    }

    /// Multiplies the loss by the scale, in f32. Disabled: the loss itself, untouched.
    ///
    /// The loss must be a single value (any shape of one element): a loss of several values
    /// is an error, as in PyTorch's `backward`, never silently summed.
    pub fn scale(&self, loss: &impl Loss) -> Result<ScaledLoss> {
        let loss = loss.loss_tensor();
        if loss.elem_count() != 1 {
            return Err(ScalerError::NotScalarLoss(loss.dims().to_vec()).into());
        }
        if !loss.dtype().is_float() {
            return Err(ScalerError::NotFloatLoss(loss.dtype()).into());
        }
        if !self.enabled {
            return Ok(ScaledLoss {
                tensor: loss.clone(),
                scale: None,
            });
        }
        let scale = self.state.scale;
        Ok(ScaledLoss {
            tensor: loss.to_dtype(DType::F32)?.affine(f64::from(scale), 0.0)?,
            scale: Some(scale),
        })
    }

    /// Divides the gradients by the scale they carry, in place, in one fused pass, and records
    /// whether any was inf or NaN (for [`step`](Self::step) and [`update`](Self::update)).
    /// `inv_scale` is `1/scale` computed in f64 and rounded to f32, as in PyTorch.
    ///
    /// The gradients must carry this scaler's current scale (or none, from a disabled scaler,
    /// when this one is disabled too): gradients of another scaler's loss, or of a disabled
    /// scaler's, would be unscaled by the wrong factor or not checked at all.
    pub fn unscale(&mut self, grads: ScaledGrads) -> Result<UnscaledGrads> {
        let expected = self.enabled.then_some(self.state.scale);
        if grads.carried_scale().map(f32::to_bits) != expected.map(f32::to_bits) {
            let said = |s: Option<f32>| {
                s.map_or("no scale (a disabled scaler)".into(), |s| {
                    format!("scale {s}")
                })
            };
            return Err(ScalerError::Mismatch(format!(
                "these gradients carry {} but this scaler has {}: unscale and step gradients \
                 with the scaler whose scale() made their loss, before its update()",
                said(grads.carried_scale()),
                said(expected)
            ))
            .into());
        }
        let mut unscaled = grads.unscale(self.identity.copied())?;
        if let (true, Some(group)) = (self.enabled, &self.collective) {
            if crate::distributed::any_rank(group.as_ref(), unscaled.found_inf())? {
                unscaled.found_elsewhere();
            }
        }
        if self.enabled {
            self.found_inf = Some(self.found_inf.unwrap_or(false) | unscaled.found_inf());
        }
        Ok(unscaled)
    }

    /// Runs `opt.step` unless the gradients hold inf or NaN; unscales first if given
    /// [`ScaledGrads`]. A skipped step leaves the weights bit for bit as they were, counts in
    /// [`skipped_steps`](Self::skipped_steps) and emits a `tracing` warning. Disabled: always
    /// steps.
    ///
    /// # Errors
    /// [`ScalerError::ScaleCollapsed`] when the scale is below 1 and every gradient is exactly
    /// 0: the scale has backed off until the half-precision gradients underflow, and the step
    /// would change nothing (PyTorch reports it as taken).
    pub fn step<O: Optimizer, G: Gradients>(
        &mut self,
        opt: &mut O,
        grads: G,
    ) -> Result<StepOutcome> {
        let id = match crate::optim::identify(opt) {
            Some(id) => Stepped::Own(id),
            None => Stepped::Address(std::ptr::from_mut(opt).cast::<()>() as usize),
        };
        // A disabled scaler steps as the optimizer alone would, as PyTorch's.
        if self.enabled && self.stepped.contains(&id) {
            return Err(ScalerError::Mismatch(
                "this optimizer has already stepped since the last update() (PyTorch: \
                 \"step() has already been called since the last update()\"): call update() \
                 once per iteration, after every optimizer's step"
                    .to_string(),
            )
            .into());
        }
        let grads = grads.into_unscaled(self)?;
        if self.enabled {
            self.stepped.push(id);
        }
        if grads.found_inf() {
            // Also found after the unscale (a mean over the ranks that is not finite): the
            // update backs off for it too.
            self.found_inf = Some(true);
            self.last_nonfinite = grads.nonfinite_ids();
            self.state.skipped_steps = self.state.skipped_steps.saturating_add(1);
            tracing::warn!(
                target: TRACING_TARGET,
                scale = self.state.scale,
                skipped_steps = self.state.skipped_steps,
                "non-finite gradients: optimizer step skipped"
            );
            return Ok(StepOutcome::Skipped);
        }
        // PyTorch steps here too, and the weights stay where they are: a run whose scale fell
        // below 1 (after many non-finite steps) then trains on nothing without a word.
        if self.enabled && self.state.scale < 1.0 && grads.all_zero()? {
            return Err(ScalerError::ScaleCollapsed {
                scale: self.state.scale,
                skipped_steps: self.state.skipped_steps,
            }
            .into());
        }
        let mut step = || opt.step(grads.grad_store());
        if self.enabled {
            crate::optim::for_scaler(step)?;
        } else {
            step()?;
        }
        // The masters changed in place: no cast of their old values may be reused.
        crate::cast::clear_autocast_cache();
        Ok(StepOutcome::Stepped)
    }

    /// Updates the scale from the checks recorded since the last update (PyTorch's rule):
    /// any inf/NaN backs off and resets the tracker; otherwise the tracker counts up and the
    /// scale grows when it reaches `growth_interval`. Call once per iteration, after every
    /// optimizer's step.
    ///
    /// Without a recorded check (no unscale or step since the last update) the scale is left
    /// as it is and a warning is emitted; PyTorch raises an error there.
    ///
    /// # Errors
    /// [`ScalerError::ScaleUnderflow`] when backing off would take the scale below the
    /// smallest normal f32 (after ~150 skipped steps in a row from the default 65536, or at
    /// once with an extreme `backoff_factor`). The scale stays where it was. PyTorch goes on
    /// backing off to subnormals and 0, where `1/scale` is inf and unscaling writes NaN into
    /// zero gradients, then a zero scale that zeroes every gradient, and reports each of those
    /// steps as taken; here the run stops with an error that says the gradients are non-finite
    /// at any scale. A `tracing` error event carries the same.
    pub fn update(&mut self) -> Result<()> {
        self.stepped.clear();
        if !self.enabled {
            return Ok(());
        }
        let Some(found_inf) = self.found_inf.take() else {
            tracing::warn!(
                target: TRACING_TARGET,
                "update() without an unscale or step since the last update: scale unchanged"
            );
            return Ok(());
        };
        self.consecutive_skips = if found_inf {
            self.consecutive_skips + 1
        } else {
            0
        };
        let before = self.state.scale;
        if !self.state.advance(found_inf) {
            let err = ScalerError::ScaleUnderflow {
                scale: before,
                backoff_factor: self.state.backoff_factor,
                consecutive_skips: self.consecutive_skips,
            };
            tracing::error!(
                target: TRACING_TARGET,
                scale = before,
                consecutive_skips = self.consecutive_skips,
                "{err}"
            );
            return Err(err.into());
        }
        if self.state.scale.to_bits() != before.to_bits() {
            tracing::info!(
                target: TRACING_TARGET,
                old_scale = before,
                new_scale = self.state.scale,
                found_inf,
                "loss scale changed"
            );
        }
        Ok(())
    }

    /// The state to checkpoint (see [`ScalerState`]).
    pub fn state(&self) -> ScalerState {
        ScalerState {
            enabled: self.enabled,
            ..self.state.clone()
        }
    }

    /// Restores a checkpointed state after validating it; on error the scaler is unchanged.
    /// Checks recorded since the last update are discarded. An enabled scaler refuses the state
    /// of a disabled one, as PyTorch does: that scaler never scaled, and its scale would start
    /// this run at the default as if it continued one.
    pub fn load_state(&mut self, state: ScalerState) -> Result<()> {
        state.validate()?;
        if self.enabled && !state.enabled {
            candle_core::bail!(
                "GradScaler::load_state: the state was saved from a disabled GradScaler, which \
                 holds no loss scale to continue from (PyTorch: \"The source state dict is \
                 empty, possibly because it was saved from a disabled instance of \
                 GradScaler\"); build this scaler with `enabled(false)` too, or do not load \
                 the state"
            )
        }
        self.state = state;
        self.found_inf = None;
        self.consecutive_skips = 0;
        Ok(())
    }
}

/// Configures a [`GradScaler`]; `build` validates (growth_factor >= 1 + 2^-23, backoff_factor
/// in (0, 1 - 2^-23]: PyTorch's > 1 and < 1, kept far enough from 1 to move every f32 scale;
/// growth_interval >= 1, init_scale and the bounds finite normal positive f32s, bounds
/// consistent).
#[derive(Clone, Debug)]
pub struct GradScalerBuilder {
    init_scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u32,
    enabled: bool,
    min_scale: Option<f64>,
    max_scale: Option<f64>,
    collective: Option<Arc<dyn Collective>>,
}

impl Default for GradScalerBuilder {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
            min_scale: None,
            max_scale: None,
            collective: None,
        }
    }
}

impl GradScalerBuilder {
    /// Initial scale (65536); stored as an f32, so 1e38 becomes 9.9999997e37.
    pub fn init_scale(mut self, init_scale: f64) -> Self {
        self.init_scale = init_scale;
        self
    }

    /// Growth factor (2, must be > 1).
    pub fn growth_factor(mut self, growth_factor: f64) -> Self {
        self.growth_factor = growth_factor;
        self
    }

    /// Backoff factor (0.5, must lie in (0, 1 - 2^-23]).
    pub fn backoff_factor(mut self, backoff_factor: f64) -> Self {
        self.backoff_factor = backoff_factor;
        self
    }

    /// Finite steps in a row before the scale grows (2000, at least 1).
    pub fn growth_interval(mut self, growth_interval: u32) -> Self {
        self.growth_interval = growth_interval;
        self
    }

    /// `false` makes the scaler an exact pass-through (no scaling, no checks, no skips).
    pub fn enabled(mut self, enabled: bool) -> Self {
        self.enabled = enabled;
        self
    }

    /// Extension (off by default, as in PyTorch): the scale never backs off below this.
    pub fn min_scale(mut self, min_scale: f64) -> Self {
        self.min_scale = Some(min_scale);
        self
    }

    /// Extension (off by default, as in PyTorch): the scale never grows above this.
    pub fn max_scale(mut self, max_scale: f64) -> Self {
        self.max_scale = Some(max_scale);
        self
    }

    /// Data parallel: each unscale reduces the ranks' found-inf by max over `collective`, so
    /// that every rank skips or steps together (PyTorch's scaler under DDP). Every rank must
    /// unscale (or step) the same number of times.
    pub fn collective(mut self, collective: Arc<dyn Collective>) -> Self {
        self.collective = Some(collective);
        self
    }

    pub fn build(self) -> Result<GradScaler> {
        // The values given, before f32 makes an f64 beyond its range the inf it becomes.
        for (field, bound) in [("min_scale", self.min_scale), ("max_scale", self.max_scale)] {
            if let Some(b) = bound.filter(|&b| !is_valid_scale(b as f32)) {
                return Err(invalid_scale(field, b));
            }
        }
        let state = ScalerState {
            scale: self.init_scale as f32,
            growth_factor: self.growth_factor,
            backoff_factor: self.backoff_factor,
            growth_interval: self.growth_interval,
            growth_tracker: 0,
            skipped_steps: 0,
            min_scale: self.min_scale.map(|v| v as f32),
            max_scale: self.max_scale.map(|v| v as f32),
            enabled: self.enabled,
        };
        // The builder's name for the scale, and the value given.
        state.validate_naming("init_scale", &self.init_scale)?;
        Ok(GradScaler {
            state,
            enabled: self.enabled,
            found_inf: None,
            consecutive_skips: 0,
            last_nonfinite: Vec::new(),
            stepped: Vec::new(),
            collective: self.collective,
            identity: ScalerIdentity::fresh(),
        })
    }
}
