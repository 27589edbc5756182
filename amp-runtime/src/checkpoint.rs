//! Checkpoints that resume a run: the master weights, the optimizer's state, the GradScaler's
//! state and the step, saved together in one safetensors file and restored together, as PyTorch
//! users save the model's, the optimizer's and the scaler's `state_dict()`s.
//!
//! The file's tensors: `model.{name}` for each variable of the `VarMap` (by its name there),
//! `optim.{name}.{entry}` for the optimizer's state of that variable (AdamW: `step`, `m`, `v`),
//! `optimizer.{name}` for its hyper-parameters (f64 scalars:
//! [`OptimizerState::hyper_parameters`]), `optimizer.variables` for the names of the variables
//! it updates (u8: each name and a newline, sorted; a file without it, written before it
//! existed, loads unchecked), `scaler.*` ([`ScalerState::to_tensors`]), `step` (an
//! i64 scalar) and `format` (the layout's version, 2). Saving writes a temporary file beside the target and renames it over the target,
//! so a run killed while saving leaves the previous checkpoint whole. Loading checks every entry
//! (present, shape, dtype, no entry it does not know) before it writes anything, and names the
//! first one that is wrong.
//!
//! A run resumed from a checkpoint continues bit for bit as the uninterrupted run: the masters,
//! the moments and step counts, the optimizer's hyper-parameters (a learning rate a schedule
//! changed), the loss scale and its growth tracker are the ones that run had
//! (`tests/checkpoint.rs`).
//!
//! ```
//! # extern crate amp_runtime as candle_amp;
//! use candle_amp::checkpoint;
//! use candle_amp::optim::{AdamW, Optimizer, ParamsAdamW};
//! use candle_amp::GradScaler;
//! use candle_core::{DType, Device, Result};
//! use candle_nn::{VarBuilder, VarMap};
//!
//! # fn main() -> Result<()> {
//! let vars = VarMap::new();
//! let _w = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu).get((2, 2), "w")?;
//! let opt = AdamW::new(vars.all_vars(), ParamsAdamW::default())?;
//! let path = std::env::temp_dir().join("candle-amp-doc.safetensors");
//! checkpoint::save(&path, &vars, &opt, &GradScaler::new(), 20)?;
//!
//! let (mut opt, mut scaler) = (AdamW::new(vars.all_vars(), ParamsAdamW::default())?, GradScaler::new());
//! assert_eq!(checkpoint::load(&path, &vars, &mut opt, &mut scaler)?, 20);
//! # std::fs::remove_file(&path).ok(); Ok(()) }
//! ```

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::VarMap;

use crate::optim::OptimizerState;
use crate::scaler::{GradScaler, ScalerState};

/// The layout's version, saved as `format`.
const FORMAT: i64 = 2;

/// The variables of `vars` by name, sorted, and each variable's name by its tensor's id.
fn named(vars: &VarMap) -> Vec<(String, Var)> {
    let data = vars
        .data()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut named: Vec<_> = data.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// The optimizer updates the variables the checkpoint's `listed` names (unchecked for a file
/// written before the entry existed).
fn same_variables(
    path: &Path,
    listed: Option<Tensor>,
    named: &[(String, Var)],
    optimizer: &impl OptimizerState,
) -> Result<()> {
    let Some(t) = listed else {
        return Ok(());
    };
    if t.dtype() != DType::U8 || t.rank() != 1 {
        candle_core::bail!(
            "checkpoint: `{VARIABLES}` must be u8 names, got {:?} {:?}",
            t.dtype(),
            t.dims()
        )
    }
    let listed = String::from_utf8(t.to_vec1::<u8>()?)
        .map_err(|_| candle_core::Error::Msg(format!("checkpoint: `{VARIABLES}` is not UTF-8")))?;
    let saved: BTreeSet<&str> = listed.split_terminator('\n').collect();
    let held = held_names(named, optimizer)?;
    let held: BTreeSet<&str> = held.iter().map(String::as_str).collect();
    if saved != held {
        let list = |names: Vec<&&str>| {
            let names: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        };
        candle_core::bail!(
            "checkpoint {}: the optimizer updates other variables than the saved one \
             (saved only: {}; held only: {}), as PyTorch's \"loaded state dict contains a \
             parameter group that doesn't match the size of optimizer's group\": build it \
             with the variables it had when saved (those added with `push` included)",
            path.display(),
            list(saved.difference(&held).collect()),
            list(held.difference(&saved).collect())
        )
    }
    Ok(())
}

/// The entry naming the variables the optimizer updates.
const VARIABLES: &str = "optimizer.variables";

/// The names `vars` gives the optimizer's variables, sorted.
fn held_names(named: &[(String, Var)], optimizer: &impl OptimizerState) -> Result<Vec<String>> {
    let mut held = optimizer
        .variables()
        .iter()
        .map(|v| name_of(named, v).map(str::to_string))
        .collect::<Result<Vec<_>>>()?;
    held.sort();
    Ok(held)
}

/// The name `vars` gives the variable `var`.
fn name_of<'a>(named: &'a [(String, Var)], var: &Var) -> Result<&'a str> {
    named
        .iter()
        .find(|(_, v)| v.as_tensor().id() == var.as_tensor().id())
        .map(|(n, _)| n.as_str())
        .ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "checkpoint: the optimizer holds a parameter of shape {:?} that the VarMap does \
                 not name; build the optimizer from this VarMap's variables",
                var.dims()
            ))
        })
}

