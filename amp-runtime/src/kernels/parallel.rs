//! The kernels' thread pool: candle's own CPU pool, the one its element-wise ops run on.
//!
//! candle 0.11 runs its CPU element-wise ops on a pool of its own (`candle_core::utils::
//! barrier_pool`: the calling thread plus one worker per other core), whose workers spin for a
//! while after each op before they sleep. Kernels on rayon's pool would add a second set of
//! workers: on a machine with few cores, a candle worker still spinning after an add then
//! competes with the GEMM's rayon workers for the same cores (on 2 cores the spinning took
//! about a seventh of all CPU time of a bf16 training step). Running the kernels on candle's
//! pool keeps one worker per core for everything.

use std::cell::Cell;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::{Mutex, PoisonError};

use candle_core::utils::barrier_pool;

/// How many threads a parallel pass runs on (the calling thread included).
pub(crate) fn threads() -> usize {
    barrier_pool().n_workers() + 1
}

thread_local! {
    /// Whether this thread is running a pass's calls (nested passes then run inline: candle's
    /// pool takes one pass at a time, and its calling thread would wait on itself).
    static IN_PASS: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as inside a pass until dropped (also when a call panics).
struct InPass(bool);

impl InPass {
    fn enter() -> Self {
        Self(IN_PASS.with(|p| p.replace(true)))
    }
}

impl Drop for InPass {
    fn drop(&mut self) {
        IN_PASS.with(|p| p.set(self.0));
    }
}

/// Calls `f(i)` once for every `i` in `0..n`, spread over the pool's threads (the caller's
/// included), which take indices in order as they become free. Returns when all calls have.
/// Inside a pass (a kernel called from a kernel's call) the calls run on the calling thread.
pub(crate) fn for_each_index(n: usize, f: impl Fn(usize) + Sync) {
    if n <= 1 || IN_PASS.with(Cell::get) {
        (0..n).for_each(f);
        return;
    }
    // A call's panic is caught here and resumed on the calling thread once the pass is over:
    // unwinding through candle's pool would poison its lock (candle 0.11 unwraps it), and every
    // later pass of the process, ours and candle's own, would then panic.
    let panicked = Mutex::new(None);
    barrier_pool().execute_chunked(n, |range| {
        let _in_pass = InPass::enter();
        let run = std::panic::AssertUnwindSafe(|| range.for_each(&f));
        if let Err(payload) = std::panic::catch_unwind(run) {
            panicked
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_or_insert(payload);
        }
    });
    let payload = panicked
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(payload) = payload {
        std::panic::resume_unwind(payload);
    }
}

/// Calls `f(i, chunk)` for consecutive chunks of `data` of `size` elements (the last may be
/// shorter), `i` counting them, in parallel as [`for_each_index`].
pub(crate) fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    size: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let (len, size) = (data.len(), size.max(1));
    let data = Disjoint::new(data);
    for_each_index(len.div_ceil(size), |i| {
        let start = i * size;
        let end = (start + size).min(len);
        // SAFETY: each index is handed out once, so the chunks given out are disjoint.
        let chunk = unsafe { data.part(start, end - start) };
        f(i, chunk);
    });
}

/// A new vector of `len` values written by `f(i, chunk)` over its chunks of `size`, in parallel
/// as [`for_each_chunk_mut`]: a kernel's output. Each chunk is zero-filled by the call that
/// writes it, just before, rather than the whole vector by the calling thread first (`vec![0;
/// len]`) while the others wait: the chunk's memory comes into its writer's cache once, and the
/// zeros cost only cache-speed stores.
pub(crate) fn filled<T: candle_core::WithDType>(
    len: usize,
    size: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(len);
    for_each_chunk_mut(&mut out.spare_capacity_mut()[..len], size, |i, chunk| {
        chunk.fill(MaybeUninit::new(T::from_f64(0.0)));
        // SAFETY: every element of the chunk was just initialised, and `MaybeUninit<T>` has
        // `T`'s layout.
        let chunk = unsafe { &mut *(std::ptr::from_mut(chunk) as *mut [T]) };
        f(i, chunk);
    });
    // SAFETY: the chunks cover `0..len`, and each was initialised (a panicking call unwinds
    // past this, and the vector is dropped empty).
    unsafe { out.set_len(len) };
    out
}

