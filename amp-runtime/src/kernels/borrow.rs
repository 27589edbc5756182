//! Many tensors' storages held at once, for a pass over all of them (the gradient scaler's
//! unscale, on CPU and CUDA).
//!
//! candle lends a storage mutably only inside `inplace_op1`, one storage a call. The frames here
//! nest those calls: each frame's op borrows one storage, makes its view ([`Borrowed`]) and
//! calls the next frame from inside, so that when the innermost frame runs the body, every
//! storage is write-locked by a frame below it (and, on CUDA, every write guard is held, which
//! orders the body's launches after earlier work on each storage and later work after them).

use std::cell::RefCell;

use candle_core::{CpuStorage, InplaceOp1, Layout, Result, Tensor};

/// What a pass sees of one borrowed storage.
pub(crate) trait Borrowed: Sized {
    /// Calls `then` with the view of a CPU storage; the default refuses CPU storages.
    fn cpu(
        _storage: &mut CpuStorage,
        _layout: &Layout,
        _then: &mut dyn FnMut(Self) -> Result<()>,
    ) -> Result<()> {
        candle_core::bail!("multi-tensor pass: a CPU tensor reached a pass without a CPU path")
    }

    /// Calls `then` with the view of a CUDA storage, holding whatever guard the view needs
    /// until `then` returns; the default refuses CUDA storages.
    #[cfg(feature = "cuda")]
    fn cuda(
        _storage: &mut candle_core::CudaStorage,
        _layout: &Layout,
        _then: &mut dyn FnMut(Self) -> Result<()>,
    ) -> Result<()> {
        candle_core::bail!("multi-tensor pass: a CUDA tensor reached a pass without a CUDA path")
    }
}

/// The work done while every storage is borrowed.
type Body<'a, V> = dyn FnMut(&[V]) -> Result<()> + 'a;

/// Runs `body` with the views of every tensor's storage, all borrowed at once. The tensors'
/// storages must be distinct (one storage borrowed twice is candle's lock error).
pub(crate) fn with_borrowed<V: Borrowed>(tensors: &[Tensor], body: &mut Body<'_, V>) -> Result<()> {
    enter(tensors, &mut Vec::with_capacity(tensors.len()), body)
}

fn enter<V: Borrowed>(
    tensors: &[Tensor],
    views: &mut Vec<V>,
    body: &mut Body<'_, V>,
) -> Result<()> {
    match tensors.split_first() {
        None => body(views),
        Some((first, rest)) => first.inplace_op1(&Frame {
            rest,
            views: RefCell::new(views),
            body: RefCell::new(body),
        }),
    }
}

/// One frame: borrows one storage and enters the rest.
struct Frame<'a, V> {
    rest: &'a [Tensor],
    views: RefCell<&'a mut Vec<V>>,
    body: RefCell<&'a mut Body<'a, V>>,
}

impl<V: Borrowed> Frame<'_, V> {
    fn with(&self, view: V) -> Result<()> {
        let mut views = self.views.borrow_mut();
        views.push(view);
        let mut body = self.body.borrow_mut();
        let result = enter(self.rest, &mut views, &mut **body);
        views.pop();
        result
    }
}

impl<V: Borrowed> InplaceOp1 for Frame<'_, V> {
    fn name(&self) -> &'static str {
        "amp-multi-tensor-borrow"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        V::cpu(storage, layout, &mut |view| self.with(view))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &mut candle_core::CudaStorage, layout: &Layout) -> Result<()> {
        V::cuda(storage, layout, &mut |view| self.with(view))
    }
}
