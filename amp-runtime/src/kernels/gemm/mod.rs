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

use std::cell::RefCell;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::{Mutex, OnceLock};

use super::{parallel, Real};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

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

/// The micro-kernels this CPU can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX512-BF16 with AMX-BF16 tiles (Sapphire Rapids and later), the OS granting them:
    /// `tdpbf16ps` for bf16, FMA for the rest.
    Amx,
    /// AVX-512F with AVX512-BF16: `vdpbf16ps` for bf16, FMA for the rest.
    Avx512Bf16,
    /// AVX-512F: FMA for every type (bf16 converted to f32 while packing).
    Avx512,
    /// Plain Rust.
    Portable,
}

/// The kernels chosen for this process (detected once).
pub(crate) fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(detect)
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::env::var_os("CANDLE_AMP_PORTABLE_GEMM").is_some() {
            return Isa::Portable;
        }
        let avx512 = is_x86_feature_detected!("avx512f");
        if avx512 && is_x86_feature_detected!("avx512bf16") {
            if std::env::var_os("CANDLE_AMP_NO_AMX").is_none() && amx::amx_bf16_usable() {
                return Isa::Amx;
            }
            return Isa::Avx512Bf16;
        }
        if avx512 {
            return Isa::Avx512;
        }
    }
    Isa::Portable
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
        Isa::Amx if T::IS_BF16 => blocked::<T, B, amx::AmxKernel, O>(&p, c),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16 if T::IS_BF16 => blocked::<T, B, x86::Bf16Kernel, O>(&p, c),
        #[cfg(target_arch = "x86_64")]
        Isa::Amx | Isa::Avx512Bf16 | Isa::Avx512 => blocked::<T, B, x86::F32Kernel, O>(&p, c),
        _ => blocked::<T, B, portable::F32Kernel, O>(&p, c),
    }
}

/// `a * b` in `T`, `b` stored as `B` (see [`gemm`]).
#[derive(Clone, Copy)]
struct Problem<'a, T, B> {
    m: usize,
    n: usize,
    k: usize,
    a: MatRef<'a, T>,
    b: MatRef<'a, B>,
    accumulate: bool,
    parallel: bool,
}

impl<T: Copy, B: Copy> Problem<'_, T, B> {
    /// The same product over the inner range `k0..k0 + kc` only.
    fn inner_slice(&self, k0: usize, kc: usize) -> Self {
        let mut p = *self;
        p.a.offset += k0 * p.a.cs;
        p.b.offset += k0 * p.b.rs;
        p.k = kc;
        p
    }
}

/// A register-blocked micro-kernel and the packed layout it reads.
trait Kernel {
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
    fn with_state<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    /// Packs what the kernel has a vector path for, a rectangle of lanes and units from the
    /// first of each, and returns its size; [`pack`] does the rest. `v` may be of another type
    /// than the product's (a master): kernels with a fast path have one unit type, so its
    /// values are rounded to that type (bf16) whatever the product's type.
    fn pack_fast<S: GemmElem>(
        _v: MatRef<S>,
        _lanes: Lanes,
        _whole: usize,
        _out: &mut [Self::Unit],
    ) -> (usize, usize) {
        (0, 0)
    }

