//! The products of the CPU attention op, per query head and block of query rows: on the packed
//! GEMM for every dtype ([`Gemm`]), or for bf16 where the GEMM's kernel is `vdpbf16ps` on
//! panels of the key/value head packed once and A read in place ([`Resident`], see
//! [`crate::kernels::gemm::Bf16Products`]). Both round the same operands to the same dtype and
//! sum the same units in the same order: the two give the same bits.

use super::fused::Operand;
use super::Geometry;
use crate::kernels::convert::convert_slice;
use crate::kernels::gemm::{
    gemm, gemm_append, rows_as_units, Bf16Products, GemmElem, MatRef, PackedB, UnitRows,
};

/// One query head's products (head `h` of batch entry `b`, reading key/value head `kv`) for a
/// block `(from, rows)` of its query rows, over the first `keys` keys; every result f32 and
/// row-major.
pub(super) trait Products<T> {
    /// `Q K^T`, `(rows, keys)`.
    fn scores(&self, block: (usize, usize), keys: usize) -> Vec<f32>;
    /// `P V`, `(rows, d_v)`, with `p` `(rows, keys)` rounded to `T` first.
    fn outputs(&self, p: &[f32], rows: usize, keys: usize) -> Vec<f32>;
    /// `dv[..keys] += P^T dO` (`dv` is `(t_k, d_v)`), `p` rounded to `T` first.
    fn add_value_grads(
        &self,
        p: &[f32],
        dout: Operand<T>,
        block: (usize, usize),
        keys: usize,
        dv: &mut [f32],
    );
    /// `dO V^T`, `(rows, keys)`.
    fn prob_grads(&self, dout: Operand<T>, block: (usize, usize), keys: usize) -> Vec<f32>;
    /// `dS K` returned, `(rows, d)`, and `dk[..keys] += dS^T Q` (`dk` is `(t_k, d)`), `ds`
    /// rounded to `T` first.
    fn score_grads(
        &self,
        ds: &[f32],
        block: (usize, usize),
        keys: usize,
        dk: &mut [f32],
    ) -> Vec<f32>;
}

/// Where a head's operands are: `q`, `k` and `v` of query head `(b, h)` and its key/value
/// head `kv`.
#[derive(Clone, Copy)]
pub(super) struct Head<'a, T> {
    pub g: Geometry,
    pub b: usize,
    pub h: usize,
    pub kv: usize,
    pub q: Operand<'a, T>,
    pub k: Operand<'a, T>,
    pub v: Operand<'a, T>,
}

/// The products on the packed GEMM, each packing its two operands.
pub(super) struct Gemm<'a, T>(pub Head<'a, T>);

/// `a * b`, `(m, n)` row-major in f32, into a fresh buffer the GEMM writes whole.
fn product<T: GemmElem>((m, n, k): (usize, usize, usize), a: MatRef<T>, b: MatRef<T>) -> Vec<f32> {
    let mut c = Vec::with_capacity(m * n);
    gemm_append(&mut c, (m, n, k), a, b, false);
    c
}

/// A row-major `(rows, cols)` buffer read transposed, `(cols, rows)`.
fn transposed<T>(data: &[T], cols: usize) -> MatRef<'_, T> {
    MatRef {
        data,
        offset: 0,
        rs: 1,
        cs: cols,
    }
}

impl<T: GemmElem> Products<T> for Gemm<'_, T> {
    fn scores(&self, (from, rows): (usize, usize), keys: usize) -> Vec<f32> {
        let Head {
            g, b, h, kv, q, k, ..
        } = self.0;
        product((rows, keys, g.d), q.rows(b, h, from), k.transposed(b, kv))
    }

    fn outputs(&self, p: &[f32], rows: usize, keys: usize) -> Vec<f32> {
        let Head { g, b, kv, v, .. } = self.0;
        product(
            (rows, g.dv, keys),
            MatRef::row_major(&convert_slice::<f32, T>(p), 0, keys),
            v.rows(b, kv, 0),
        )
    }

    fn add_value_grads(
        &self,
        p: &[f32],
        dout: Operand<T>,
        (from, rows): (usize, usize),
        keys: usize,
        dv: &mut [f32],
    ) {
        let Head { g, b, h, .. } = self.0;
        let p: Vec<T> = convert_slice(p);
        let (p, d) = (transposed(&p, keys), dout.rows(b, h, from));
        gemm(keys, g.dv, rows, p, d, &mut dv[..keys * g.dv], true, false);
    }

    fn prob_grads(&self, dout: Operand<T>, (from, rows): (usize, usize), keys: usize) -> Vec<f32> {
        let Head { g, b, h, kv, v, .. } = self.0;
        product(
            (rows, keys, g.dv),
            dout.rows(b, h, from),
            v.transposed(b, kv),
        )
    }

    fn score_grads(
        &self,
        ds: &[f32],
        (from, rows): (usize, usize),
        keys: usize,
        dk: &mut [f32],
    ) -> Vec<f32> {
        let Head {
            g, b, h, kv, q, k, ..
        } = self.0;
        let ds: Vec<T> = convert_slice(ds);
        let dq = product(
            (rows, g.d, keys),
            MatRef::row_major(&ds, 0, keys),
            k.rows(b, kv, 0),
        );
        let (ds, q) = (transposed(&ds, keys), q.rows(b, h, from));
        gemm(keys, g.d, rows, ds, q, &mut dk[..keys * g.d], true, false);
        dq
    }
}

