//! Optimizers that update the master weights in place, one pass per parameter: drop-in
//! replacements for candle-nn's [`SGD`](candle_nn::SGD) and [`AdamW`](candle_nn::AdamW), with
//! the same names, constructors and [`Optimizer`] trait, so porting is one `use` line:
//!
//! ```no_run
//! // candle_amp::optim in the facade crate; was: use candle_nn::{AdamW, Optimizer, ParamsAdamW};
//! use amp_runtime::optim::{AdamW, Optimizer, ParamsAdamW};
//! # fn demo(vars: Vec<candle_core::Var>) -> candle_core::Result<()> {
//! let mut opt = AdamW::new(vars, ParamsAdamW { lr: 1e-3, ..Default::default() })?;
//! # Ok(()) }
//! ```
//!
//! They work with [`GradScaler::step`](crate::GradScaler::step) like any `Optimizer`.
//!
//! Why: candle-nn's optimizers are compositions of tensor ops. `SGD` makes three tensors per
//! parameter and step (`grad * lr`, the difference, and `Var::set`'s copy), `AdamW` a dozen, each
//! a fresh allocation and a pass over memory; with AMP's matmuls on bf16 hardware that is a
//! large share of a step (a third of the `amp_recipe` example's bf16 step on 2 cores). These
//! read each gradient and parameter once and write the parameter once (AdamW also its two
//! moments), in place, in f32, split over the cores for large parameters: PyTorch's
//! `foreach`/`fused` implementations play the same part.
//!
//! An f32 parameter (this crate's master weights) ends each step bit for bit where candle-nn's
//! optimizer puts it: the same operations, each rounded to f32 in the same order. Where they
//! differ from candle-nn's:
//! - `AdamW` counts steps per parameter, advancing only when the parameter has a gradient, as
//!   PyTorch's `state["step"]` (candle-nn counts steps for the whole optimizer, so a parameter
//!   that sat out a step gets the wrong bias correction). The two agree when every parameter has
//!   a gradient at every step.
//! - AdamW's moments are f32 whatever the parameter's dtype (candle-nn keeps them in the
//!   parameter's dtype, where `0.999 * v` rounds back to `v` in bf16 and the second moment stops
//!   decaying), and a bf16/f16 parameter is updated in f32 and rounded once.
//!
//! The in-place pass runs on CPU for contiguous f32, bf16 and f16 parameters; anything else (a
//! CUDA parameter, f64) takes the same update as candle tensor ops.
//!
//! After a step every cached cast of a master weight is dropped (see the region docs), as after
//! [`GradScaler::step`](crate::GradScaler::step): the next forward casts the new values.

use std::cell::Cell;

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};
pub use candle_nn::{Optimizer, ParamsAdamW};

use crate::kernels::optim::{AdamWApply, AdamWMoments, AdamWStep, Rule, Update};

/// Whether `var` takes the in-place CPU pass.
fn in_place(var: &Var) -> bool {
    crate::kernels::cpu_float(var.as_tensor()) && var.is_contiguous()
}

/// Whether `var` takes the in-place CUDA kernels (`kernels::cuda::optim`).
fn on_cuda(var: &Var) -> bool {
    crate::kernels::elem::cuda_float(var.as_tensor()) && var.is_contiguous()
}

/// Applies `rule` to `var` from its gradient, in place (the CPU pass; see [`in_place`]).
fn update(
    var: &Var,
    grad: &Tensor,
    rule: Rule,
    moments: Option<(&mut [f32], &mut [f32])>,
) -> Result<()> {
    let grad = grad.contiguous()?;
    var.as_tensor().inplace_op2(
        &grad,
        &Update {
            rule,
            moments: Cell::new(moments),
        },
    )
}