    /// [`pack_panels`]' walk along the rows of a B whose lanes are contiguous at each `k`,
    /// where the kernel has a vector path: lanes `first..first + count` of `v` for every unit
    /// below `whole`, into consecutive `NR`-lane panels of `units` units. Returns how many
    /// lanes from `first` it packed, a multiple of `NR`; the walk does the rest. `v` may be a
    /// master, rounded as in [`Kernel::pack_fast`].
    fn walk_fast<S: GemmElem>(
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
    /// writable elements at stride `ldc`; the CPU has the kernel's features; the call is made
    /// inside [`Kernel::with_state`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<O: Real>(
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

/// The most units of the inner dimension packed per pass: a B micro-panel of 2048 x 32 units
/// (256 KiB) stays in L2. Longer products (weight gradients, whose `k` is batch x pixels)
/// run in passes accumulated in f32.
const MAX_UNITS: usize = 2048;
/// Bytes of packed A per task, to stay within L2 next to the B micro-panel.
const A_BLOCK_BYTES: usize = 512 << 10;
/// Bytes of packed B per column slice.
const B_SLICE_BYTES: usize = 4 << 20;

/// A raw pointer to C shared by tasks that write disjoint tiles.
#[derive(Clone, Copy)]
struct SharedOut<O>(*mut O);
// SAFETY: tasks write disjoint tiles through it (see `one_pass`).
unsafe impl<O> Send for SharedOut<O> {}
unsafe impl<O> Sync for SharedOut<O> {}

impl<O> SharedOut<O> {
    /// The element `offset` of C.
    ///
    /// # Safety
    /// `offset` is inside C.
    unsafe fn at(&self, offset: usize) -> *mut O {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.add(offset) }
    }
}

/// Splits `k` into passes of at most `MAX_UNITS` units; with several passes into a half `O`,
/// the passes accumulate in an f32 buffer that is rounded once at the end.
fn blocked<T: GemmElem, B: GemmElem, K: Kernel, O: Real + Send + Sync>(
    p: &Problem<T, B>,
    c: &mut [MaybeUninit<O>],
) {
    let kc_max = MAX_UNITS * K::KSTEP;
    if p.k <= kc_max {
        return one_pass::<T, B, K, O>(p, c);
    }
    let mut sums = vec![MaybeUninit::new(0f32); p.m * p.n];
    for (pass, k0) in (0..p.k).step_by(kc_max).enumerate() {
        let mut slice = p.inner_slice(k0, kc_max.min(p.k - k0));
        slice.accumulate = pass > 0;
        one_pass::<T, B, K, f32>(&slice, &mut sums);
    }
    for (o, s) in c.iter_mut().zip(&sums) {
        // SAFETY: every sum was written; C is initialised when accumulating (see `run`).
        let (s, before) = unsafe { (s.assume_init(), p.accumulate.then(|| o.assume_init_read())) };
        o.write(O::put(before.map_or(s, |b| b.get() + s)));
    }
}

/// One pass over the whole inner dimension: B packed per column slice, A per block of rows,
/// each tile accumulated in registers over all of `k` and stored once. With rows enough for a
/// block per thread, the threads first pack the slice of B together and then take blocks of
/// rows ([`Slice::by_rows`]); with fewer, each thread takes a group of B's columns instead
/// ([`Slice::by_columns`]).
fn one_pass<T: GemmElem, B: GemmElem, K: Kernel, O: Real + Send + Sync>(
    p: &Problem<T, B>,
    c: &mut [MaybeUninit<O>],
) {
    let (m, n, k) = (p.m, p.n, p.k);
    let units = k.div_ceil(K::KSTEP).next_multiple_of(K::A_BLOCK);
    let unit_bytes = std::mem::size_of::<K::Unit>();
    let threads = if p.parallel { parallel::threads() } else { 1 };
    let nc_max = (B_SLICE_BYTES / (units * unit_bytes))
        .max(K::NR)
        .next_multiple_of(K::NR);
    let mc_max = (A_BLOCK_BYTES / (units * unit_bytes)).clamp(K::MR, 8 * K::MR) / K::MR * K::MR;
    let panel_len = units * K::NR;
    let slice_panels = nc_max.min(n).div_ceil(K::NR);
    let by_columns = threads > 1 && m.div_ceil(mc_max) < threads && slice_panels > 1;
    let (mc, b_len) = if by_columns {
        let group = slice_panels.div_ceil(threads);
        (mc_max, threads * COLUMN_PANELS.min(group) * panel_len)
    } else {
        let mc = mc_max.min(m.div_ceil(threads).next_multiple_of(K::MR));
        (mc, slice_panels * panel_len)
    };
    K::Unit::with_b(b_len, |b_buffer| {
        for j0 in (0..n).step_by(nc_max) {
            let slice = Slice::<T, B, K, O> {
                p,
                out: SharedOut(c.as_mut_ptr().cast::<O>()),
                units,
                j0,
                nc: nc_max.min(n - j0),
                mc,
                threads,
                kernel: PhantomData,
            };
            if by_columns {
                slice.by_columns(b_buffer);
            } else {
                slice.by_rows(b_buffer);
            }
        }
    });
}

/// The columns `j0..j0 + nc` of a pass's product (see [`one_pass`]).
struct Slice<'a, T, B, K, O> {
    p: &'a Problem<'a, T, B>,
    out: SharedOut<O>,
    /// Packed units along `k`, padded to whole blocks.
    units: usize,
    j0: usize,
    nc: usize,
    /// Rows per block of A.
    mc: usize,
    threads: usize,
    kernel: PhantomData<fn() -> K>,
}