/// Two new vectors of `len` values written together, as [`filled`] writes one: `f(i, a, b)`
/// gets chunk `i` of each (a kernel with two outputs from one pass over its input).
pub(crate) fn filled_pair<A: candle_core::WithDType, B: candle_core::WithDType>(
    len: usize,
    size: usize,
    f: impl Fn(usize, &mut [A], &mut [B]) + Sync,
) -> (Vec<A>, Vec<B>) {
    let size = size.max(1);
    let (mut a, mut b): (Vec<A>, Vec<B>) = (Vec::with_capacity(len), Vec::with_capacity(len));
    let base_a = Disjoint::new(&mut a.spare_capacity_mut()[..len]);
    let base_b = Disjoint::new(&mut b.spare_capacity_mut()[..len]);
    let (zero_a, zero_b) = (A::from_f64(0.0), B::from_f64(0.0));
    for_each_index(len.div_ceil(size), |i| {
        let start = i * size;
        let n = size.min(len - start);
        // SAFETY: each index is handed out once, so the chunks given out are disjoint. Each
        // chunk is initialised before it is viewed as values (`MaybeUninit<T>` has `T`'s
        // layout).
        let (ca, cb) = unsafe {
            let ca = base_a.part(start, n);
            let cb = base_b.part(start, n);
            ca.fill(MaybeUninit::new(zero_a));
            cb.fill(MaybeUninit::new(zero_b));
            (
                &mut *(std::ptr::from_mut(ca) as *mut [A]),
                &mut *(std::ptr::from_mut(cb) as *mut [B]),
            )
        };
        f(i, ca, cb);
    });
    // SAFETY: the chunks cover `0..len` of both, and each was initialised (a panicking call
    // unwinds past this, and the vectors are dropped empty).
    unsafe {
        a.set_len(len);
        b.set_len(len);
    }
    (a, b)
}

/// `f(i, chunk)` over the chunks of `data` as [`for_each_chunk_mut`], and what each call
/// returned, in chunk order (so a reduction over them is the same at every run).
pub(crate) fn map_chunks_mut<T: Send, R: Send>(
    data: &mut [T],
    size: usize,
    f: impl Fn(usize, &mut [T]) -> R + Sync,
) -> Vec<R> {
    let size = size.max(1);
    let mut out: Vec<Option<R>> = std::iter::repeat_with(|| None)
        .take(data.len().div_ceil(size))
        .collect();
    let slots = Disjoint::new(&mut out);
    for_each_chunk_mut(data, size, |i, chunk| {
        let value = f(i, chunk);
        // SAFETY: `i` indexes `out` (one slot per chunk), and each index runs once.
        unsafe { slots.part(i, 1)[0] = Some(value) };
    });
    out.into_iter()
        .map(|r| r.expect("every chunk was mapped"))
        .collect()
}

/// `f(i)` for every `i` in `0..n`, in parallel as [`for_each_index`], collected in order.
pub(crate) fn map_indices<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let mut unit = vec![(); n];
    map_chunks_mut(&mut unit, 1, |i, _| f(i))
}

/// A slice the tasks of one parallel pass write in disjoint parts: each task forms pointers or
/// sub-slices into it for the elements it alone writes. Every pointer it hands out is checked
/// against the slice's length; that no two tasks touch one element is the caller's to keep
/// (each index of a pass runs once), and what its `unsafe` blocks state.
#[derive(Debug)]
pub(crate) struct Disjoint<'a, T> {
    ptr: *mut T,
    len: usize,
    borrow: PhantomData<&'a mut [T]>,
}

impl<T> Clone for Disjoint<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Disjoint<'_, T> {}

// SAFETY: the tasks holding copies write disjoint elements (the invariant above), each on one
// thread, so sharing the pointer is sharing `&mut` access to disjoint parts of a `Send` slice.
unsafe impl<T: Send> Send for Disjoint<'_, T> {}
// SAFETY: as for `Send`.
unsafe impl<T: Send> Sync for Disjoint<'_, T> {}

impl<'a, T> Disjoint<'a, T> {
    /// The slice, borrowed for as long as the tasks write it.
    pub(crate) fn new(data: &'a mut [T]) -> Self {
        Self {
            ptr: data.as_mut_ptr(),
            len: data.len(),
            borrow: PhantomData,
        }
    }

    /// A pointer to element `offset`, of which `count` elements from it lie inside the slice
    /// (a panic otherwise).
    pub(crate) fn at(&self, offset: usize, count: usize) -> *mut T {
        assert!(
            offset.checked_add(count).is_some_and(|end| end <= self.len),
            "disjoint write of {count} elements at {offset} past a slice of {}",
            self.len
        );
        // SAFETY: `offset <= len`, so the pointer stays inside (or one past) the slice.
        unsafe { self.ptr.add(offset) }
    }

    /// The elements `start..start + len`, bounds checked.
    ///
    /// # Safety
    /// No other task reads or writes these elements while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn part(&self, start: usize, len: usize) -> &'a mut [T] {
        let at = self.at(start, len);
        // SAFETY: `at` checked the range lies in the borrowed slice; exclusivity is the
        // caller's.
        unsafe { std::slice::from_raw_parts_mut(at, len) }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Every element is the one its chunk's call wrote, for lengths that end inside a chunk,
    /// on a chunk edge, and empty; a call that writes nothing leaves zeros.
    #[test]
    fn filled_holds_what_each_chunk_wrote() {
        for (len, size) in [(0, 4), (1, 4), (7, 3), (12, 4), (1000, 64)] {
            #[allow(clippy::cast_precision_loss)] // small indices
            let v: Vec<f32> = filled(len, size, |i, chunk| {
                for (j, x) in chunk.iter_mut().enumerate() {
                    *x = (i * size + j) as f32;
                }
            });
            #[allow(clippy::cast_precision_loss)]
            let want: Vec<f32> = (0..len).map(|i| i as f32).collect();
            assert_eq!(v, want, "len {len}, chunks of {size}");
        }
        let zeros: Vec<half::bf16> = filled(33, 8, |_, _| {});
        assert!(zeros.iter().all(|x| x.to_bits() == 0));
    }

