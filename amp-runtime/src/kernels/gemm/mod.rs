//! A packed, cache-blocked GEMM with f32 accumulation for f32, bf16 and f16 operands on CPU.
//!
//! `C (m x n, f32) = A (m x k) * B (k x n)` on strided views of any of the three element types,
//! blocked as BLIS does: for each `NC`-column slice of B and each `KC`-deep slice of the inner
//! dimension, B is packed once into `NR`-column micro-panels, then blocks of `MC` rows of A are
//! packed into `MR`-row micro-panels and a register-blocked micro-kernel computes each
//! `MR x NR` tile of C. Packing is where the element types meet the kernels:
//!
//! - **bf16 on AMX** (`tdpbf16ps`, Sapphire Rapids and later, see [`amx`]): 8192 multiply-adds
//!   per instruction on tile registers, 16 times an AVX-512 FMA.
//! - **bf16 on AVX512-BF16** (`vdpbf16ps`, Zen 4): packing interleaves pairs of consecutive `k`
//!   into one 32-bit lane, and each `_mm512_dpbf16_ps` does 32 multiply-adds into 16 f32
//!   accumulators, twice the multiply-adds of an f32 FMA at the same width on Zen 4 (on Intel
//!   cores it issues at half the FMA rate, so there it only matches f32).
//! - **everything else** converts to f32 while packing (f16 keeps its 10-bit mantissa: it never
//!   goes through bf16) and runs an f32 kernel: AVX-512 FMA where the CPU has it, portable Rust
//!   otherwise. The kernel is chosen once per process by run-time feature detection.
//!
//! Work is split over the kernels' pool (`super::parallel`) by blocks of rows of C and, when
//! there are few of those, by groups of B's micro-panels too; each task writes its own tiles of
//! C.

#[cfg(target_arch = "x86_64")]
mod amx;
mod driver;
mod pack;
#[cfg(target_arch = "x86_64")]
mod pack_bf16;
mod params;
mod portable;
mod resident;
mod scratch;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

pub(crate) use params::{isa, Isa};
pub(crate) use resident::{rows_as_units, Bf16Products, PackedB, UnitRows};

use std::mem::MaybeUninit;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::elem::Real;
use driver::{blocked, Problem};
use pack::Lanes;
use scratch::Scratch;

/// A strided matrix view: element `(i, j)` is `data[offset + i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatRef<'a, T> {
    pub data: &'a [T],
    pub offset: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> MatRef<'a, T> {
    /// The matrix a 2-D layout describes in `data`: its start offset and its two strides.
    pub fn from_layout(data: &'a [T], l: &candle_core::Layout) -> Self {
        Self {
            data,
            offset: l.start_offset(),
            rs: l.stride()[0],
            cs: l.stride()[1],
        }
    }

    /// The same view (offset and strides) over other data, of the same length in elements.
    pub fn with_data<'b, E>(&self, data: &'b [E]) -> MatRef<'b, E> {
        MatRef {
            data,
            offset: self.offset,
            rs: self.rs,
            cs: self.cs,
        }
    }

    /// A row-major matrix of `row_len` columns starting at `offset`.
    pub fn row_major(data: &'a [T], offset: usize, row_len: usize) -> Self {
        Self {
            data,
            offset,
            rs: row_len,
            cs: 1,
        }
    }
}

#[cfg(test)]
impl<T: Copy> MatRef<'_, T> {
    fn at(&self, i: usize, j: usize) -> T {
        self.data[self.offset + i * self.rs + j * self.cs]
    }
}

/// An element type the GEMM reads: its f32 value (`Real`) and its bf16 bits.
pub(crate) trait GemmElem: Real + Send + Sync + 'static {
    const IS_BF16: bool = false;

    /// The value rounded to bf16, as bits (the identity for bf16 itself).
    #[inline]
    fn bf16_bits(self) -> u16 {
        bf16::from_f32(self.get()).to_bits()
    }

    /// The elements' bits, when they are bf16.
    fn bf16_slice(_data: &[Self]) -> Option<&[u16]> {
        None
    }
}

impl GemmElem for f32 {}
impl GemmElem for f16 {}
impl GemmElem for bf16 {
    const IS_BF16: bool = true;