impl<T: GemmElem, B: GemmElem, K: Kernel, O: Real + Send + Sync> Slice<'_, T, B, K, O> {
    fn panel_len(&self) -> usize {
        self.units * K::NR
    }

    fn panels(&self) -> usize {
        self.nc.div_ceil(K::NR)
    }

    /// B's panels from `first_panel` of the slice, as many as `panels` holds, packed into it.
    fn pack_b(&self, first_panel: usize, panels: &mut [K::Unit]) {
        let first = first_panel * K::NR;
        let count = (panels.len() / self.units).min(self.nc - first);
        // B viewed as n lanes along k.
        let p = self.p;
        let lanes = MatRef {
            rs: p.b.cs,
            cs: p.b.rs,
            ..p.b
        };
        pack_panels::<B, T, K>(lanes, self.j0 + first, count, p.k, self.units, panels);
    }

    /// A's rows `i0..i0 + rows` packed into the thread's A buffer, then `f` run on them.
    fn with_rows(&self, i0: usize, rows: usize, f: impl FnOnce(&[K::Unit])) {
        K::Unit::with_a(rows.div_ceil(K::MR) * self.units * K::MR, |packed_a| {
            for (ip, panel) in packed_a.chunks_mut(self.units * K::MR).enumerate() {
                let rows_of_a = Lanes {
                    first: i0 + ip * K::MR,
                    count: K::MR.min(rows - ip * K::MR),
                    width: K::MR,
                    block: K::A_BLOCK,
                };
                pack::<T, T, K>(self.p.a, rows_of_a, self.p.k, self.units, panel);
            }
            f(packed_a);
        });
    }

    /// C's rows `i0..i0 + rows` (A's packed rows `a`) times the packed panels `b` from the
    /// slice's panel `first_panel`: every tile, computed and stored.
    fn tiles(&self, i0: usize, rows: usize, a: &[K::Unit], first_panel: usize, b: &[K::Unit]) {
        let (n, units) = (self.p.n, self.units);
        K::with_state(|| {
            for (jp, b_panel) in b.chunks(units * K::NR).enumerate() {
                let col = self.j0 + (first_panel + jp) * K::NR;
                let cols = K::NR.min(self.j0 + self.nc - col);
                for (ip, a_panel) in a.chunks(units * K::MR).enumerate() {
                    let row = i0 + ip * K::MR;
                    // SAFETY: the panels hold `units` units each (sized by their packers); the
                    // tile covers rows row..row + MR and columns col..col + cols of the m x n
                    // output (cut at the block's last row), which no other task writes; `isa()`
                    // chose K for this CPU, and the call is inside `K::with_state`.
                    unsafe {
                        K::tile(
                            units,
                            a_panel.as_ptr(),
                            b_panel.as_ptr(),
                            self.out.at(row * n + col),
                            n,
                            K::MR.min(i0 + rows - row),
                            cols,
                            self.p.accumulate,
                        );
                    }
                }
            }
        });
    }

    /// The slice's B packed by all threads together into `b_buffer`, then one task per block of
    /// rows, times groups of B's panels when the blocks alone are too few to balance the
    /// threads.
    fn by_rows(&self, b_buffer: &mut [K::Unit]) {
        let (panels_n, panel_len) = (self.panels(), self.panel_len());
        let packed_b = &mut b_buffer[..panels_n * panel_len];
        let chunk = PACK_TASK_PANELS * panel_len;
        if self.threads > 1 && panels_n > 1 {
            parallel::for_each_chunk_mut(packed_b, chunk, |t, panels| {
                self.pack_b(t * PACK_TASK_PANELS, panels);
            });
        } else {
            for (t, panels) in packed_b.chunks_mut(chunk).enumerate() {
                self.pack_b(t * PACK_TASK_PANELS, panels);
            }
        }
        let (m, mc) = (self.p.m, self.mc);
        let blocks_m = m.div_ceil(mc);
        let groups_n = (2 * self.threads).div_ceil(blocks_m).clamp(1, panels_n);
        let group = panels_n.div_ceil(groups_n);
        let packed_b = &*packed_b;
        let task = |t: usize| {
            let (i0, g) = (t / groups_n * mc, t % groups_n);
            let panels = g * group..((g + 1) * group).min(panels_n);
            let b = &packed_b[panels.start * panel_len..panels.end * panel_len];
            let rows = mc.min(m - i0);
            self.with_rows(i0, rows, |a| self.tiles(i0, rows, a, panels.start, b));
        };
        let tasks = blocks_m * groups_n;
        if self.threads > 1 && tasks > 1 {
            parallel::for_each_index(tasks, task);
        } else {
            (0..tasks).for_each(task);
        }
    }

    /// One task per group of the slice's B panels: it packs A's rows, then its panels
    /// `COLUMN_PANELS` at a time into its own place in `b_buffer`, and runs every row against
    /// them while they are in its core's cache: the packed panels never go back to memory, and
    /// no thread waits for another's packing.
    fn by_columns(&self, b_buffer: &mut [K::Unit]) {
        let (panels_n, panel_len) = (self.panels(), self.panel_len());
        let (m, mc) = (self.p.m, self.mc);
        let group = panels_n.div_ceil(self.threads);
        let step = COLUMN_PANELS.min(group);
        let places = &mut b_buffer[..panels_n.div_ceil(group) * step * panel_len];
        parallel::for_each_chunk_mut(places, step * panel_len, |g, place| {
            let mine = g * group..((g + 1) * group).min(panels_n);
            for i0 in (0..m).step_by(mc) {
                let rows = mc.min(m - i0);
                self.with_rows(i0, rows, |a| {
                    for jp in mine.clone().step_by(step) {
                        let b = &mut place[..step.min(mine.end - jp) * panel_len];
                        self.pack_b(jp, b);
                        self.tiles(i0, rows, a, jp, b);
                    }
                });
            }
        });
    }
}

/// B micro-panels a task packs at a time when the threads split B's columns (see
/// [`one_pass`]): 4 x 32 columns of bf16 pairs at k = 1024 is 256 KiB, which stays in L2 beside
/// A's block. Packing one panel at a time reads B in short strided runs (64 bytes of each row),
/// which measured slower; 8 no faster than 4.
const COLUMN_PANELS: usize = 4;

/// B micro-panels packed per task.
const PACK_TASK_PANELS: usize = 8;

