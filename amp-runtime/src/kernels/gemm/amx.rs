//! The bf16 micro-kernel on AMX tiles (`tdpbf16ps`, Sapphire Rapids and later).
//!
//! A tile register holds 16 rows of 64 bytes. One `tdpbf16ps` multiplies a 16 x 32 bf16 tile
//! of A (16 rows, 16 pairs of consecutive `k` each) by a 16 x 16 tile of B whose rows are those
//! 16 pairs for 16 columns, and adds the products into a 16 x 16 f32 tile: 8192 multiply-adds in
//! one instruction, 16 times an AVX-512 FMA's. The kernel keeps a 32 x 32 tile of C in four
//! tile registers and, per block of 16 units (32 `k`), loads two tiles of A and two of B and
//! issues four products. A panels are packed in blocks of 16 units (`A_BLOCK`), so each A tile
//! is 1 KiB in one piece; B panels keep the `[unit][32 columns]` layout of the AVX-512 kernel,
//! and a B tile is read at a stride of 128 bytes.
//!
//! Linux hands out the tile state per process on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
//! [`amx_bf16_usable`] asks once, and a CPU or kernel that says no keeps the AVX-512 kernels.

use std::arch::asm;
use std::arch::x86_64::{__m512, _mm512_loadu_ps};
use std::mem::MaybeUninit;

use super::pack::Lanes;
use super::x86::{store, Avx512, Avx512Bf16};
use super::{GemmElem, Kernel, MatRef};
use crate::kernels::elem::Real;

/// Rows and columns of C per tile call: 2 x 2 tile registers of 16 x 16.
const MR: usize = 32;
const NR: usize = 32;
/// Units (pairs of `k`) per tile of A or B.
const BLOCK: usize = 16;

/// Proof that this CPU has AMX-BF16 tiles (with AVX-512F and AVX512-BF16) and that Linux let
/// this process use them: made only by [`AmxBf16::detect`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AmxBf16(Avx512Bf16);

impl AmxBf16 {
    /// The token, when the CPU has AMX-BF16 and the OS grants the tile state.
    pub(crate) fn detect(cpu: Avx512Bf16) -> Option<Self> {
        amx_bf16_usable().then_some(Self(cpu))
    }

    /// AVX-512F, which this implies.
    pub(crate) fn avx512(self) -> Avx512 {
        self.0.avx512()
    }

    /// AVX-512F with AVX512-BF16, which this implies.
    #[cfg(test)]
    pub(crate) fn avx512_bf16(self) -> Avx512Bf16 {
        self.0
    }
}

/// bf16 x bf16 -> f32 on AMX; a unit is a pair of consecutive `k`, as for `vdpbf16ps`.
#[derive(Clone, Copy, Debug)]
pub(super) struct AmxKernel(pub AmxBf16);

impl Kernel for AmxKernel {
    type Unit = u32;
    const MR: usize = MR;
    const NR: usize = NR;
    const KSTEP: usize = 2;
    const A_BLOCK: usize = BLOCK;

    #[inline]
    fn unit<T: GemmElem>(first: T, last: T) -> u32 {
        super::bf16_pair(first, last)
    }

    fn with_state<R>(self, f: impl FnOnce() -> R) -> R {
        // SAFETY: `self.0` proves AMX is usable; the configuration is a
        // static of the layout `ldtilecfg` reads. Nothing else in this thread uses the tiles
        // while `f` runs (a task's tile calls, no other GEMM inside).
        unsafe { asm!("ldtilecfg [{config}]", config = in(reg) &CONFIG, options(nostack)) };
        let result = f();
        // SAFETY: as above; the tile state is dropped once the task's calls are done.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
        result
    }

    fn pack_fast<T: GemmElem>(
        self,
        v: MatRef<T>,
        lanes: Lanes,
        whole: usize,
        out: &mut [u32],
    ) -> (usize, usize) {
        super::pack_bf16::pack_units(self.0.avx512(), v, lanes, whole, out)
    }

    fn walk_fast<T: GemmElem>(
        self,
        v: MatRef<T>,
        first: usize,
        count: usize,
        whole: usize,
        units: usize,
        out: &mut [u32],
    ) -> usize {
        super::pack_bf16::walk_units(self.0.avx512(), v, first, count, whole, units, NR, out)
    }

    unsafe fn tile<O: Real>(
        self,
        units: usize,
        a: *const u32,
        b: *const u32,
        c: *mut O,
        ldc: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) {
        if O::DTYPE == candle_core::DType::F32 && !accumulate && rows == MR && cols == NR {
            // A whole f32 tile written over C: the tile registers are stored straight into C's
            // rows, with no trip through a buffer and the vector store.
            let stride = ldc * std::mem::size_of::<f32>();
            // SAFETY: as for the buffered path below (CPU, tile configuration, panels); C holds
            // MR rows of NR f32 at a stride of `ldc` elements (the caller's `c`, `rows`, `cols`).
            unsafe {
                let c = c.cast::<u8>();
                products(units / BLOCK, a, b, c, c.add(16 * stride), stride);
            }
            return;
        }
        let mut tile = MaybeUninit::<Tile>::uninit();
        // SAFETY: `self.0` proves AMX-BF16 usable (the permission granted) and avx512f; the caller is inside `with_state`, which configured the
        // tiles; the panels hold `units` units, a multiple of BLOCK; `products` writes the
        // whole tile.
        unsafe {
            let t = tile.as_mut_ptr().cast::<u8>();
            products(units / BLOCK, a, b, t, t.add(16 * 4 * NR), 4 * NR);
            store_tile(tile.assume_init_ref(), c, ldc, rows, cols, accumulate);
        }
    }
}

