//! The one place a dtype conversion happens, with its per-thread weight-cast cache and counter.
//!
//! Typed casts (`Tensor::cast`), region routing and the layers' weight casts all call
//! [`convert`]: a conversion to the dtype a tensor already has is elided (a handle clone), every
//! other one is counted ([`cast_count`], for tests and benchmarks), and a conversion of a leaf
//! variable (a master weight) is cached while a [`RegionGuard`] is alive on the thread, so a
//! weight used several times in one region is cast once, as PyTorch's autocast does.
//!
//! A cached cast must never outlive the master's value: candle's optimizers and `Var::set` write
//! the master in place, with nothing a cache could observe. So each cached cast belongs to the
//! innermost region part (fn or method body) running when it was made, and is dropped when that
//! part returns: a model's `forward` that is a region reuses its casts within one call, and casts
//! afresh at the next call, even when both calls run inside one long region (an epoch under
//! `#[autocast]` whose optimizer steps run in a plain helper). [`GradScaler::step`] and
//! candle-amp's optimizers also drop every cached cast after stepping, for the loop written in
//! one region body; a write candle-amp does not make (`Var::set`) needs
//! [`clear_autocast_cache`], which nothing can call for it: candle's tensors have no version
//! counter.
//! PyTorch keys its cache on the tensor until the outermost autocast exits, and so reuses a stale
//! cast in that loop.
//!
//! [`GradScaler::step`]: crate::scaler::GradScaler::step
//!
//! Converts with `kernels::to_dtype` (vectorised on CPU, candle's `to_dtype` elsewhere); everything
//! above (typed tensors, regions, layers) converts through it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;

use candle_core::{DType, Result, Tensor, TensorId};

#[derive(Default)]
struct CastState {
    /// How many region guards are alive on this thread.
    depth: usize,
    /// How many of them turned the cache off (`#[autocast(cache = false)]`): while any is
    /// alive, nothing is cached.
    uncached: usize,
    /// Cached casts of leaf variables, each with the depth of the guard it belongs to.
    cache: HashMap<(TensorId, DType), (usize, Tensor)>,
    stats: CastStats,
}

/// What this thread's conversions have done so far; differences of two readings say what one
/// op's casts did (the precision report's columns).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CastStats {
    /// Conversions performed (elided and cached ones excluded).
    pub casts: u64,
    /// Bytes those conversions wrote.
    pub bytes: u64,
    /// Casts of a master weight answered from the region's cache.
    pub cache_hits: u64,
}

impl std::ops::Sub for CastStats {
    type Output = Self;
    fn sub(self, before: Self) -> Self {
        Self {
            casts: self.casts - before.casts,
            bytes: self.bytes - before.bytes,
            cache_hits: self.cache_hits - before.cache_hits,
        }
    }
}

/// This thread's conversion counters.
pub(crate) fn stats() -> CastStats {
    STATE.with(|s| s.borrow().stats)
}

thread_local! {
    static STATE: RefCell<CastState> = RefCell::new(CastState::default());
}

/// The number of dtype conversions performed on this thread so far, by typed casts and by
/// autocast regions (elided and cached casts do not count). For tests and benchmarks.
pub fn cast_count() -> u64 {
    STATE.with(|s| s.borrow().stats.casts)
}

/// Counts conversions that a fused op performs inside itself (a layer rounding its f32 masters
/// while computing), `elements` values into `dtype` in all, so that [`cast_count`] and the
/// precision report tell the same story either way.
pub(crate) fn count_casts(n: u64, elements: usize, dtype: DType) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.stats.casts += n;
        s.stats.bytes += (elements * dtype.size_in_bytes()) as u64;
    });
}

/// Drops every cached weight cast on this thread (PyTorch's `torch.clear_autocast_cache()`).
///
/// candle-amp's optimizers and [`GradScaler::step`] call it after writing the master weights.
/// Anything else that writes a master in place inside a region part and then uses it again in
/// the same part must call it in between: candle's `Var::set` and candle-nn's optimizers copy
/// into the variable's own storage, and candle 0.11's tensors carry no version counter, so no
/// cache can tell that the value changed.
///
/// [`GradScaler::step`]: crate::scaler::GradScaler::step
pub fn clear_autocast_cache() {
    STATE.with(|s| s.borrow_mut().cache.clear());
}

/// PyTorch's `torch.is_autocast_cache_enabled()`: whether casts of master weights made here are
/// cached, that is, no region part running on this thread was entered with
/// `#[autocast(.., cache = false)]` (PyTorch's `cache_enabled=False`). Outside any region
/// nothing is cached, but the setting is on, as PyTorch's is by default.
pub fn is_autocast_cache_enabled() -> bool {
    STATE.with(|s| s.borrow().uncached == 0)
}

/// Marks a region part's extent on this thread: while one is alive, casts of leaf variables are
/// cached (unless a part turned the cache off); the casts made while it was the innermost are
/// dropped when it ends.
#[derive(Debug)]
pub struct RegionGuard {
    /// This part was entered with the cache off.
    uncached: bool,
    // Regions are per thread.
    _not_send: PhantomData<*const ()>,
}