/// A packed unit type, with buffers to pack into that are reused from call to call, never
/// zero-filled: packing rewrites every unit a tile reads (lanes past the last full panel's rows
/// or columns may keep stale values: they only reach accumulators that are never stored; the
/// padding units are written as zeros). A's buffer is the worker thread's own; B's is one
/// process-wide buffer, taken by a GEMM for its duration and given back, so what is kept does
/// not depend on which threads ran which GEMM (a peak-memory measurement after one warm-up step
/// stays stable).
trait Scratch: Copy + Default + Send + Sync + 'static {
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
/// long) and each 64-byte row of an AMX tile: a tile load whose rows straddle two lines measured
/// 5x slower, and the AMX kernel 2-3x slower, than on aligned panels. The allocator only
/// promises 16 bytes.
fn grown<U: Copy + Default>(buf: &mut Vec<U>, len: usize) -> &mut [U] {
    let slack = CACHE_LINE / std::mem::size_of::<U>();
    if buf.len() < len + slack {
        buf.resize(len + slack, U::default());
    }
    // At most `slack - 1` for a unit that divides the line (f32, u32); never past `slack`.
    let skip = buf.as_ptr().align_offset(CACHE_LINE).min(slack);
    &mut buf[skip..skip + len]
}

/// Bytes per cache line, the alignment of packed panels.
const CACHE_LINE: usize = 64;

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

/// Packs `count` lanes from `first` into consecutive `NR`-lane micro-panels of B, each of
/// `units` units, those past `kc` zero (`out` holds them all). When the lanes at each `k` are
/// contiguous (a row-major B, or the f32 master of one), every panel is filled in one walk
/// along B's rows, which reads memory in order: a panel at a time would stride across all `k`
/// rows for every 32 lanes, a page apart for a 1024-wide f32 weight. The kernel's vector path
/// ([`Kernel::walk_fast`]) walks the whole panels; a master operand without one goes a panel
/// at a time through [`pack`], whose vector path rounds 16 values at once: rounding them one
/// by one in the walk cost more than the walk saves.
fn pack_panels<S: GemmElem, T: GemmElem, K: Kernel>(
    v: MatRef<S>,
    first: usize,
    count: usize,
    kc: usize,
    units: usize,
    out: &mut [K::Unit],
) {
    let panel = units * K::NR;
    let whole = kc / K::KSTEP;
    let walk = v.rs == 1 && v.cs != 1 && kc.is_multiple_of(K::KSTEP);
    let done = if walk {
        K::walk_fast(v, first, count, whole, units, out)
    } else {
        0
    };
    if !walk || (done == 0 && !same_type::<S, T>()) {
        for (p, out) in out.chunks_mut(panel).enumerate() {
            let l0 = p * K::NR;
            let lanes = Lanes {
                first: first + l0,
                count: K::NR.min(count - l0),
                width: K::NR,
                block: 1,
            };
            pack::<S, T, K>(v, lanes, kc, units, out);
        }
        return;
    }
    debug_assert!(done.is_multiple_of(K::NR), "walk_fast: {done} lanes");
    let base = v.offset + first;
    let first_panel = done / K::NR;
    for u in 0..whole {
        let k0 = u * K::KSTEP;
        let lo = &v.data[base + k0 * v.cs..][done..count];
        let hi = &v.data[base + (k0 + K::KSTEP - 1) * v.cs..][done..count];
        for (p, (lo, hi)) in lo.chunks(K::NR).zip(hi.chunks(K::NR)).enumerate() {
            let dst = &mut out[(first_panel + p) * panel + u * K::NR..][..lo.len()];
            for ((unit, &x), &y) in dst.iter_mut().zip(lo).zip(hi) {
                *unit = K::unit::<T>(rounded(x), rounded(y));
            }
        }
    }
    for p in out.chunks_mut(panel) {
        p[whole * K::NR..].fill(K::Unit::default());
    }
}

/// Which lanes a micro-panel holds and how they are laid out (see [`Kernel::A_BLOCK`]).
#[derive(Clone, Copy)]
struct Lanes {
    /// The first lane (row of `v`).
    first: usize,
    /// Lanes present; those up to `width` are left as they are (see [`Scratch`]).
    count: usize,
    /// Lanes of the panel.
    width: usize,
    /// Units per block.
    block: usize,
}

impl Lanes {
    /// Where unit `u` of lane `l` goes.
    #[inline]
    fn at(&self, u: usize, l: usize) -> usize {
        (u / self.block) * self.width * self.block + l * self.block + u % self.block
    }
}