    fn bf16_slice(data: &[Self]) -> Option<&[u16]> {
        Some(data.reinterpret_cast())
    }

    #[inline]
    fn bf16_bits(self) -> u16 {
        self.to_bits()
    }
}

/// `x` rounded to `T`: the identity when `S` is `T`, else the conversion the cast op performs
/// (`half`'s, to nearest even). How a master operand of another type than the product's is read.
#[inline]
fn rounded<S: GemmElem, T: GemmElem>(x: S) -> T {
    if same_type::<S, T>() {
        // SAFETY: `S` and `T` are the same type.
        unsafe { std::mem::transmute_copy(&x) }
    } else {
        T::put(x.get())
    }
}

/// Whether `S` and `T` are one type (a master operand is read as another).
fn same_type<S: 'static, T: 'static>() -> bool {
    std::any::TypeId::of::<S>() == std::any::TypeId::of::<T>()
}

/// The unit of the bf16 kernels: two consecutive `k` rounded to bf16, the first in the low
/// half (the order `vdpbf16ps` and `tdpbf16ps` pair them in).
#[inline]
fn bf16_pair<T: GemmElem>(first: T, last: T) -> u32 {
    u32::from(first.bf16_bits()) | (u32::from(last.bf16_bits()) << 16)
}

/// `c = a * b` (or `c += a * b` with `accumulate`) where `a` is `m x k`, `b` is `k x n` and `c`
/// is `m x n` row-major with leading dimension `n`, in any of the three types: each element
/// is accumulated in f32 over the whole of `k` and rounded once. Runs on the kernels' pool when
/// `parallel`.
///
/// `b` may hold another type than `a` (an f32 master weight beside half activations): the
/// product is `a`'s type's, and `b`'s values are rounded to it as they are packed, bit for bit
/// what converting `b` first would give, without the converted copy.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<T: GemmElem, B: GemmElem, O: Real + Send + Sync>(
    m: usize,
    n: usize,
    k: usize,
    a: MatRef<T>,
    b: MatRef<B>,
    c: &mut [O],
    accumulate: bool,
    parallel: bool,
) {
    // SAFETY: `MaybeUninit<O>` has `O`'s layout, and only initialised values are written
    // through the view.
    let c = unsafe { &mut *(std::ptr::from_mut(c) as *mut [MaybeUninit<O>]) };
    run(m, n, k, a, b, c, accumulate, parallel);
}

/// `c = a * b` into memory that need not be initialised (a fresh output buffer, spared its
/// zero-filling): every element of the `m x n` block is written.
pub(crate) fn gemm_uninit<T: GemmElem, B: GemmElem, O: Real + Send + Sync>(
    (m, n, k): (usize, usize, usize),
    a: MatRef<T>,
    b: MatRef<B>,
    c: &mut [MaybeUninit<O>],
    parallel: bool,
) {
    run(m, n, k, a, b, c, false, parallel);
}

/// Appends `a * b` (`m x n`, row-major) to `out`: the GEMM writes it into the vector's spare
/// capacity, nothing is zero-filled first.
pub(crate) fn gemm_append<T: GemmElem, B: GemmElem, O: Real + Send + Sync>(
    out: &mut Vec<O>,
    (m, n, k): (usize, usize, usize),
    a: MatRef<T>,
    b: MatRef<B>,
    parallel: bool,
) {
    let (start, len) = (out.len(), m * n);
    out.reserve(len);
    run(
        m,
        n,
        k,
        a,
        b,
        &mut out.spare_capacity_mut()[..len],
        false,
        parallel,
    );
    // SAFETY: without `accumulate`, `run` writes every element of the `m x n` block (zeros for
    // `k = 0`; nothing to write when `m` or `n` is 0).
    unsafe { out.set_len(start + len) };
}