/// Saves the master weights of `vars`, the optimizer's and the scaler's state and `step` to
/// `path` (see the [module docs](self) for the layout), atomically.
pub fn save(
    path: impl AsRef<Path>,
    vars: &VarMap,
    optimizer: &impl OptimizerState,
    scaler: &GradScaler,
    step: u64,
) -> Result<()> {
    let path = target(path.as_ref())?;
    let path = path.as_path();
    let named = named(vars);
    let cpu = &Device::Cpu;
    let mut tensors: HashMap<String, Tensor> = scaler.state().to_tensors("scaler.")?;
    for (name, var) in &named {
        tensors.insert(format!("model.{name}"), var.as_tensor().to_device(cpu)?);
    }
    for (name, value) in optimizer.hyper_parameters() {
        tensors.insert(format!("optimizer.{name}"), Tensor::new(value, cpu)?);
    }
    let held = held_names(&named, optimizer)?;
    let listed: Vec<u8> = held.iter().flat_map(|n| n.bytes().chain([b'\n'])).collect();
    let len = listed.len();
    tensors.insert(VARIABLES.to_string(), Tensor::from_vec(listed, len, cpu)?);
    for (var, entries) in optimizer.export_state()? {
        let name = name_of(&named, &var)?;
        for (entry, t) in entries {
            tensors.insert(format!("optim.{name}.{entry}"), t.to_device(cpu)?);
        }
    }
    let step = i64::try_from(step).map_err(|_| {
        candle_core::Error::Msg(format!(
            "checkpoint::save: step {step} does not fit the file's i64 `step` (at most {})",
            i64::MAX
        ))
    })?;
    tensors.insert("step".to_string(), Tensor::new(step, cpu)?);
    tensors.insert("format".to_string(), Tensor::new(FORMAT, cpu)?);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    candle_core::safetensors::save(&tensors, &tmp)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        // Not left behind beside the target.
        let _ = std::fs::remove_file(&tmp);
        candle_core::Error::Msg(format!(
            "checkpoint::save: cannot write {:?}: {e}",
            path.display().to_string()
        ))
    })
}

/// The file [`save`] writes for `path`: `path` itself, or the file a symbolic link names (so
/// that the link stays a link, as `torch.save` writes through it); an error naming `path` where
/// it cannot be a file: empty, a directory, or ending in a separator, `.` or `..`, or in a
/// directory that does not exist.
fn target(path: &Path) -> Result<std::path::PathBuf> {
    let shown = || path.display().to_string();
    // `Path` drops a trailing separator and `/.`: `"dir/"` and `"dir/."` have the file name
    // `dir`.
    let text = path.as_os_str().to_string_lossy();
    let trailing = text.ends_with(std::path::is_separator) || text.ends_with("/.");
    if path.file_name().is_none() || trailing {
        candle_core::bail!("checkpoint::save: {:?} names no file", shown())
    }
    if path.is_dir() {
        candle_core::bail!(
            "checkpoint::save: {:?} is a directory; name a file in it",
            shown()
        )
    }
    let path = if path.is_symlink() {
        // The file at the end of the links, or (a dangling link) the one the link names,
        // relative to the link's directory.
        std::fs::canonicalize(path).or_else(|_| {
            Ok::<_, std::io::Error>(
                path.parent()
                    .unwrap_or(Path::new(""))
                    .join(std::fs::read_link(path)?),
            )
        })?
    } else {
        path.to_path_buf()
    };
    if let Some(dir) = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty() && !d.is_dir())
    {
        candle_core::bail!(
            "checkpoint::save: the directory {:?} of {:?} does not exist",
            dir.display().to_string(),
            shown()
        )
    }
    Ok(path)
}