thread_local! {
    /// Set while a [`GradScaler`](crate::GradScaler) steps an optimizer ([`for_scaler`]).
    static FOR_SCALER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `step` as the scaler's step of an optimizer: candle-amp's optimizers then refuse
/// gradients that hold none of their variables' (the gradients of a loss over other
/// parameters), as PyTorch's scaler raises "No inf checks were recorded for this optimizer",
/// before changing anything. Outside the scaler they step over them, as PyTorch's optimizers
/// do. candle's own optimizers do not show their variables and are not checked.
pub(crate) fn for_scaler<R>(step: impl FnOnce() -> R) -> R {
    /// Restores the flag however `step` ends, a panic included.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            FOR_SCALER.with(|f| f.set(self.0));
        }
    }
    let _restore = Restore(FOR_SCALER.with(|f| f.replace(true)));
    step()
}

/// An optimizer's identity for the scaler's "already stepped since the last update" check:
/// a number of its own, the same wherever the optimizer moves and different for every
/// optimizer made (an address is neither: a moved optimizer has a new one, and a new optimizer
/// may take a dropped one's).
#[derive(Debug)]
struct Identity(u64);

impl Identity {
    fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Self(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// Hands the identity to [`identify`], when it asks.
    fn report(&self) {
        if ASKING.with(std::cell::Cell::get) {
            ANSWER.with(|answer| answer.set(Some(self.0)));
        }
    }
}

thread_local! {
    /// Whether [`identify`] is asking.
    static ASKING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// What an optimizer of this module answered.
    static ANSWER: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// The identity of `optimizer` if it is one of this module's, `None` for any other (candle's
/// `Optimizer` trait shows nothing of the kind). It asks `learning_rate`, a getter every
/// optimizer has and none changes anything in, and this module's optimizers answer there.
pub(crate) fn identify<O: Optimizer>(optimizer: &O) -> Option<u64> {
    ANSWER.with(|answer| answer.set(None));
    ASKING.with(|asking| asking.set(true));
    let _ = optimizer.learning_rate();
    ASKING.with(|asking| asking.set(false));
    ANSWER.with(std::cell::Cell::take)
}

/// The error [`for_scaler`] describes, where `vars` (an optimizer's) have no gradient in
/// `grads`.
fn check_scaler_gradients(optimizer: &str, vars: &[Var], grads: &GradStore) -> Result<()> {
    let scaled = FOR_SCALER.with(std::cell::Cell::get);
    if !scaled || vars.is_empty() || vars.iter().any(|v| grads.get(v).is_some()) {
        return Ok(());
    }
    candle_core::bail!(
        "GradScaler: none of this {optimizer}'s {} variables has a gradient in these gradients \
         (PyTorch: \"No inf checks were recorded for this optimizer\"): step each optimizer \
         with the gradients of a loss computed from its parameters",
        vars.len()
    )
}

/// The float variables of `vars`; an error naming `optimizer` where one is given twice (it
/// would be stepped twice per step, and its state saved under one name twice; PyTorch warns
/// "optimizer contains a parameter group with duplicate parameters").
fn float_vars(optimizer: &str, vars: Vec<Var>) -> Result<Vec<Var>> {
    let mut seen = std::collections::HashSet::new();
    for (i, v) in vars.iter().enumerate() {
        if !seen.insert(v.as_tensor().id()) {
            candle_core::bail!(
                "{optimizer}: parameter {i} (shape {:?}) is given twice; pass each variable once",
                v.dims()
            )
        }
    }
    Ok(vars.into_iter().filter(|v| v.dtype().is_float()).collect())
}

/// Stochastic gradient descent, `w -= lr * g`, in place: candle-nn's [`SGD`](candle_nn::SGD)
/// (no momentum), one pass per parameter. Non-float variables are ignored, as there.
#[derive(Debug)]
pub struct SGD {
    vars: Vec<Var>,
    learning_rate: f64,
    id: Identity,
}

impl SGD {
    /// The variables this optimizer updates.
    pub fn into_inner(self) -> Vec<Var> {
        self.vars
    }

    /// Adds a variable to update (one it already updates is not added twice).
    pub fn push(&mut self, var: &Var) {
        let id = var.as_tensor().id();
        if !self.vars.iter().any(|v| v.as_tensor().id() == id) {
            self.vars.push(var.clone());
        }
    }
}

impl Optimizer for SGD {
    type Config = f64;

    fn new(vars: Vec<Var>, learning_rate: f64) -> Result<Self> {
        check_lr("SGD", learning_rate)?;
        Ok(Self {
            vars: float_vars("SGD", vars)?,
            learning_rate,
            id: Identity::new(),
        })
    }

    /// Fails, updating nothing, when the learning rate is not a finite number >= 0 (one set by
    /// `set_learning_rate`, whose signature cannot fail).
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let lr = self.learning_rate;
        check_lr("SGD", lr)?;
        check_grads("SGD", &self.vars, grads)?;
        check_scaler_gradients("SGD", &self.vars, grads)?;
        for var in &self.vars {
            let Some(grad) = grads.get(var).filter(|_| var.elem_count() > 0) else {
                continue;
            };
            if in_place(var) || on_cuda(var) {
                update(var, grad, Rule::Sgd { lr: lr as f32 }, None)?;
            } else if var.dtype() == DType::F32 {
                var.set(&var.sub(&(grad * lr)?)?)?;
            } else {
                // A half parameter (off the in-place path): the update in f32, rounded once,
                // as the in-place kernel computes it (in half `lr` itself would be rounded).
                let step = (grad.to_dtype(DType::F32)? * lr)?;
                let updated = (var.to_dtype(DType::F32)? - step)?;
                var.set(&updated.to_dtype(var.dtype())?)?;
            }
        }
        crate::cast::clear_autocast_cache();
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.id.report();
        self.learning_rate
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.learning_rate = lr;
    }
}

/// AdamW's moments for one parameter: host vectors for the in-place CPU pass, one `(2, n)` f32
/// tensor (m, then v) for the in-place CUDA kernels, tensors on the parameter's device
/// otherwise (in [`moment_dtype`]).
#[derive(Debug)]
enum Moments {
    Host { m: Vec<f32>, v: Vec<f32> },
    Device(Tensor),
    Tensors { m: Tensor, v: Tensor },
}

#[derive(Debug)]
struct AdamWParam {
    var: Var,
    moments: Moments,
    /// Steps this parameter has taken (PyTorch's `state["step"]`).
    steps: u64,
}

/// AdamW (decoupled weight decay), in place: candle-nn's [`AdamW`](candle_nn::AdamW) with
/// PyTorch's step (see the [module docs](self)), one pass per parameter. Non-float variables
/// are ignored.
#[derive(Debug)]
pub struct AdamW {
    params: Vec<AdamWParam>,
    config: ParamsAdamW,
    id: Identity,
}

impl AdamW {
    /// AdamW with the default hyper-parameters and learning rate `learning_rate`.
    pub fn new_lr(vars: Vec<Var>, learning_rate: f64) -> Result<Self> {
        let config = ParamsAdamW {
            lr: learning_rate,
            ..ParamsAdamW::default()
        };
        Self::new(vars, config)
    }