/// The tile configuration `ldtilecfg` reads: palette 1, tiles 0-7 all 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: Config = Config {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// A 32 x 32 f32 tile of C, row-major, as the tile registers are stored.
#[repr(C, align(64))]
struct Tile([[f32; NR]; MR]);

/// `C = A-panel * B-panel` over `blocks` blocks of 16 units, f32: C rows 0-15 and 16-31 in tile
/// registers 0/1 and 2/3 (columns 0-15 and 16-31), A in 4 and 5, B in 6 and 7, stored at the end
/// to rows 0-15 at `c_lo` and 16-31 at `c_hi`, `stride` bytes apart.
///
/// # Safety
/// AMX-BF16 is usable by this process and the tiles are configured ([`CONFIG`]); `a` holds
/// `blocks` blocks of 32 x 16 units, `[block][row][unit]`, and `b` `blocks * 16` rows of 32
/// units; 16 rows of 32 f32 at `stride` bytes from each of `c_lo` and `c_hi` are writable.
unsafe fn products(
    blocks: usize,
    a: *const u32,
    b: *const u32,
    c_lo: *mut u8,
    c_hi: *mut u8,
    stride: usize,
) {
    // SAFETY: the caller's panels and C rows (see above).
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "test {blocks}, {blocks}",
            "jz 3f",
            "2:",
            // A rows 0-15 (tmm4) and 16-31 (tmm5) of the block, 64 bytes per row; B columns
            // 0-15 (tmm6) and 16-31 (tmm7) of 16 unit rows of 128 bytes. Tile registers are
            // not renamed: each load is placed just before the first product that needs it,
            // so that products start while the other tiles are still loading.
            "tileloadd tmm4, [{a} + {a_stride}*1]",
            "tileloadd tmm6, [{b} + {b_stride}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm7, [{b} + {b_stride}*1 + 64]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tileloadd tmm5, [{a} + {a_stride}*1 + 1024]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            // The next block of A into L1 while these products run: a panel (32 rows x all
            // of k) is larger than L1, and the tile loads would otherwise wait on L2 (the
            // gain is in docs/performance-log.md). B's lines need no prefetch. The last
            // block's prefetches point past the panel, which is harmless: prefetches never fault.
            "prefetcht0 [{a} + 2048]\nprefetcht0 [{a} + 2112]\nprefetcht0 [{a} + 2176]\nprefetcht0 [{a} + 2240]",
            "prefetcht0 [{a} + 2304]\nprefetcht0 [{a} + 2368]\nprefetcht0 [{a} + 2432]\nprefetcht0 [{a} + 2496]",
            "prefetcht0 [{a} + 2560]\nprefetcht0 [{a} + 2624]\nprefetcht0 [{a} + 2688]\nprefetcht0 [{a} + 2752]",
            "prefetcht0 [{a} + 2816]\nprefetcht0 [{a} + 2880]\nprefetcht0 [{a} + 2944]\nprefetcht0 [{a} + 3008]",
            "prefetcht0 [{a} + 3072]\nprefetcht0 [{a} + 3136]\nprefetcht0 [{a} + 3200]\nprefetcht0 [{a} + 3264]",
            "prefetcht0 [{a} + 3328]\nprefetcht0 [{a} + 3392]\nprefetcht0 [{a} + 3456]\nprefetcht0 [{a} + 3520]",
            "prefetcht0 [{a} + 3584]\nprefetcht0 [{a} + 3648]\nprefetcht0 [{a} + 3712]\nprefetcht0 [{a} + 3776]",
            "prefetcht0 [{a} + 3840]\nprefetcht0 [{a} + 3904]\nprefetcht0 [{a} + 3968]\nprefetcht0 [{a} + 4032]",
            "add {a}, 2048",
            "add {b}, 2048",
            "dec {blocks}",
            "jnz 2b",
            "3:",
            "tilestored [{c_lo} + {c_stride}*1], tmm0",
            "tilestored [{c_lo} + {c_stride}*1 + 64], tmm1",
            "tilestored [{c_hi} + {c_stride}*1], tmm2",
            "tilestored [{c_hi} + {c_stride}*1 + 64], tmm3",
            blocks = inout(reg) blocks => _,
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            c_lo = in(reg) c_lo,
            c_hi = in(reg) c_hi,
            a_stride = in(reg) 64usize,
            b_stride = in(reg) 4 * NR,
            c_stride = in(reg) stride,
            options(nostack),
        );
    }
}

/// Stores the first `rows x cols` of the tile into C through the AVX-512 kernels' store.
///
/// # Safety
/// As [`Kernel::tile`]'s `c`; avx512f exists.
#[target_feature(enable = "avx512f")]
unsafe fn store_tile<O: Real>(
    tile: &Tile,
    c: *mut O,
    ldc: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    let acc: [[__m512; 2]; MR] = std::array::from_fn(|i| {
        let row = tile.0[i].as_ptr();
        // SAFETY: a row holds 32 floats.
        unsafe { [_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16))] }
    });
    // SAFETY: forwarded from the caller.
    unsafe { store(&acc, c, ldc, rows, cols, accumulate) };
}

/// Whether this CPU has AMX-BF16 tiles and the OS lets this process use them (asked once,
/// for the whole process, as Linux requires before the first tile instruction).
fn amx_bf16_usable() -> bool {
    // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    if leaf7.edx & (1 << 22) == 0 || leaf7.edx & (1 << 24) == 0 {
        return false;
    }
    request_tile_state()
}

#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes which XSAVE features the process
    // may use; it reads and writes no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}