/// A key/value head's operands packed once as the products' B: `K^T` `(d, t_k)` for the scores,
/// and `V` `(t_k, d_v)` for the forward's outputs or `K` `(t_k, d)` and `V^T` `(d_v, t_k)` for
/// the backward's gradients (the other pass's are left empty).
#[derive(Default)]
pub(super) struct Panels {
    kt: PackedB,
    v: PackedB,
    k: PackedB,
    vt: PackedB,
}

/// Which pass a head's [`Panels`] are for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    Forward,
    Backward,
}

impl Panels {
    /// The panels `pass` reads of key/value head `(b, kv)`.
    pub fn new<T: GemmElem>(
        products: Bf16Products,
        pass: Pass,
        (g, b, kv): (Geometry, usize, usize),
        [k, v]: [Operand<T>; 2],
    ) -> Self {
        let kt = products.pack(k.transposed(b, kv), (g.d, g.tk));
        match pass {
            Pass::Forward => Self {
                kt,
                v: products.pack(v.rows(b, kv, 0), (g.tk, g.dv)),
                ..Self::default()
            },
            Pass::Backward => Self {
                kt,
                k: products.pack(k.rows(b, kv, 0), (g.tk, g.d)),
                vt: products.pack(v.transposed(b, kv), (g.dv, g.tk)),
                ..Self::default()
            },
        }
    }
}

/// The products of a bf16 head on its key/value head's [`Panels`], the query rows and the
/// output's gradient read in place.
pub(super) struct Resident<'a, T> {
    pub products: Bf16Products,
    pub head: Head<'a, T>,
    pub panels: &'a Panels,
}

/// Whether the resident products take operands of this type and layout: bf16, on a CPU with
/// AVX512-BF16 and no AMX ([`Bf16Products::detect`]), even head sizes, and each row's head
/// dimension contiguous.
pub(super) fn resident<T: GemmElem>(g: Geometry, operands: &[Operand<T>]) -> Option<Bf16Products> {
    let in_place = operands.iter().all(|o| o.stride[3] == 1);
    (T::IS_BF16 && g.d.is_multiple_of(2) && g.dv.is_multiple_of(2) && in_place)
        .then(Bf16Products::detect)
        .flatten()
}

/// Rows `from..` of head `(b, h)` of a bf16 operand whose rows are contiguous, as units.
fn unit_rows<T: GemmElem>(
    o: Operand<'_, T>,
    (b, h, from): (usize, usize, usize),
    cols: usize,
) -> UnitRows<'_> {
    let m = o.rows(b, h, from);
    let data = T::bf16_slice(m.data).expect("resident products read bf16");
    UnitRows::rows(data, m.offset, m.rs, cols / 2)
}

impl<T: GemmElem> Products<T> for Resident<'_, T> {
    fn scores(&self, (from, rows): (usize, usize), keys: usize) -> Vec<f32> {
        let Head { g, b, h, q, .. } = self.head;
        let q = unit_rows(q, (b, h, from), g.d);
        self.products.product((rows, keys), q, &self.panels.kt)
    }

    fn outputs(&self, p: &[f32], rows: usize, keys: usize) -> Vec<f32> {
        let x = self.products;
        let p = rows_as_units(p, rows, keys);
        let p = UnitRows::of_rows(&p, keys);
        x.product((rows, self.head.g.dv), p, &self.panels.v)
    }

    fn add_value_grads(
        &self,
        p: &[f32],
        dout: Operand<T>,
        (from, rows): (usize, usize),
        keys: usize,
        dv: &mut [f32],
    ) {
        let (Head { g, b, h, .. }, x) = (self.head, self.products);
        let pt = x.row_pairs(p, rows, keys);
        let d = x.pack(dout.rows(b, h, from), (rows, g.dv));
        x.add_product((keys, g.dv), UnitRows::lanes(&pt, keys), &d, dv, g.dv);
    }

    fn prob_grads(&self, dout: Operand<T>, (from, rows): (usize, usize), keys: usize) -> Vec<f32> {
        let Head { g, b, h, .. } = self.head;
        let d = unit_rows(dout, (b, h, from), g.dv);
        self.products.product((rows, keys), d, &self.panels.vt)
    }

    fn score_grads(
        &self,
        ds: &[f32],
        (from, rows): (usize, usize),
        keys: usize,
        dk: &mut [f32],
    ) -> Vec<f32> {
        let (Head { g, b, h, q, .. }, x) = (self.head, self.products);
        let units = rows_as_units(ds, rows, keys);
        let dq = x.product((rows, g.d), UnitRows::of_rows(&units, keys), &self.panels.k);
        let dst = x.row_pairs(ds, rows, keys);
        let q = x.pack(q.rows(b, h, from), (rows, g.d));
        x.add_product((keys, g.d), UnitRows::lanes(&dst, keys), &q, dk, g.d);
        dq
    }
}