    pub fn params(&self) -> &ParamsAdamW {
        &self.config
    }

    pub fn set_params(&mut self, config: ParamsAdamW) {
        self.config = config;
    }

    /// The constants of a parameter's `t`-th step.
    fn constants(&self, t: u64) -> AdamWStep {
        let p = &self.config;
        #[allow(clippy::cast_precision_loss)] // exact below 2^53 steps
        let t = t as f64;
        AdamWStep {
            lr: p.lr,
            decay: 1.0 - p.lr * p.weight_decay,
            beta1: p.beta1,
            beta2: p.beta2,
            scale_m: 1.0 / (1.0 - p.beta1.powf(t)),
            scale_v: 1.0 / (1.0 - p.beta2.powf(t)),
            eps: p.eps,
        }
    }
}

impl Optimizer for AdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, config: ParamsAdamW) -> Result<Self> {
        check_adamw(&config)?;
        let params = float_vars("AdamW", vars)?
            .into_iter()
            .map(|var| {
                let n = var.elem_count();
                let moments = if in_place(&var) {
                    Moments::Host {
                        m: vec![0.0; n],
                        v: vec![0.0; n],
                    }
                } else if on_cuda(&var) {
                    Moments::Device(Tensor::zeros((2, n), DType::F32, var.device())?)
                } else {
                    let zeros = || Tensor::zeros(var.shape(), moment_dtype(&var), var.device());
                    Moments::Tensors {
                        m: zeros()?,
                        v: zeros()?,
                    }
                };
                Ok(AdamWParam {
                    var,
                    moments,
                    steps: 0,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            params,
            config,
            id: Identity::new(),
        })
    }

    /// Fails, updating nothing, when a hyper-parameter is out of range (one set by
    /// `set_learning_rate` or `set_params`, whose signatures cannot fail).
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        check_adamw(&self.config)?;
        let vars: Vec<Var> = self.params.iter().map(|p| p.var.clone()).collect();
        check_grads("AdamW", &vars, grads)?;
        check_scaler_gradients("AdamW", &vars, grads)?;
        for i in 0..self.params.len() {
            let var = &self.params[i].var;
            let Some(grad) = grads.get(var).filter(|_| var.elem_count() > 0) else {
                continue;
            };
            self.params[i].steps += 1;
            let s = self.constants(self.params[i].steps);
            let param = &mut self.params[i];
            match &mut param.moments {
                Moments::Host { m, v } => update(&param.var, grad, Rule::AdamW(s), Some((m, v)))?,
                Moments::Device(mv) => {
                    // Detached: see `tensor_adamw`.
                    mv.inplace_op2(&grad.detach().contiguous()?, &AdamWMoments(s))?;
                    param.var.as_tensor().inplace_op2(mv, &AdamWApply(s))?;
                }
                Moments::Tensors { m, v } => {
                    let (next_m, next_v) = tensor_adamw(&param.var, grad, m, v, &s)?;
                    *m = next_m;
                    *v = next_v;
                }
            }
        }
        crate::cast::clear_autocast_cache();
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.id.report();
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

/// One parameter's optimizer state: the parameter, and its state as named tensors.
pub type ParamState = (Var, Vec<(&'static str, Tensor)>);

/// An optimizer whose per-parameter state a checkpoint saves and restores: PyTorch's
/// `optimizer.state_dict()` / `load_state_dict()`.
pub trait OptimizerState {
    /// The variables it updates: a checkpoint records their names, so that loading it into an
    /// optimizer that holds other variables is an error (PyTorch's "doesn't match the size of
    /// optimizer's group"), not a parameter silently left untrained.
    fn variables(&self) -> Vec<Var>;

    /// Each parameter's state as named tensors (AdamW: `step`, an i64 scalar; `m` and `v`, the
    /// moments in the parameter's shape), with the parameter it belongs to. SGD has none.
    fn export_state(&self) -> Result<Vec<ParamState>>;

    /// The names [`export_state`](Self::export_state) gives each parameter's entries, without
    /// reading them (what a checkpoint's load expects).
    fn state_entries(&self) -> Vec<(Var, &'static [&'static str])>;

    /// Restores what [`export_state`](Self::export_state) saved: `get(var, name)` gives the
    /// named tensor of a parameter (an error naming it when it is missing). Each tensor's shape
    /// and dtype are checked before anything is written.
    fn import_state(&mut self, get: &mut dyn FnMut(&Var, &str) -> Result<Tensor>) -> Result<()>;

    /// The hyper-parameters by name (SGD: `lr`; AdamW: `lr`, `beta1`, `beta2`, `eps`,
    /// `weight_decay`), what PyTorch's `state_dict()` keeps in its `param_groups`: a checkpoint
    /// saves them, so that a rate a schedule changed (`set_learning_rate`, `set_params`)
    /// resumes as it was, not as the program builds its optimizer at start-up.
    fn hyper_parameters(&self) -> Vec<(&'static str, f64)>;

    /// Sets what [`hyper_parameters`](Self::hyper_parameters) names: `get(name)` gives each one
    /// (an error naming it when it is missing). All are checked, as the constructor checks
    /// them, before any is set.
    fn set_hyper_parameters(&mut self, get: &mut dyn FnMut(&str) -> Result<f64>) -> Result<()>;
}

impl OptimizerState for SGD {
    fn variables(&self) -> Vec<Var> {
        self.vars.clone()
    }

    fn hyper_parameters(&self) -> Vec<(&'static str, f64)> {
        vec![("lr", self.learning_rate)]
    }

    fn set_hyper_parameters(&mut self, get: &mut dyn FnMut(&str) -> Result<f64>) -> Result<()> {
        let lr = get("lr")?;
        check_lr("SGD", lr)?;
        self.learning_rate = lr;
        Ok(())
    }

    fn export_state(&self) -> Result<Vec<ParamState>> {
        Ok(Vec::new())
    }

    fn state_entries(&self) -> Vec<(Var, &'static [&'static str])> {
        Vec::new()
    }

    fn import_state(&mut self, _: &mut dyn FnMut(&Var, &str) -> Result<Tensor>) -> Result<()> {
        Ok(())
    }
}

/// AdamW's entries per parameter.
const ADAMW_ENTRIES: &[&str] = &["step", "m", "v"];

impl OptimizerState for AdamW {
    fn variables(&self) -> Vec<Var> {
        self.params.iter().map(|p| p.var.clone()).collect()
    }

    fn hyper_parameters(&self) -> Vec<(&'static str, f64)> {
        let p = &self.config;
        vec![
            ("lr", p.lr),
            ("beta1", p.beta1),
            ("beta2", p.beta2),
            ("eps", p.eps),
            ("weight_decay", p.weight_decay),
        ]
    }

    fn set_hyper_parameters(&mut self, get: &mut dyn FnMut(&str) -> Result<f64>) -> Result<()> {
        let config = ParamsAdamW {
            lr: get("lr")?,
            beta1: get("beta1")?,
            beta2: get("beta2")?,
            eps: get("eps")?,
            weight_decay: get("weight_decay")?,
        };
        check_adamw(&config)?;
        self.config = config;
        Ok(())
    }

    fn state_entries(&self) -> Vec<(Var, &'static [&'static str])> {
        self.params
            .iter()
            .map(|p| (p.var.clone(), ADAMW_ENTRIES))
            .collect()
    }

    fn export_state(&self) -> Result<Vec<ParamState>> {
        self.params
            .iter()
            .map(|p| {
                let shape = p.var.shape();
                let (m, v) = match &p.moments {
                    Moments::Host { m, v } => (
                        Tensor::from_slice(m, shape, &candle_core::Device::Cpu)?,
                        Tensor::from_slice(v, shape, &candle_core::Device::Cpu)?,
                    ),
                    Moments::Device(mv) => (
                        mv.get(0)?
                            .reshape(shape)?
                            .to_device(&candle_core::Device::Cpu)?,
                        mv.get(1)?
                            .reshape(shape)?
                            .to_device(&candle_core::Device::Cpu)?,
                    ),
                    Moments::Tensors { m, v } => (
                        m.to_device(&candle_core::Device::Cpu)?,
                        v.to_device(&candle_core::Device::Cpu)?,
                    ),
                };
                let steps = i64::try_from(p.steps).map_err(|_| {
                    candle_core::Error::Msg(format!(
                        "AdamW state: the step count {} of a parameter of shape {:?} does not \
                         fit the checkpoint's i64",
                        p.steps,
                        p.var.dims()
                    ))
                })?;
                let step = Tensor::new(steps, &candle_core::Device::Cpu)?;
                let entries = ADAMW_ENTRIES.iter().copied().zip([step, m, v]).collect();
                Ok((p.var.clone(), entries))
            })
            .collect()
    }

    fn import_state(&mut self, get: &mut dyn FnMut(&Var, &str) -> Result<Tensor>) -> Result<()> {
        // Everything read and checked first, so that a bad entry changes nothing.
        let mut read = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let step = get(&p.var, "step")?;
            if step.dtype() != DType::I64 || step.rank() != 0 {
                candle_core::bail!(
                    "AdamW state: `step` must be an i64 scalar, got {:?} of shape {:?}",
                    step.dtype(),
                    step.dims()
                )
            }
            let steps = u64::try_from(step.to_scalar::<i64>()?).map_err(|_| {
                candle_core::Error::Msg("AdamW state: a negative `step`".to_string())
            })?;
            let moment_dtype = match p.moments {
                Moments::Host { .. } | Moments::Device(_) => DType::F32,
                Moments::Tensors { .. } => moment_dtype(&p.var),
            };
            let mut moment = |name: &str| -> Result<Tensor> {
                let t = get(&p.var, name)?;
                if t.dims() != p.var.dims() || t.dtype() != moment_dtype {
                    candle_core::bail!(
                        "AdamW state: moment `{name}` is {:?} {:?}, the parameter needs {:?} {:?}",
                        t.dtype(),
                        t.dims(),
                        moment_dtype,
                        p.var.dims()
                    )
                }
                Ok(t)
            };
            read.push((steps, moment("m")?, moment("v")?));
        }
        for (p, (steps, m, v)) in self.params.iter_mut().zip(read) {
            p.steps = steps;
            p.moments = match &p.moments {
                Moments::Host { .. } => Moments::Host {
                    m: m.flatten_all()?.to_vec1()?,
                    v: v.flatten_all()?.to_vec1()?,
                },
                Moments::Device(_) => Moments::Device(
                    Tensor::stack(&[m.flatten_all()?, v.flatten_all()?], 0)?
                        .to_device(p.var.device())?,
                ),
                Moments::Tensors { .. } => Moments::Tensors {
                    m: m.to_device(p.var.device())?,
                    v: v.to_device(p.var.device())?,
                },
            };
        }
        Ok(())
    }
}

/// A learning rate must be a finite number >= 0, as PyTorch's optimizers require (PyTorch lets
/// NaN through its `lr < 0` check; a NaN rate turns every weight into NaN at the first step),
/// and finite in f32 too, where the updates apply it.
fn check_lr(optimizer: &str, lr: f64) -> Result<()> {
    if crate::kernels::elem::finite_in_f32(lr) && lr >= 0.0 {
        Ok(())
    } else {
        candle_core::bail!("{optimizer}: invalid learning rate {lr}, need a finite value >= 0")
    }
}

/// The optimizer has variables, and each gradient in `grads` has its parameter's shape, checked
/// before any parameter is written (a failed step changes nothing): a gradient of another shape,
/// even of as many values, would update the weights in another tensor's layout, where PyTorch's
/// optimizers raise. An optimizer without variables is accepted when built (candle-nn's `SGD`
/// may be built empty and given its variables by `push`) but refused when stepped: built
/// before the model's layers, from `VarMap::all_vars()` still empty, it stepped nothing, and a
/// scaler reported every step taken.
fn check_grads(optimizer: &str, vars: &[Var], grads: &GradStore) -> Result<()> {
    if vars.is_empty() {
        candle_core::bail!(
            "{optimizer}: no variables to update (PyTorch: \"optimizer got an empty parameter \
             list\"): it was built from an empty list, or from variables none of which is a \
             float; build it after the model's layers (`VarMap::all_vars()` is empty before \
             them)"
        )
    }
    for var in vars {
        let Some(grad) = grads.get(var) else { continue };
        if grad.dims() != var.dims() {
            candle_core::bail!(
                "{optimizer}: a gradient of shape {:?} for a parameter of shape {:?}",
                grad.dims(),
                var.dims()
            )
        }
        if grad.dtype() != var.dtype() {
            candle_core::bail!(
                "{optimizer}: a {:?} gradient for a {:?} parameter (PyTorch: \"assigned grad \
                 has data of a different type\"); nothing was updated",
                grad.dtype(),
                var.dtype()
            )
        }
    }
    Ok(())
}

/// AdamW's hyper-parameters in PyTorch's ranges (its constructor's checks, NaN rejected too):
/// `lr >= 0`, `eps >= 0`, `0 <= beta1, beta2 < 1`, `weight_decay >= 0`, all finite.
fn check_adamw(p: &ParamsAdamW) -> Result<()> {
    check_lr("AdamW", p.lr)?;
    for (name, value) in [("eps", p.eps), ("weight_decay", p.weight_decay)] {
        if !(crate::kernels::elem::finite_in_f32(value) && value >= 0.0) {
            candle_core::bail!("AdamW: invalid {name} {value}, need a finite value >= 0")
        }
    }
    for (name, value) in [("beta1", p.beta1), ("beta2", p.beta2)] {
        if !(0.0..1.0).contains(&value) {
            candle_core::bail!("AdamW: invalid {name} {value}, need 0 <= {name} < 1")
        }
    }
    Ok(())
}

/// The dtype AdamW's moments and arithmetic use off the in-place pass: f64 for f64 parameters,
/// f32 for every other.
fn moment_dtype(var: &Var) -> DType {
    crate::kernels::wide(var.dtype())
}

/// The AdamW step as candle tensor ops (parameters the in-place pass does not take), in
/// [`moment_dtype`] and the pass's (candle-nn's) order of operations. Writes the parameter; returns the new
/// moments.
fn tensor_adamw(
    var: &Var,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    s: &AdamWStep,
) -> Result<(Tensor, Tensor)> {
    let dtype = moment_dtype(var);
    // A parameter's gradient can reference the step's whole forward graph (candle detaches
    // only the gradients of intermediate nodes), and moments kept from step to step would
    // then hold every step's activations: they are computed from the detached gradient.
    let (w, g) = (
        var.as_tensor().to_dtype(dtype)?,
        grad.detach().to_dtype(dtype)?,
    );
    let m = ((m * s.beta1)? + (&g * (1.0 - s.beta1))?)?;
    let v = ((v * s.beta2)? + (g.sqr()? * (1.0 - s.beta2))?)?;
    let step = ((&m * s.scale_m)? / ((&v * s.scale_v)?.sqrt()? + s.eps)?)?;
    let w = ((w * s.decay)? - (step * s.lr)?)?;
    var.set(&w.to_dtype(var.dtype())?)?;
    Ok((m, v))
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// Moments kept as tensors (parameters the in-place pass does not take: f64 here, every
    /// parameter on CUDA) hold no autograd history. Without the detach, each moment held the
    /// gradient it was made from, the gradient the step's forward graph, and the moment the
    /// previous step's moment: every step's activations stayed alive (on CUDA,
    /// `quantized_sine --size 512 --hidden 256` ran out of an H200's 140 GiB within 50 steps).
    #[test]
    fn tensor_moments_hold_no_graph() -> Result<()> {
        let dev = Device::Cpu;
        let u = Var::new(&[1f64, 2.0, 3.0], &dev)?;
        let w = Var::new(&[0.5f64, -1.0, 2.0], &dev)?;
        let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
        for _ in 0..2 {
            let x = (u.as_tensor() * 2.0)?.exp()?;
            let grads = (w.as_tensor() * &x)?.sum_all()?.backward()?;
            let g = grads.get(&w).expect("a gradient");
            assert!(g.track_op(), "the gradient references the forward graph");
            opt.step(&grads)?;
        }
        match &opt.params[0].moments {
            Moments::Tensors { m, v } => assert!(!m.track_op() && !v.track_op()),
            _ => panic!("f64 moments are tensors"),
        }
        Ok(())
    }
}
