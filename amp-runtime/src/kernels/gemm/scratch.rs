//! The buffers the GEMM packs into, kept from call to call.

use std::cell::RefCell;
use std::sync::Mutex;

use super::params::CACHE_LINE;

/// A packed unit type, with buffers to pack into that are reused from call to call, never
/// zero-filled: packing rewrites every unit a tile reads (lanes past the last full panel's rows
/// or columns may keep stale values: they only reach accumulators that are never stored; the
/// padding units are written as zeros). A's buffer is the worker thread's own; B's is one
/// process-wide buffer, taken by a GEMM for its duration and given back, so what is kept does
/// not depend on which threads ran which GEMM (a peak-memory measurement after one warm-up step
/// stays stable).
pub(super) trait Scratch: Copy + Default + Send + Sync + 'static {
    /// The thread's A buffer for this unit type.
    fn a_buffer() -> &'static std::thread::LocalKey<RefCell<Vec<Self>>>;
    /// The kept B buffer for this unit type.
    fn b_kept() -> &'static Mutex<Option<Vec<Self>>>;

    /// Runs `f` on `len` units of the thread's A buffer (a fresh one when it is in use: a
    /// GEMM called from inside another GEMM's task).
    fn with_a<R>(len: usize, f: impl FnOnce(&mut [Self]) -> R) -> R {
        Self::a_buffer().with(|cell| match cell.try_borrow_mut() {
            Ok(mut buf) => f(grown(&mut buf, len)),
            Err(_) => f(grown(&mut Vec::new(), len)),
        })
    }

    /// Runs `f` on `len` units of the kept B buffer (grown if need be), or of a new one when
    /// another GEMM has it; the larger of the two is kept afterwards.
    fn with_b<R>(len: usize, f: impl FnOnce(&mut [Self]) -> R) -> R {
        let lock = || {
            Self::b_kept()
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        let mut buf = lock().take().unwrap_or_default();
        let result = f(grown(&mut buf, len));
        // One buffer is kept, the largest: GEMMs running at the same time beyond the first
        // allocate and free their own, as they would without it.
        let mut kept = lock();
        if kept.as_ref().is_none_or(|k| k.len() < buf.len()) {
            *kept = Some(buf);
        }
        result
    }
}

/// `len` units of `buf` from its first cache-line boundary, `buf` grown with zeros if it is
/// too short. The first panel starts on a cache line, and with it every AMX panel (whole lines
/// long) and each 64-byte row of an AMX tile, which loads fastest from whole lines; the
/// allocator only promises 16 bytes.
pub(super) fn grown<U: Copy + Default>(buf: &mut Vec<U>, len: usize) -> &mut [U] {
    let slack = CACHE_LINE / std::mem::size_of::<U>();
    if buf.len() < len + slack {
        buf.resize(len + slack, U::default());
    }
    // At most `slack - 1` for a unit that divides the line (f32, u32); never past `slack`.
    let skip = buf.as_ptr().align_offset(CACHE_LINE).min(slack);
    &mut buf[skip..skip + len]
}

thread_local! {
    static F32_UNITS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static PAIR_UNITS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

static F32_PANELS: Mutex<Option<Vec<f32>>> = Mutex::new(None);
static PAIR_PANELS: Mutex<Option<Vec<u32>>> = Mutex::new(None);

impl Scratch for f32 {
    fn a_buffer() -> &'static std::thread::LocalKey<RefCell<Vec<f32>>> {
        &F32_UNITS
    }
    fn b_kept() -> &'static Mutex<Option<Vec<f32>>> {
        &F32_PANELS
    }
}

impl Scratch for u32 {
    fn a_buffer() -> &'static std::thread::LocalKey<RefCell<Vec<u32>>> {
        &PAIR_UNITS
    }
    fn b_kept() -> &'static Mutex<Option<Vec<u32>>> {
        &PAIR_PANELS
    }
}