/// [`gemm`] on a possibly uninitialised `c`, which `accumulate` requires initialised.
#[allow(clippy::too_many_arguments)]
fn run<T: GemmElem, B: GemmElem, O: Real + Send + Sync>(
    m: usize,
    n: usize,
    k: usize,
    a: MatRef<T>,
    b: MatRef<B>,
    c: &mut [MaybeUninit<O>],
    accumulate: bool,
    parallel: bool,
) {
    assert!(c.len() >= m * n, "gemm: output of {} for {m}x{n}", c.len());
    if m == 0 || n == 0 {
        return;
    }
    let p = Problem {
        m,
        n,
        k,
        a,
        b,
        accumulate,
        parallel,
    };
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(MaybeUninit::new(O::put(0.0)));
        }
        return;
    }
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Amx(cpu) if T::IS_BF16 => blocked(&p, c, amx::AmxKernel(cpu)),
        #[cfg(target_arch = "x86_64")]
        Isa::Amx(cpu) => blocked(&p, c, x86::F32Kernel(cpu.avx512())),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16(cpu) if T::IS_BF16 => blocked(&p, c, x86::Bf16Kernel(cpu)),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16(cpu) => blocked(&p, c, x86::F32Kernel(cpu.avx512())),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512(cpu) => blocked(&p, c, x86::F32Kernel(cpu)),
        Isa::Portable => blocked(&p, c, portable::F32Kernel),
    }
}

/// A register-blocked micro-kernel and the packed layout it reads. A kernel is a value, and the
/// value is the proof that this CPU runs the kernel's instructions: the x86 kernels hold a
/// feature token ([`x86::Avx512`], [`x86::Avx512Bf16`], [`amx::AmxBf16`]) that only run-time
/// detection makes, so no path reaches their vector code on a CPU without it.
trait Kernel: Copy + Send + Sync + 'static {
    /// One packed unit: `KSTEP` consecutive `k` of one row of A or one column of B.
    type Unit: Scratch;
    const MR: usize;
    const NR: usize;
    /// How many `k` one unit holds.
    const KSTEP: usize;
    /// Units per block of an A micro-panel, laid out `[block][lane][unit of the block]`: 1 is
    /// `[unit][lane]`, one broadcast per unit; AMX loads a block of 16 units of 16 rows as one
    /// tile. Both panels are padded with zero units to a whole number of blocks.
    const A_BLOCK: usize = 1;

    /// Runs `f`, a task's tile calls, with whatever state the kernel's instructions need set
    /// up once around them (AMX: the tile configuration).
    fn with_state<R>(self, f: impl FnOnce() -> R) -> R {
        f()
    }

    /// Packs what the kernel has a vector path for, a rectangle of lanes and units from the
    /// first of each, and returns its size; [`pack::pack`] does the rest. `v` may be of another
    /// type than the product's (a master): kernels with a fast path have one unit type, so its
    /// values are rounded to that type (bf16) whatever the product's type.
    fn pack_fast<S: GemmElem>(
        self,
        _v: MatRef<S>,
        _lanes: Lanes,
        _whole: usize,
        _out: &mut [Self::Unit],
    ) -> (usize, usize) {
        (0, 0)
    }

    /// [`pack::pack_panels`]' walk along the rows of a B whose lanes are contiguous at each
    /// `k`, where the kernel has a vector path: lanes `first..first + count` of `v` for every
    /// unit below `whole`, into consecutive `NR`-lane panels of `units` units. Returns how many
    /// lanes from `first` it packed, a multiple of `NR`; the walk does the rest. `v` may be a
    /// master, rounded as in [`Kernel::pack_fast`].
    fn walk_fast<S: GemmElem>(
        self,
        _v: MatRef<S>,
        _first: usize,
        _count: usize,
        _whole: usize,
        _units: usize,
        _out: &mut [Self::Unit],
    ) -> usize {
        0
    }

    /// The unit of `KSTEP` consecutive values of the inner dimension that start with `first`
    /// and end with `last` (one and the same value when `KSTEP` is 1).
    fn unit<T: GemmElem>(first: T, last: T) -> Self::Unit;

    /// `tile (MR x NR) = a-panel (units x MR)^T * b-panel (units x NR)` accumulated in f32,
    /// then the first `rows x cols` of it stored to `c` (row stride `ldc`), rounded to `O`,
    /// added to what is there when `accumulate`.
    ///
    /// # Safety
    /// `a` holds `units * MR` and `b` `units * NR` units; `c` addresses `rows` rows of `cols`
    /// writable elements at stride `ldc` (initialised when `accumulate`); the call is made
    /// inside [`Kernel::with_state`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<O: Real>(
        self,
        units: usize,
        a: *const Self::Unit,
        b: *const Self::Unit,
        c: *mut O,
        ldc: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    );
}
