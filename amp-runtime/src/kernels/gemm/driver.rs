//! The GEMM's driver: passes over the inner dimension, column slices of B, blocks of rows of
//! A, and how the tasks of a pass share the kernels' pool. Each task writes its own tiles of C.

use std::mem::MaybeUninit;

use super::pack::{pack, pack_panels, Lanes};
use super::params::{A_BLOCK_BYTES, B_SLICE_BYTES, COLUMN_PANELS, MAX_UNITS, PACK_TASK_PANELS};
use super::scratch::Scratch;
use super::{GemmElem, Kernel, MatRef};
use crate::kernels::elem::Real;
use crate::kernels::parallel::{self, Disjoint};

/// `a * b` in `T`, `b` stored as `B` (see [`gemm`]).
#[derive(Clone, Copy)]
pub(super) struct Problem<'a, T, B> {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: MatRef<'a, T>,
    pub b: MatRef<'a, B>,
    pub accumulate: bool,
    pub parallel: bool,
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

/// Splits `k` into passes of at most `MAX_UNITS` units; with several passes into a half `O`,
/// the passes accumulate in an f32 buffer that is rounded once at the end.
pub(super) fn blocked<T: GemmElem, B: GemmElem, K: Kernel, O: Real + Send + Sync>(
    p: &Problem<T, B>,
    c: &mut [MaybeUninit<O>],
    kernel: K,
) {
    let kc_max = MAX_UNITS * K::KSTEP;
    if p.k <= kc_max {
        return one_pass(p, c, kernel);
    }
    let mut sums = vec![MaybeUninit::new(0f32); p.m * p.n];
    for (pass, k0) in (0..p.k).step_by(kc_max).enumerate() {
        let mut slice = p.inner_slice(k0, kc_max.min(p.k - k0));
        slice.accumulate = pass > 0;
        one_pass(&slice, &mut sums, kernel);
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
    kernel: K,
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
    let out = Disjoint::new(c);
    K::Unit::with_b(b_len, |b_buffer| {
        for j0 in (0..n).step_by(nc_max) {
            let slice = Slice::<T, B, K, O> {
                p,
                out,
                units,
                j0,
                nc: nc_max.min(n - j0),
                mc,
                threads,
                kernel,
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
    out: Disjoint<'a, MaybeUninit<O>>,
    /// Packed units along `k`, padded to whole blocks.
    units: usize,
    j0: usize,
    nc: usize,
    /// Rows per block of A.
    mc: usize,
    threads: usize,
    kernel: K,
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
        pack_panels::<B, T, K>(
            self.kernel,
            lanes,
            self.j0 + first,
            count,
            p.k,
            self.units,
            panels,
        );
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
                pack::<T, T, K>(
                    self.kernel,
                    self.p.a,
                    rows_of_a,
                    self.p.k,
                    self.units,
                    panel,
                );
            }
            f(packed_a);
        });
    }

    /// C's rows `i0..i0 + rows` (A's packed rows `a`) times the packed panels `b` from the
    /// slice's panel `first_panel`: every tile, computed and stored.
    fn tiles(&self, i0: usize, rows: usize, a: &[K::Unit], first_panel: usize, b: &[K::Unit]) {
        let (n, units) = (self.p.n, self.units);
        self.kernel.with_state(|| {
            for (jp, b_panel) in b.chunks(units * K::NR).enumerate() {
                let col = self.j0 + (first_panel + jp) * K::NR;
                let cols = K::NR.min(self.j0 + self.nc - col);
                for (ip, a_panel) in a.chunks(units * K::MR).enumerate() {
                    let row = i0 + ip * K::MR;
                    let tile_rows = K::MR.min(i0 + rows - row);
                    assert!(
                        a_panel.len() == units * K::MR && b_panel.len() == units * K::NR,
                        "gemm: short packed panel"
                    );
                    // Checked to lie inside C (`Disjoint::at`).
                    let c = self.out.at(row * n + col, (tile_rows - 1) * n + cols);
                    // SAFETY: the panels hold `units` units each (asserted); the tile's
                    // `tile_rows x cols` window at stride n lies in C (checked by `at`), and no
                    // other task writes it (tasks own disjoint rows or column groups); C is
                    // initialised when accumulating (`run`); the call is inside `with_state`.
                    unsafe {
                        self.kernel.tile(
                            units,
                            a_panel.as_ptr(),
                            b_panel.as_ptr(),
                            c.cast::<O>(),
                            n,
                            tile_rows,
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
        let m = self.p.m;
        // Blocks of A's rows of at most `mc`, as many as a multiple of the threads where there
        // are several, their sizes differing by at most one `MR` panel: with 11 blocks of 96
        // rows (1024 rows) on 2 threads, one thread idled for a block at the end of every pass.
        let panels_m = m.div_ceil(K::MR);
        let mut blocks_m = panels_m.div_ceil(self.mc / K::MR);
        if self.threads > 1 && blocks_m > 1 {
            blocks_m = blocks_m.next_multiple_of(self.threads).min(panels_m);
        }
        let block = |b: usize| {
            let i0 = b * panels_m / blocks_m * K::MR;
            let i1 = ((b + 1) * panels_m / blocks_m * K::MR).min(m);
            (i0, i1 - i0)
        };
        let groups_n = (2 * self.threads).div_ceil(blocks_m).clamp(1, panels_n);
        let group = panels_n.div_ceil(groups_n);
        let packed_b = &*packed_b;
        let task = |t: usize| {
            let ((i0, rows), g) = (block(t / groups_n), t % groups_n);
            let panels = g * group..((g + 1) * group).min(panels_n);
            let b = &packed_b[panels.start * panel_len..panels.end * panel_len];
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