/// Packs the lanes `lanes` describes (rows of `v`, which is A or B transposed) over the inner
/// dimension `0..kc` into `out`, a panel of `units` units per lane, its values rounded from
/// `S` to the product's type `T`; the units past `kc` are zero.
fn pack<S: GemmElem, T: GemmElem, K: Kernel>(
    v: MatRef<S>,
    lanes: Lanes,
    kc: usize,
    units: usize,
    out: &mut [K::Unit],
) {
    let (count, width) = (lanes.count, lanes.width);
    let base = v.offset + lanes.first * v.rs;
    let whole = kc / K::KSTEP;
    // A unit's last value: past `kc` (an odd tail of bf16 pairs) it is zero.
    let zero = T::put(0.0);
    let value = |l: usize, kk: usize| -> T {
        if kk < kc {
            rounded(v.data[base + l * v.rs + kk * v.cs])
        } else {
            zero
        }
    };
    // The units `units` of the lanes `lanes_of` (of `count`), element by element.
    let scalar = |out: &mut [K::Unit], lanes_of: Range<usize>, units_of: Range<usize>| {
        if v.cs == 1 {
            // Each lane's run along k is contiguous.
            for l in lanes_of {
                let run = &v.data[base + l * v.rs..][..whole * K::KSTEP];
                let run = &run[units_of.start * K::KSTEP..units_of.end * K::KSTEP];
                for (u, values) in units_of.clone().zip(run.chunks_exact(K::KSTEP)) {
                    out[lanes.at(u, l)] =
                        K::unit::<T>(rounded(values[0]), rounded(values[K::KSTEP - 1]));
                }
            }
        } else if v.rs == 1 && lanes.block == 1 {
            // The lanes at each k are contiguous.
            for u in units_of {
                let k0 = u * K::KSTEP;
                let lo = &v.data[base + k0 * v.cs..][lanes_of.clone()];
                let hi = &v.data[base + (k0 + K::KSTEP - 1) * v.cs..][lanes_of.clone()];
                let dst = &mut out[u * width..][lanes_of.clone()];
                for ((unit, &x), &y) in dst.iter_mut().zip(lo).zip(hi) {
                    *unit = K::unit::<T>(rounded(x), rounded(y));
                }
            }
        } else {
            for l in lanes_of {
                for u in units_of.clone() {
                    let k0 = u * K::KSTEP;
                    out[lanes.at(u, l)] = K::unit(value(l, k0), value(l, k0 + K::KSTEP - 1));
                }
            }
        }
    };
    // The kernel's vector path packs a rectangle of whole groups; the rest is scalar.
    let (done_lanes, done_units) = K::pack_fast(v, lanes, whole, out);
    scalar(out, 0..count, done_units..whole);
    scalar(out, done_lanes..count, 0..done_units);
    let k0 = whole * K::KSTEP;
    for l in 0..count {
        if k0 < kc {
            out[lanes.at(whole, l)] = K::unit(value(l, k0), value(l, k0 + K::KSTEP - 1));
        }
        for u in kc.div_ceil(K::KSTEP)..units {
            out[lanes.at(u, l)] = K::Unit::default();
        }
    }
}

/// Stores the first `rows x cols` of a row-major tile of width `nr` into `c`, rounded to `O`.
///
/// # Safety
/// As [`Kernel::tile`]'s `c`.
#[inline]
unsafe fn store_tile<O: Real>(
    tile: &[f32],
    nr: usize,
    c: *mut O,
    ldc: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    for i in 0..rows {
        for j in 0..cols {
            let v = tile[i * nr + j];
            // SAFETY: (i, j) is inside the caller's rows x cols window, initialised when
            // accumulating.
            unsafe {
                let dst = c.add(i * ldc + j);
                dst.write(O::put(if accumulate { dst.read().get() + v } else { v }));
            }
        }
    }
}

mod portable {
    use super::{store_tile, GemmElem, Kernel, Real};

    /// Plain-Rust f32 kernel (4 x 16): whatever the compiler vectorises for the target.
    pub(super) struct F32Kernel;

    const MR: usize = 4;
    const NR: usize = 16;

    impl Kernel for F32Kernel {
        type Unit = f32;
        const MR: usize = MR;
        const NR: usize = NR;
        const KSTEP: usize = 1;

        #[inline]
        fn unit<T: GemmElem>(first: T, _last: T) -> f32 {
            first.get()
        }

        unsafe fn tile<O: Real>(
            units: usize,
            a: *const f32,
            b: *const f32,
            c: *mut O,
            ldc: usize,
            rows: usize,
            cols: usize,
            accumulate: bool,
        ) {
            // SAFETY: the caller passes panels of `units` units.
            let (a, b) = unsafe {
                (
                    std::slice::from_raw_parts(a, units * MR),
                    std::slice::from_raw_parts(b, units * NR),
                )
            };
            let mut acc = [0f32; MR * NR];
            for (ar, br) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
                for i in 0..MR {
                    for j in 0..NR {
                        acc[i * NR + j] += ar[i] * br[j];
                    }
                }
            }
            // SAFETY: forwarded from the caller.
            unsafe { store_tile(&acc, NR, c, ldc, rows, cols, accumulate) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod pack_bf16;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m512, __m512bh, __m512i, _mm512_add_ps, _mm512_dpbf16_ps, _mm512_fmadd_ps,
        _mm512_loadu_ps, _mm512_loadu_si512, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps,
        _mm512_storeu_ps,
    };

    use candle_core::DType;

    use super::{store_tile, GemmElem, Kernel, Lanes, MatRef, Real};

    /// Rows and columns of a tile: 12 x 32 = 24 zmm accumulators, two B vectors and one A
    /// broadcast in flight, within the 32 registers of AVX-512.
    const MR: usize = 12;
    const NR: usize = 32;

    /// bf16 x bf16 -> f32 with `vdpbf16ps`; a unit is a pair of consecutive `k`.
    pub(super) struct Bf16Kernel;