impl RegionGuard {
    /// Enters a (possibly nested) region.
    #[allow(clippy::new_without_default)]
    pub fn enter() -> Self {
        Self::enter_cache(true)
    }

    /// Enters a region whose weight casts are cached or not (`#[autocast(.., cache = ..)]`,
    /// PyTorch's `cache_enabled`); with the cache off, neither this part nor what it calls
    /// caches a cast, whatever they declare.
    pub fn enter_cache(cache: bool) -> Self {
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.depth += 1;
            s.uncached += usize::from(!cache);
        });
        Self {
            uncached: !cache,
            _not_send: PhantomData,
        }
    }
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.depth -= 1;
            s.uncached -= usize::from(self.uncached);
            let depth = s.depth;
            s.cache.retain(|_, (owner, _)| *owner <= depth);
        });
    }
}

/// `t` as `dtype`: elided when the dtype matches, cached for leaf variables inside a region,
/// counted otherwise.
pub(crate) fn convert(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        return Ok(t.clone());
    }
    let key = (t.id(), dtype);
    let cacheable = t.is_variable()
        && STATE.with(|s| {
            let s = s.borrow();
            s.depth > 0 && s.uncached == 0
        });
    if cacheable {
        let hit = STATE.with(|s| {
            let mut s = s.borrow_mut();
            let hit = s.cache.get(&key).map(|(_, t)| t.clone());
            s.stats.cache_hits += u64::from(hit.is_some());
            hit
        });
        if let Some(hit) = hit {
            return Ok(hit);
        }
    }
    let converted = crate::kernels::to_dtype(t, dtype)?;
    tracing::trace!(
        target: "candle_amp::cast",
        from = ?t.dtype(),
        to = ?dtype,
        shape = ?t.dims(),
        cached = cacheable,
        "cast"
    );
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.stats.casts += 1;
        s.stats.bytes += (t.elem_count() * dtype.size_in_bytes()) as u64;
        if cacheable {
            let owner = s.depth;
            s.cache.insert(key, (owner, converted.clone()));
        }
    });
    Ok(converted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn same_dtype_is_elided_and_uncounted() -> Result<()> {
        let t = Tensor::ones(3, DType::F16, &Device::Cpu)?;
        let before = cast_count();
        let same = convert(&t, DType::F16)?;
        assert_eq!(same.id(), t.id());
        assert_eq!(cast_count(), before);
        Ok(())
    }

    #[test]
    fn leaf_variables_are_cast_once_per_region_part() -> Result<()> {
        let w = Var::ones(4, DType::F32, &Device::Cpu)?;
        let before = cast_count();
        {
            let _outer = RegionGuard::enter();
            let a = convert(w.as_tensor(), DType::F16)?;
            let _inner = RegionGuard::enter();
            let b = convert(w.as_tensor(), DType::F16)?;
            assert_eq!(a.id(), b.id(), "a nested part reuses its caller's cast");
        }
        assert_eq!(cast_count() - before, 1);
        // The outermost guard dropped the cache: the next region casts afresh.
        let _g = RegionGuard::enter();
        convert(w.as_tensor(), DType::F16)?;
        assert_eq!(cast_count() - before, 2);
        Ok(())
    }

    #[test]
    #[allow(clippy::float_cmp)] // sums of small integers, exact in f16 and f32
    fn a_cast_made_in_a_nested_part_ends_with_it() -> Result<()> {
        let w = Var::ones(4, DType::F32, &Device::Cpu)?;
        let _epoch = RegionGuard::enter();
        let forward = || -> Result<f32> {
            let _part = RegionGuard::enter();
            let h = convert(w.as_tensor(), DType::F16)?;
            let again = convert(w.as_tensor(), DType::F16)?;
            assert_eq!(h.id(), again.id());
            h.to_dtype(DType::F32)?.sum_all()?.to_scalar()
        };
        assert_eq!(forward()?, 4.0);
        // An optimizer step between two forwards, inside the outer region.
        w.set(&Tensor::full(2f32, 4, &Device::Cpu)?)?;
        assert_eq!(forward()?, 8.0, "the second forward sees the new weights");
        // A cast made in the outer part itself is dropped by the scaler's step.
        let stale = convert(w.as_tensor(), DType::F16)?;
        w.set(&Tensor::full(3f32, 4, &Device::Cpu)?)?;
        clear_autocast_cache();
        let fresh = convert(w.as_tensor(), DType::F16)?;
        assert_ne!(stale.id(), fresh.id());
        assert_eq!(
            fresh.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?,
            12.0
        );
        Ok(())
    }

    #[test]
    fn non_variables_are_never_cached() -> Result<()> {
        let t = Tensor::ones(4, DType::F32, &Device::Cpu)?;
        let _g = RegionGuard::enter();
        let before = cast_count();
        let a = convert(&t, DType::BF16)?;
        let b = convert(&t, DType::BF16)?;
        assert_ne!(a.id(), b.id());
        assert_eq!(cast_count() - before, 2);
        Ok(())
    }
}
