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
use std::mem::MaybeUninit;

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
    barrier_pool().execute_chunked(n, |range| {
        let _in_pass = InPass::enter();
        range.for_each(&f);
    });
}

/// Calls `f(i, chunk)` for consecutive chunks of `data` of `size` elements (the last may be
/// shorter), `i` counting them, in parallel as [`for_each_index`].
pub(crate) fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    size: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let (len, size) = (data.len(), size.max(1));
    let base = Base(data.as_mut_ptr());
    for_each_index(len.div_ceil(size), |i| {
        let start = i * size;
        let end = (start + size).min(len);
        // SAFETY: `start..end` lies in `data`, which is borrowed mutably for this call; each
        // index is handed out once, so the chunks given out are disjoint.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.at(start), end - start) };
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
    let base_a = Base(a.spare_capacity_mut().as_mut_ptr());
    let base_b = Base(b.spare_capacity_mut().as_mut_ptr());
    let (zero_a, zero_b) = (A::from_f64(0.0), B::from_f64(0.0));
    for_each_index(len.div_ceil(size), |i| {
        let start = i * size;
        let n = size.min(len - start);
        // SAFETY: `start..start + n` lies in both vectors' capacity; each index is handed out
        // once, so the chunks given out are disjoint. Each chunk is initialised before it is
        // viewed as values (`MaybeUninit<T>` has `T`'s layout).
        let (ca, cb) = unsafe {
            let ca = std::slice::from_raw_parts_mut(base_a.at(start), n);
            let cb = std::slice::from_raw_parts_mut(base_b.at(start), n);
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
    let slots = Base(out.as_mut_ptr());
    for_each_chunk_mut(data, size, |i, chunk| {
        let value = f(i, chunk);
        // SAFETY: `i` indexes `out` (one slot per chunk), and each index runs once.
        unsafe { *slots.at(i) = Some(value) };
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

/// The base pointer of a slice whose disjoint chunks threads write.
struct Base<T>(*mut T);
// SAFETY: only disjoint chunks are formed from it, each on one thread (`for_each_chunk_mut`).
unsafe impl<T: Send> Send for Base<T> {}
unsafe impl<T: Send> Sync for Base<T> {}

impl<T> Base<T> {
    /// # Safety
    /// `offset` is within the slice.
    unsafe fn at(&self, offset: usize) -> *mut T {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.add(offset) }
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
}