    /// f32 FMA; a unit is one `k`.
    pub(super) struct F32Kernel;

    impl Kernel for Bf16Kernel {
        type Unit = u32;
        const MR: usize = MR;
        const NR: usize = NR;
        const KSTEP: usize = 2;

        #[inline]
        fn unit<T: GemmElem>(first: T, last: T) -> u32 {
            super::bf16_pair(first, last)
        }

        fn pack_fast<T: GemmElem>(
            v: MatRef<T>,
            lanes: Lanes,
            whole: usize,
            out: &mut [u32],
        ) -> (usize, usize) {
            super::pack_bf16::pack_units(v, lanes, whole, out)
        }

        fn walk_fast<T: GemmElem>(
            v: MatRef<T>,
            first: usize,
            count: usize,
            whole: usize,
            units: usize,
            out: &mut [u32],
        ) -> usize {
            super::pack_bf16::walk_units(v, first, count, whole, units, NR, out)
        }

        unsafe fn tile<O: Real>(
            units: usize,
            a: *const u32,
            b: *const u32,
            c: *mut O,
            ldc: usize,
            rows: usize,
            cols: usize,
            accumulate: bool,
        ) {
            // SAFETY: `isa()` selects this kernel only where avx512f and avx512bf16 exist.
            unsafe { bf16_tile(units, a, b, c, ldc, rows, cols, accumulate) }
        }
    }

    impl Kernel for F32Kernel {
        type Unit = f32;
        const MR: usize = MR;
        const NR: usize = NR;
        const KSTEP: usize = 1;

        #[inline]
        fn unit<T: GemmElem>(first: T, _last: T) -> f32 {
            first.get()
        }

        unsafe fn tile<O: Real>(
            units: usize,
            a: *const f32,
            b: *const f32,
            c: *mut O,
            ldc: usize,
            rows: usize,
            cols: usize,
            accumulate: bool,
        ) {
            // SAFETY: `isa()` selects this kernel only where avx512f exists.
            unsafe { f32_tile(units, a, b, c, ldc, rows, cols, accumulate) }
        }
    }