    #[test]
    fn filled_pair_holds_what_each_chunk_wrote_in_both() {
        for (len, size) in [(0, 4), (1, 4), (7, 3), (12, 4), (1000, 64)] {
            #[allow(clippy::cast_precision_loss)] // small indices
            let (a, b): (Vec<f32>, Vec<half::bf16>) = filled_pair(len, size, |i, a, b| {
                assert_eq!(a.len(), b.len());
                for (j, (x, y)) in a.iter_mut().zip(b).enumerate() {
                    *x = (i * size + j) as f32;
                    *y = half::bf16::from_f32(-((i * size + j) as f32));
                }
            });
            #[allow(clippy::cast_precision_loss)]
            let want: Vec<f32> = (0..len).map(|i| i as f32).collect();
            assert_eq!(a, want, "len {len}, chunks of {size}");
            let b: Vec<f32> = b.iter().map(|v| -v.to_f32()).collect();
            let rounded: Vec<f32> = want
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            assert_eq!(b, rounded, "len {len}, chunks of {size}");
        }
    }

    #[test]
    fn every_index_runs_once_and_chunks_cover_the_slice() {
        for n in [0, 1, 2, 7, 1000] {
            let counts: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for_each_index(n, |i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                "n {n}"
            );
        }
        let mut data = vec![0usize; 1003];
        for_each_chunk_mut(&mut data, 10, |i, chunk| {
            for (j, x) in chunk.iter_mut().enumerate() {
                *x += i * 10 + j + 1;
            }
        });
        assert!(data.iter().enumerate().all(|(i, &x)| x == i + 1));
        let sums = map_chunks_mut(&mut data, 100, |i, chunk| (i, chunk.iter().sum::<usize>()));
        let expected: Vec<(usize, usize)> = (0..11)
            .map(|i| (i, (i * 100 + 1..=(i * 100 + 100).min(1003)).sum()))
            .collect();
        assert_eq!(sums, expected);
        assert_eq!(map_indices(5, |i| i * i), vec![0, 1, 4, 9, 16]);
    }

    #[test]
    fn a_pass_inside_a_pass_runs_inline() {
        let total = AtomicUsize::new(0);
        for_each_index(8, |_| {
            for_each_index(8, |_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 64);
    }

    /// A call that panics inside a pass (on whichever thread ran its chunk) reaches the caller
    /// as that panic, the half-written output is dropped, and the pool and the in-pass flag are
    /// as before: the next pass, and candle's own ops on the same pool, still run.
    #[test]
    fn a_panic_in_a_chunk_reaches_the_caller_and_leaves_the_pool_usable() {
        for bad in [0, 7, 15] {
            let caught = std::panic::catch_unwind(|| {
                filled::<f32>(16 * 64, 64, |i, chunk| {
                    assert!(i != bad, "chunk {i} fails");
                    chunk.fill(1.0);
                })
            });
            let message = caught.expect_err("the panic reaches the caller");
            let text = message
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_default();
            assert_eq!(text, format!("chunk {bad} fails"));
            assert!(!IN_PASS.with(Cell::get), "the in-pass flag is reset");
            let out = filled::<f32>(16 * 64, 64, |_, chunk| chunk.fill(2.0));
            assert!(out.iter().all(|x| x.to_bits() == 2f32.to_bits()));
            let big = candle_core::Tensor::ones(
                1 << 16,
                candle_core::DType::F32,
                &candle_core::Device::Cpu,
            )
            .and_then(|t| t.affine(2.0, 1.0))
            .and_then(|t| t.sum_all())
            .and_then(|t| t.to_scalar::<f32>())
            .expect("candle's element-wise ops after the panic");
            assert_eq!(big.to_bits(), (3.0 * 65536f32).to_bits());
        }
    }

    /// `Disjoint` refuses a part past the end of its slice.
    #[test]
    fn a_disjoint_part_past_the_end_panics() {
        let mut data = [0u8; 8];
        let parts = Disjoint::new(&mut data);
        let _ = parts.at(4, 4);
        let past = std::panic::catch_unwind(|| parts.at(5, 4));
        assert!(past.is_err(), "5..9 of 8 elements");
        let overflow = std::panic::catch_unwind(|| parts.at(usize::MAX, 2));
        assert!(overflow.is_err(), "an overflowing range");
    }
}
