//! The scaler's persistent state: what a checkpoint stores, and the checks a loaded state passes.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};

/// Errors of the gradient scaler: a bad configuration or checkpoint, or gradients that do not
/// belong together. They reach the caller as `candle_core::Error::Wrapped`, so `?` works in code
/// returning candle's `Result`; the message names the field and the value.
#[derive(Debug, thiserror::Error)]
pub enum ScalerError {
    /// A builder argument or a loaded state field outside its valid range.
    #[error("GradScaler: invalid `{field}`: {reason}")]
    Invalid { field: &'static str, reason: String },
    /// A checkpoint that lacks a field or stores it with the wrong type.
    #[error("GradScaler state: {0}")]
    Malformed(String),
    /// Gradients that cannot be combined, e.g. scaled by two different scales.
    #[error("GradScaler: {0}")]
    Mismatch(String),
    /// A loss that is not a single value: backpropagating it would silently sum it.
    #[error(
        "GradScaler: the loss must be a single value, got shape {0:?}; reduce it first \
         (e.g. `loss.mean_all()`), as PyTorch requires (\"grad can be implicitly created only \
         for scalar outputs\")"
    )]
    NotScalarLoss(Vec<usize>),
    /// A loss of an integer dtype: no gradient flows through it.
    #[error("GradScaler: the loss must be a float value, got {0:?}")]
    NotFloatLoss(candle_core::DType),
    /// A backward that reached no variable: an optimizer step on it would update nothing while
    /// the scaler counted it as a good step.
    #[error(
        "GradScaler: the loss depends on no variable, so no gradient reaches a parameter \
         (PyTorch's backward raises \"element 0 of tensors does not require grad\"): compute \
         the loss from the model's output"
    )]
    NoGradients,
    /// Backoff would take the scale below the smallest normal f32: every step for a long while
    /// had inf/NaN gradients, so the scale is not the cause.
    #[error("{}", underflow_message(*scale, *backoff_factor, *consecutive_skips))]
    ScaleUnderflow {
        scale: f32,
        backoff_factor: f64,
        consecutive_skips: u64,
    },
    #[error(
        "GradScaler: every gradient is exactly 0 at loss scale {scale:e}: the scale has backed \
         off below 1 ({skipped_steps} steps skipped so far) until the scaled loss's half-precision \
         gradients underflow, and this step would change nothing. Find what made the earlier \
         steps non-finite (compare the same step with `enabled = false`), or keep the scale up \
         with `min_scale`"
    )]
    ScaleCollapsed { scale: f32, skipped_steps: u64 },
}

/// The smallest scale a state may hold: the smallest normal f32, so that `1/scale` is finite
/// (below 2^-128 it is inf, and an unscaled zero gradient would become NaN).
pub(crate) const MIN_SCALE: f32 = f32::MIN_POSITIVE;

/// [`ScalerError::ScaleUnderflow`]'s words: after many skips in a row the model is to blame;
/// a factor that underflows a scale of 1 or more in one backoff is itself the mistake.
fn underflow_message(scale: f32, backoff_factor: f64, consecutive_skips: u64) -> String {
    if consecutive_skips <= 1 && scale >= 1.0 {
        return format!(
            "GradScaler: one backoff by backoff_factor {backoff_factor:e} takes the loss scale \
             {scale:e} below the smallest normal f32: backoff_factor is far too small (PyTorch's \
             default is 0.5); the scale is left at {scale:e}"
        );
    }
    format!(
        "GradScaler: {consecutive_skips} steps in a row had inf/NaN gradients and the loss scale \
         would fall below the smallest normal f32 ({scale:e} x backoff {backoff_factor:e}); the \
         scale is left at {scale:e}. The gradients are non-finite at any scale, so the forward \
         pass or the loss produces inf/NaN itself: check the inputs and the loss, and compare \
         with the same step in f32 (`enabled = false`) to find the op"
    )
}