    /// Stores the accumulators: straight into C for a full tile, through a buffer otherwise.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn store<O: Real, const R: usize>(
        acc: &[[__m512; 2]; R],
        c: *mut O,
        ldc: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) {
        let full = rows == R && cols == NR;
        if full && O::DTYPE == DType::F32 {
            let c = c.cast::<f32>();
            for (i, row) in acc.iter().enumerate() {
                for (h, v) in row.iter().enumerate() {
                    // SAFETY: a full tile: rows R and columns NR are all inside C.
                    unsafe {
                        let dst = c.add(i * ldc + h * 16);
                        let v = if accumulate {
                            _mm512_add_ps(*v, _mm512_loadu_ps(dst))
                        } else {
                            *v
                        };
                        _mm512_storeu_ps(dst, v);
                    }
                }
            }
        } else if full && matches!(O::DTYPE, DType::BF16 | DType::F16) {
            // 16-bit elements: widen what is there when accumulating, round once, store.
            let c = c.cast::<u16>();
            let bf16 = O::DTYPE == DType::BF16;
            for (i, row) in acc.iter().enumerate() {
                for (h, v) in row.iter().enumerate() {
                    // SAFETY: a full tile: rows R and columns NR are all inside C.
                    unsafe {
                        let dst = c.add(i * ldc + h * 16);
                        let v = if accumulate {
                            _mm512_add_ps(*v, crate::kernels::simd::load16(dst, bf16))
                        } else {
                            *v
                        };
                        crate::kernels::simd::store16(dst, v, bf16);
                    }
                }
            }
        } else {
            let mut tile = [[0f32; NR]; R];
            for (row, acc) in tile.iter_mut().zip(acc) {
                for (h, v) in acc.iter().enumerate() {
                    // SAFETY: the row holds NR floats.
                    unsafe { _mm512_storeu_ps(row.as_mut_ptr().add(h * 16), *v) };
                }
            }
            // SAFETY: forwarded from the caller.
            unsafe { store_tile(tile.as_flattened(), NR, c, ldc, rows, cols, accumulate) };
        }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn bf16_tile<O: Real>(
        units: usize,
        a: *const u32,
        b: *const u32,
        c: *mut O,
        ldc: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for u in 0..units {
            // SAFETY: the panels hold `units` units of NR (B) and MR (A) lanes.
            unsafe {
                let b0: __m512bh = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    b.add(u * NR).cast(),
                ));
                let b1: __m512bh = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    b.add(u * NR + 16).cast(),
                ));
                let ar = a.add(u * MR);
                for (i, row) in acc.iter_mut().enumerate() {
                    let av: __m512bh = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                        *ar.add(i) as i32,
                    ));
                    row[0] = _mm512_dpbf16_ps(row[0], av, b0);
                    row[1] = _mm512_dpbf16_ps(row[1], av, b1);
                }
            }
        }
        // SAFETY: forwarded from the caller.
        unsafe { store(&acc, c, ldc, rows, cols, accumulate) };
    }

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn f32_tile<O: Real>(
        units: usize,
        a: *const f32,
        b: *const f32,
        c: *mut O,
        ldc: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for u in 0..units {
            // SAFETY: the panels hold `units` units of NR (B) and MR (A) floats.
            unsafe {
                let b0 = _mm512_loadu_ps(b.add(u * NR));
                let b1 = _mm512_loadu_ps(b.add(u * NR + 16));
                let ar = a.add(u * MR);
                for (i, row) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*ar.add(i));
                    row[0] = _mm512_fmadd_ps(av, b0, row[0]);
                    row[1] = _mm512_fmadd_ps(av, b1, row[1]);
                }
            }
        }
        // SAFETY: forwarded from the caller.
        unsafe { store(&acc, c, ldc, rows, cols, accumulate) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f64 reference of `a * b` on the same (already rounded) values.
    fn reference<T: GemmElem>(
        m: usize,
        n: usize,
        k: usize,
        a: MatRef<T>,
        b: MatRef<T>,
    ) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|l| f64::from(a.at(i, l).get()) * f64::from(b.at(l, j).get()))
                    .sum();
            }
        }
        c
    }

    fn values<T: GemmElem>(len: usize, seed: u32) -> Vec<T> {
        (0..len)
            .map(|i| T::put(((i as f32) * 0.618 + seed as f32).sin()))
            .collect()
    }

    type Driver<T, B> = fn(&Problem<T, B>, &mut [MaybeUninit<f32>]);

    /// The drivers this CPU can run for products in `T` with B stored as `B`, f32 output.
    fn drivers<T: GemmElem, B: GemmElem>() -> Vec<Driver<T, B>> {
        let mut all: Vec<Driver<T, B>> = vec![blocked::<T, B, portable::F32Kernel, f32>];
        #[cfg(target_arch = "x86_64")]
        {
            if isa() != Isa::Portable {
                all.push(blocked::<T, B, x86::F32Kernel, f32>);
            }
            if matches!(isa(), Isa::Amx | Isa::Avx512Bf16) && T::IS_BF16 {
                all.push(blocked::<T, B, x86::Bf16Kernel, f32>);
            }
            if isa() == Isa::Amx && T::IS_BF16 {
                all.push(blocked::<T, B, amx::AmxKernel, f32>);
            }
        }
        all
    }

    /// Every kernel against f64 on the same values, for edge sizes (one pass and several),
    /// strided and transposed operands, accumulation, serial and parallel; f32 accumulation of
    /// k products of magnitude <= 1 is good to ~k * 2^-24. Then the public entry point into
    /// `T` itself, which rounds once.
    fn check<T: GemmElem>() {
        let shapes = [
            (1, 1, 1),
            (7, 17, 3),
            (13, 33, 513),
            (25, 70, 1030),
            (5, 9, 4500),
            // Few rows, many columns: on several threads, each takes a group of B's panels
            // and packs it a few panels at a time (a tail of fewer).
            (40, 600, 96),
            // Several blocks of rows, one per task.
            (300, 100, 40),
        ];
        for &(m, n, k) in &shapes {
            for transposed in [false, true] {
                let a_data = values::<T>(m * k + 3, 1);
                let b_data = values::<T>(k * n + 5, 2);
                let (a, b) = if transposed {
                    (
                        MatRef {
                            data: &a_data,
                            offset: 3,
                            rs: 1,
                            cs: m,
                        },
                        MatRef {
                            data: &b_data,
                            offset: 5,
                            rs: 1,
                            cs: k,
                        },
                    )
                } else {
                    (
                        MatRef {
                            data: &a_data,
                            offset: 3,
                            rs: k,
                            cs: 1,
                        },
                        MatRef {
                            data: &b_data,
                            offset: 5,
                            rs: n,
                            cs: 1,
                        },
                    )
                };
                let want = reference(m, n, k, a, b);
                let tol = 1e-5 * (k as f64 + 1.0);
                let name = std::any::type_name::<T>();
                for driver in drivers::<T, T>() {
                    // Added to ones, or written over NaNs (every element must be written).
                    for (parallel, accumulate) in [(false, true), (true, true), (true, false)] {
                        let before = if accumulate { 1f32 } else { f32::NAN };
                        let mut c = vec![MaybeUninit::new(before); m * n];
                        let p = Problem {
                            m,
                            n,
                            k,
                            a,
                            b,
                            accumulate,
                            parallel,
                        };
                        driver(&p, &mut c);
                        for (got, want) in c.iter().zip(&want) {
                            // SAFETY: initialised above, and the driver writes values.
                            let got = f64::from(unsafe { got.assume_init() });
                            let got = if accumulate { got - 1.0 } else { got };
                            assert!(
                                (got - want).abs() <= tol,
                                "{name} {m}x{n}x{k} t={transposed} acc={accumulate}: {got} vs \
                                 {want}"
                            );
                        }
                    }
                }
                check_rounded((m, n, k), a, b, &want);
            }
        }
        let mut empty: Vec<T> = vec![T::put(3.0); 6];
        let none = MatRef {
            data: &[] as &[T],
            offset: 0,
            rs: 0,
            cs: 1,
        };
        gemm(2, 3, 0, none, none, &mut empty, false, false);
        assert!(empty.iter().all(|x| x.get() == 0.0), "k = 0 gives zeros");
    }

    fn product<'a, T, B>(
        (m, n, k): (usize, usize, usize),
        a: MatRef<'a, T>,
        b: MatRef<'a, B>,
    ) -> Problem<'a, T, B> {
        Problem {
            m,
            n,
            k,
            a,
            b,
            accumulate: false,
            parallel: true,
        }
    }

    /// An f32 B (a master weight) in a product of `T`: every kernel gives, to the bit, what it
    /// gives on B rounded to `T` first, for B's rows or columns contiguous (both packing paths,
    /// whole groups of 16 and tails), values that round to even, overflow f16, or are subnormal.
    fn check_master<T: GemmElem>() {
        let name = std::any::type_name::<T>();
        for &(m, n, k) in &[
            (3, 5, 7),
            (33, 48, 64),
            (20, 70, 130),
            (18, 48, 129),
            (5, 9, 4500),
        ] {
            let a_data = values::<T>(m * k, 1);
            let mut master = values::<f32>(k * n, 2);
            for (i, v) in master.iter_mut().enumerate() {
                *v *= [1.0, 1.0 + f32::EPSILON, 3.0e4, 1e-39][i % 4];
            }
            master[1] = 1.0 + 2f32.powi(-8); // a bf16 tie: rounds to even (1.0)
            master[2] = 70_000.0; // past f16's range: inf in f16
            let rounded: Vec<T> = master.iter().map(|&v| T::put(v)).collect();
            let a = MatRef::row_major(&a_data, 0, k);
            for b_transposed in [false, true] {
                let (rs, cs) = if b_transposed { (1, k) } else { (n, 1) };
                let view = MatRef {
                    data: &master[..],
                    offset: 0,
                    rs,
                    cs,
                };
                let same = view.with_data(&rounded[..]);
                for (mixed, plain) in drivers::<T, f32>().into_iter().zip(drivers::<T, T>()) {
                    let mut got = vec![MaybeUninit::new(0f32); m * n];
                    let mut want = vec![MaybeUninit::new(0f32); m * n];
                    mixed(&product((m, n, k), a, view), &mut got);
                    plain(&product((m, n, k), a, same), &mut want);
                    // SAFETY: both drivers wrote every element.
                    let bits = |c: &[MaybeUninit<f32>]| -> Vec<u32> {
                        c.iter()
                            .map(|x| unsafe { x.assume_init() }.to_bits())
                            .collect()
                    };
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{name} {m}x{n}x{k} t={b_transposed}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_master_operand_is_rounded_as_it_is_packed() {
        check_master::<half::bf16>();
        check_master::<half::f16>();
        check_master::<f32>();
    }

    /// The public entry point into `T` itself, which rounds once: within half an ulp of `T`
    /// plus the f32 accumulation error.
    fn check_rounded<T: GemmElem>(
        (m, n, k): (usize, usize, usize),
        a: MatRef<T>,
        b: MatRef<T>,
        want: &[f64],
    ) {
        let name = std::any::type_name::<T>();
        let tol = 1e-5 * (k as f64 + 1.0);
        let mut c = vec![T::put(0.0); m * n];
        gemm(m, n, k, a, b, &mut c, false, true);
        // Into a fresh buffer, never initialised: every element written, to the same bits.
        let mut fresh: Vec<T> = Vec::with_capacity(m * n);
        gemm_uninit(
            (m, n, k),
            a,
            b,
            &mut fresh.spare_capacity_mut()[..m * n],
            true,
        );
        // SAFETY: `gemm_uninit` wrote all m * n elements.
        unsafe { fresh.set_len(m * n) };
        let bits = |v: &[T]| v.iter().map(|x| x.get().to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&fresh),
            bits(&c),
            "{name} {m}x{n}x{k}: gemm_uninit differs"
        );
        for (got, want) in c.iter().zip(want) {
            let ulp = (T::put(want.abs() as f32 * 1.001).get() - T::put(want.abs() as f32).get())
                .abs()
                .max(f32::EPSILON);
            let bound = f64::from(ulp) + tol + want.abs() * 1e-2;
            assert!(
                (f64::from(got.get()) - want).abs() <= bound,
                "{name} {m}x{n}x{k} into {name}: {} vs {want}",
                got.get()
            );
        }
    }

    #[test]
    fn packing_buffers_start_on_a_cache_line() {
        let mut kept = Vec::<u32>::new();
        for len in [1, 15, 16, 1000, 40_000, 3] {
            let mut new = Vec::<f32>::new();
            let fresh = grown(&mut new, len);
            assert_eq!(
                (fresh.len(), fresh.as_ptr() as usize % CACHE_LINE),
                (len, 0)
            );
            // A kept buffer, regrown or reused shorter.
            let again = grown(&mut kept, len);
            assert_eq!(
                (again.len(), again.as_ptr() as usize % CACHE_LINE),
                (len, 0)
            );
        }
    }

    #[test]
    fn gemm_matches_f64_reference_in_every_type() {
        check::<f32>();
        check::<f16>();
        check::<bf16>();
    }
}