/// Restores what [`save`] wrote into `vars`, `optimizer` and `scaler`, and returns the step.
/// Every entry is checked first (present, with the variable's shape and dtype; no entry the
/// checkpoint should not hold): on an error nothing has been written, and the message names
/// the entry.
pub fn load(
    path: impl AsRef<Path>,
    vars: &VarMap,
    optimizer: &mut impl OptimizerState,
    scaler: &mut GradScaler,
) -> Result<u64> {
    let path = path.as_ref();
    let mut tensors = candle_core::safetensors::load(path, &Device::Cpu)
        .map_err(|e| candle_core::Error::Msg(format!("checkpoint {}: {e}", path.display())))?;
    let mut take = |key: &str| {
        tensors.remove(key).ok_or_else(|| {
            candle_core::Error::Msg(format!("checkpoint {}: no `{key}`", path.display()))
        })
    };
    let scalar = |key: &str, t: Tensor| -> Result<i64> {
        if t.dtype() != DType::I64 || t.rank() != 0 {
            candle_core::bail!(
                "checkpoint: `{key}` must be an i64 scalar, got {:?} {:?}",
                t.dtype(),
                t.dims()
            )
        }
        t.to_scalar::<i64>()
    };
    let format = scalar("format", take("format")?)?;
    if format != FORMAT {
        candle_core::bail!("checkpoint: layout version {format}, this candle-amp reads {FORMAT}")
    }
    let step = u64::try_from(scalar("step", take("step")?)?)
        .map_err(|_| candle_core::Error::Msg("checkpoint: a negative `step`".to_string()))?;

    let named = named(vars);
    let mut masters = Vec::with_capacity(named.len());
    for (name, var) in &named {
        let key = format!("model.{name}");
        let t = take(&key)?;
        if t.dims() != var.dims() || t.dtype() != var.dtype() {
            candle_core::bail!(
                "checkpoint: `{key}` is {:?} {:?}, the variable is {:?} {:?}",
                t.dtype(),
                t.dims(),
                var.dtype(),
                var.dims()
            )
        }
        masters.push((var, t));
    }
    // The optimizer's entries, by the names its exported state has.
    let mut state = HashMap::new();
    for (var, entries) in optimizer.state_entries() {
        let name = name_of(&named, &var)?;
        for entry in entries {
            let key = format!("optim.{name}.{entry}");
            state.insert((var.as_tensor().id(), entry.to_string()), take(&key)?);
        }
    }
    let mut hyper = HashMap::new();
    for (name, _) in optimizer.hyper_parameters() {
        let key = format!("optimizer.{name}");
        let t = take(&key)?;
        if t.dtype() != DType::F64 || t.rank() != 0 {
            candle_core::bail!(
                "checkpoint: `{key}` must be an f64 scalar, got {:?} {:?}",
                t.dtype(),
                t.dims()
            )
        }
        hyper.insert(name, t.to_scalar::<f64>()?);
    }
    same_variables(path, tensors.remove(VARIABLES), &named, optimizer)?;
    let scaler_state = ScalerState::from_tensors(&tensors, "scaler.")?;
    scaler_state.validate()?;
    // The scaler's own entries only: one it does not write is as unexpected as any other.
    for key in scaler_state.to_tensors("scaler.")?.keys() {
        tensors.remove(key);
    }
    if let Some(unexpected) = tensors.keys().min() {
        candle_core::bail!(
            "checkpoint {}: unexpected entry `{unexpected}` (a variable this VarMap does not \
             have, another optimizer's state, or a scaler field the GradScaler does not have)",
            path.display()
        )
    }
    // All checked: write. The hyper-parameters first: their ranges are checked as they are
    // set, before anything else is written.
    optimizer.set_hyper_parameters(&mut |name| {
        hyper
            .get(name)
            .copied()
            .ok_or_else(|| candle_core::Error::Msg(format!("checkpoint: no `optimizer.{name}`")))
    })?;
    optimizer.import_state(&mut |var, entry| {
        state
            .remove(&(var.as_tensor().id(), entry.to_string()))
            .ok_or_else(|| candle_core::Error::Msg(format!("checkpoint: no optimizer `{entry}`")))
    })?;
    scaler.load_state(scaler_state)?;
    for (var, t) in masters {
        var.set(&t.to_device(var.device())?)?;
    }
    crate::cast::clear_autocast_cache();
    Ok(step)
}