/// How far from 1 the growth and backoff factors must be: one f32 ulp of 1 (2^-23), the
/// smallest relative step that moves every normal f32 scale.
const FACTOR_MARGIN: f64 = 1.0 / (1u64 << 23) as f64;

/// Whether `v` can be a loss scale: finite and a normal positive f32.
pub(crate) fn is_valid_scale(v: f32) -> bool {
    v.is_finite() && v >= MIN_SCALE
}

/// The error for a scale-like field holding `v`.
pub(crate) fn invalid_scale(field: &'static str, v: impl std::fmt::Display) -> candle_core::Error {
    invalid(
        field,
        format!(
            "must be a finite, normal positive f32 (at least {MIN_SCALE:e}, so that 1/scale \
             is finite), got {v}"
        ),
    )
}

impl From<ScalerError> for candle_core::Error {
    fn from(e: ScalerError) -> Self {
        candle_core::Error::wrap(e)
    }
}

fn invalid(field: &'static str, reason: String) -> candle_core::Error {
    ScalerError::Invalid { field, reason }.into()
}

/// Everything a [`GradScaler`](super::GradScaler) needs to continue a run bit for bit: PyTorch's
/// `GradScaler.state_dict()` (scale, growth factor, backoff factor, growth interval, growth
/// tracker) plus the skipped-step counter, the optional scale bounds and, for a disabled
/// scaler, that it was disabled.
///
/// Save it next to the weights: as JSON ([`to_json`](Self::to_json), or any serde format), or
/// as tensors in the model's safetensors file ([`to_tensors`](Self::to_tensors)). Loading checks
/// every field ([`validate`](Self::validate)); a missing field, a NaN, infinite, negative, zero
/// or subnormal scale, `growth_factor` below 1 + 2^-23, `backoff_factor` outside
/// (0, 1 - 2^-23] or a tracker at or past the interval is an error, not a panic.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalerState {
    /// The current loss scale, an f32 as in PyTorch.
    pub scale: f32,
    /// Factor applied after `growth_interval` consecutive finite steps (> 1).
    pub growth_factor: f64,
    /// Factor applied after a step with non-finite gradients (in (0, 1 - 2^-23]).
    pub backoff_factor: f64,
    /// Consecutive finite steps before the scale grows (>= 1).
    pub growth_interval: u32,
    /// Consecutive finite steps since the last growth or backoff (< `growth_interval`).
    pub growth_tracker: u32,
    /// Steps skipped because of non-finite gradients, over the run.
    #[serde(default)]
    pub skipped_steps: u64,
    /// Optional floor for the scale (TensorFlow floors at 1); PyTorch has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_scale: Option<f32>,
    /// Optional ceiling for the scale (Apex caps at 2^24); PyTorch has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_scale: Option<f32>,
    /// Whether the scaler that saved it was enabled (written only when it was not). A disabled
    /// scaler's state continues no run: an enabled scaler refuses it, as PyTorch refuses the
    /// empty `state_dict()` of a disabled one.
    #[serde(default = "enabled", skip_serializing_if = "is_enabled")]
    pub enabled: bool,
}

