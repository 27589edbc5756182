//! The one place a dtype conversion happens, with its per-thread weight-cast cache and counter.
//!
//! Typed casts (`Tensor::cast`), region routing and the layers' weight casts all call
//! [`convert`]: a conversion to the dtype a tensor already has is elided (a handle clone), every
//! other one is counted ([`cast_count`], for tests and benchmarks), and a conversion of a leaf
//! variable (a master weight) is cached while a [`RegionGuard`] is alive on the thread, so a
//! weight used several times in one region is cast once, as PyTorch's autocast does. The cache
//! is dropped when the outermost guard ends, so a weight updated by the optimizer between two
//! regions is cast afresh.
//!
//! Depends on candle only: everything above (typed tensors, regions, layers) converts through it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;

use candle_core::{DType, Result, Tensor, TensorId};

#[derive(Default)]
struct CastState {
    /// How many region guards are alive on this thread.
    depth: usize,
    cache: HashMap<(TensorId, DType), Tensor>,
    casts: u64,
}

thread_local! {
    static STATE: RefCell<CastState> = RefCell::new(CastState::default());
}

/// The number of dtype conversions performed on this thread so far, by typed casts and by
/// autocast regions (elided and cached casts do not count). For tests and benchmarks.
pub fn cast_count() -> u64 {
    STATE.with(|s| s.borrow().casts)
}

/// Marks an autocast region's extent on this thread: while one is alive, casts of leaf
/// variables are cached; the cache is dropped when the outermost one ends.
#[derive(Debug)]
pub struct RegionGuard {
    // Regions are per thread.
    _not_send: PhantomData<*const ()>,
}

impl RegionGuard {
    /// Enters a (possibly nested) region.
    #[allow(clippy::new_without_default)]
    pub fn enter() -> Self {
        STATE.with(|s| s.borrow_mut().depth += 1);
        Self {
            _not_send: PhantomData,
        }
    }
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.depth -= 1;
            if s.depth == 0 {
                s.cache.clear();
            }
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
    let cacheable = t.is_variable() && STATE.with(|s| s.borrow().depth > 0);
    if cacheable {
        if let Some(hit) = STATE.with(|s| s.borrow().cache.get(&key).cloned()) {
            return Ok(hit);
        }
    }
    let converted = t.to_dtype(dtype)?;
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.casts += 1;
        if cacheable {
            s.cache.insert(key, converted.clone());
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
    fn leaf_variables_are_cast_once_per_region() -> Result<()> {
        let w = Var::ones(4, DType::F32, &Device::Cpu)?;
        let before = cast_count();
        {
            let _outer = RegionGuard::enter();
            let a = convert(w.as_tensor(), DType::F16)?;
            let _inner = RegionGuard::enter();
            let b = convert(w.as_tensor(), DType::F16)?;
            assert_eq!(a.id(), b.id(), "the nested region reuses the cached cast");
        }
        assert_eq!(cast_count() - before, 1);
        // The outermost guard dropped the cache: the next region casts afresh.
        let _g = RegionGuard::enter();
        convert(w.as_tensor(), DType::F16)?;
        assert_eq!(cast_count() - before, 2);
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