/// The default of [`ScalerState::enabled`]: states written before the field were enabled ones.
fn enabled() -> bool {
    true
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference
fn is_enabled(enabled: &bool) -> bool {
    *enabled
}

impl ScalerState {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        self.validate_naming("scale", &self.scale)
    }

    /// [`validate`](Self::validate), an error about the scale naming `scale_field` and showing
    /// `scale_given` (the builder's `init_scale`, as the f64 the user passed).
    pub(crate) fn validate_naming(
        &self,
        scale_field: &'static str,
        scale_given: &dyn std::fmt::Display,
    ) -> Result<()> {
        if !is_valid_scale(self.scale) {
            return Err(invalid_scale(scale_field, scale_given));
        }
        // PyTorch asks growth_factor > 1 and backoff_factor < 1. Closer to 1 than 2^-23, a
        // factor leaves some f32 scales where they are (65536 x 0.99999999 rounds back to
        // 65536): overflowing steps would never back off, and nothing would say so.
        if !(self.growth_factor.is_finite() && self.growth_factor >= 1.0 + FACTOR_MARGIN) {
            return Err(invalid(
                "growth_factor",
                format!(
                    "must be a finite number of at least 1 + 2^-23 (a smaller factor leaves \
                     some f32 scales unchanged), got {}",
                    self.growth_factor
                ),
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor <= 1.0 - FACTOR_MARGIN) {
            return Err(invalid(
                "backoff_factor",
                format!(
                    "must lie in (0, 1 - 2^-23] (a factor closer to 1 leaves some f32 scales \
                     unchanged), got {}",
                    self.backoff_factor
                ),
            ));
        }
        if self.growth_interval == 0 {
            return Err(invalid(
                "growth_interval",
                "must be at least 1, got 0".into(),
            ));
        }
        if self.growth_tracker >= self.growth_interval {
            return Err(invalid(
                "growth_tracker",
                format!(
                    "must be below growth_interval ({}), got {}",
                    self.growth_interval, self.growth_tracker
                ),
            ));
        }
        for (field, bound) in [("min_scale", self.min_scale), ("max_scale", self.max_scale)] {
            if let Some(b) = bound {
                if !is_valid_scale(b) {
                    return Err(invalid_scale(field, b));
                }
            }
        }
        if let (Some(lo), Some(hi)) = (self.min_scale, self.max_scale) {
            if lo > hi {
                return Err(invalid(
                    "min_scale",
                    format!("must not exceed max_scale ({hi}), got {lo}"),
                ));
            }
        }
        let below = self.min_scale.is_some_and(|lo| self.scale < lo);
        let above = self.max_scale.is_some_and(|hi| self.scale > hi);
        if below || above {
            return Err(invalid(
                scale_field,
                format!(
                    "must lie within min_scale/max_scale ({:?}/{:?}), got {scale_given}",
                    self.min_scale, self.max_scale
                ),
            ));
        }
        Ok(())
    }

    /// One `update()`: PyTorch's `_amp_update_scale_` rule, with the optional bounds applied.
    ///
    /// The products are computed in f64 (PyTorch multiplies the f32 scale by a Python float)
    /// and rounded to f32; growth that would reach inf leaves the scale unchanged. A backoff that
    /// would leave the normal f32 range (PyTorch goes on to subnormals, 0 and an infinite
    /// `1/scale`) leaves the scale unchanged too, and returns `false`.
    pub(crate) fn advance(&mut self, found_inf: bool) -> bool {
        if found_inf {
            let backed_off = (f64::from(self.scale) * self.backoff_factor) as f32;
            let backed_off = self.min_scale.map_or(backed_off, |lo| backed_off.max(lo));
            self.growth_tracker = 0;
            if !is_valid_scale(backed_off) {
                return false;
            }
            self.scale = backed_off;
        } else if self.growth_tracker + 1 == self.growth_interval {
            let grown = (f64::from(self.scale) * self.growth_factor) as f32;
            if grown.is_finite() {
                self.scale = self.max_scale.map_or(grown, |hi| grown.min(hi));
            }
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
        }
        true
    }

    /// The state as a JSON object (PyTorch's state_dict keys, `_growth_tracker` without the
    /// underscore).
    ///
    /// # Panics
    /// Never: the state holds plain numbers, which serde_json always serialises.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("ScalerState serialises: plain numbers only")
    }

    /// Parses and validates a state written by [`to_json`](Self::to_json).
    pub fn from_json(json: &str) -> Result<Self> {
        let state: Self = serde_json::from_str(json)
            .map_err(|e| candle_core::Error::from(ScalerError::Malformed(e.to_string())))?;
        state.validate()?;
        Ok(state)
    }

    /// The state as named scalar tensors (`{prefix}scale`, ...), to save in the same
    /// safetensors file as the weights. Floats keep their exact bits; the counters are stored
    /// as u32 and i64.
    pub fn to_tensors(&self, prefix: &str) -> Result<HashMap<String, Tensor>> {
        let cpu = &Device::Cpu;
        let mut out = HashMap::from([
            (format!("{prefix}scale"), Tensor::new(self.scale, cpu)?),
            (
                format!("{prefix}growth_factor"),
                Tensor::new(self.growth_factor, cpu)?,
            ),
            (
                format!("{prefix}backoff_factor"),
                Tensor::new(self.backoff_factor, cpu)?,
            ),
            (
                format!("{prefix}growth_interval"),
                Tensor::new(self.growth_interval, cpu)?,
            ),
            (
                format!("{prefix}growth_tracker"),
                Tensor::new(self.growth_tracker, cpu)?,
            ),
            (
                // candle has no u64 dtype: the i64 of the same 64 bits, read back exactly.
                format!("{prefix}skipped_steps"),
                Tensor::new(i64::from_ne_bytes(self.skipped_steps.to_ne_bytes()), cpu)?,
            ),
        ]);
        if let Some(lo) = self.min_scale {
            out.insert(format!("{prefix}min_scale"), Tensor::new(lo, cpu)?);
        }
        if let Some(hi) = self.max_scale {
            out.insert(format!("{prefix}max_scale"), Tensor::new(hi, cpu)?);
        }
        if !self.enabled {
            out.insert(format!("{prefix}enabled"), Tensor::new(0u8, cpu)?);
        }
        Ok(out)
    }

    /// Reads and validates a state written by [`to_tensors`](Self::to_tensors) with the same
    /// prefix; other entries of `tensors` (the weights) are ignored.
    pub fn from_tensors(tensors: &HashMap<String, Tensor>, prefix: &str) -> Result<Self> {
        let read = Reader { tensors, prefix };
        let skipped: i64 = read.required("skipped_steps", DType::I64)?;
        let state = Self {
            scale: read.required("scale", DType::F32)?,
            growth_factor: read.required("growth_factor", DType::F64)?,
            backoff_factor: read.required("backoff_factor", DType::F64)?,
            growth_interval: read.required("growth_interval", DType::U32)?,
            growth_tracker: read.required("growth_tracker", DType::U32)?,
            // The bits `to_tensors` wrote (earlier versions clamped to i64::MAX, never negative).
            skipped_steps: u64::from_ne_bytes(skipped.to_ne_bytes()),
            min_scale: read.optional("min_scale", DType::F32)?,
            max_scale: read.optional("max_scale", DType::F32)?,
            enabled: read
                .optional("enabled", DType::U8)?
                .is_none_or(|e: u8| e != 0),
        };
        state.validate()?;
        Ok(state)
    }
}

/// Reads one scalar field of a tensor checkpoint, checking presence, dtype and shape.
struct Reader<'a> {
    tensors: &'a HashMap<String, Tensor>,
    prefix: &'a str,
}

impl Reader<'_> {
    fn required<T: candle_core::WithDType>(&self, field: &str, dtype: DType) -> Result<T> {
        self.optional(field, dtype)?.ok_or_else(|| {
            ScalerError::Malformed(format!("missing field `{}{field}`", self.prefix)).into()
        })
    }

    fn optional<T: candle_core::WithDType>(&self, field: &str, dtype: DType) -> Result<Option<T>> {
        let name = format!("{}{field}", self.prefix);
        let Some(t) = self.tensors.get(&name) else {
            return Ok(None);
        };
        if t.dtype() != dtype || t.elem_count() != 1 {
            return Err(ScalerError::Malformed(format!(
                "`{name}` must be one {dtype:?} value, got {:?} of shape {:?}",
                t.dtype(),
                t.dims()
            ))
            .into());
        }
        Ok(Some(t.flatten_all()?.get(0)?.to_scalar::<T>()?))
    }
}
