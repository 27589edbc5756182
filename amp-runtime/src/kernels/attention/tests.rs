use candle_core::{DType, Device, Result, Tensor, Var};

use super::{composed, seeded, Attention, Dropout, Geometry};
use crate::kernels::testing::{max_abs, max_abs_diff, values};

/// The op without dropout, as the public entry calls it.
fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: Option<f64>,
    causal: bool,
) -> Result<Tensor> {
    let options = Attention {
        mask,
        scale,
        causal,
        dropout: 0.0,
    };
    super::scaled_dot_product_attention(q, k, v, &options)
}

/// The mask a case passes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mask {
    None,
    /// An additive f32 `(t_q, t_k)` mask of values in [-2, 2), broadcast over batch and heads.
    Additive,
    /// A `u8` `(b, 1, 1, t_k)` padding mask hiding the last key of each batch entry.
    Padding,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    h: usize,
    hk: usize,
    tq: usize,
    tk: usize,
    d: usize,
    mask: Mask,
    causal: bool,
}

impl Case {
    fn square(len: usize, mask: Mask, causal: bool) -> Self {
        Self {
            b: 2,
            h: 2,
            hk: 2,
            tq: len,
            tk: len,
            d: 16,
            mask,
            causal,
        }
    }

    fn mask(&self) -> Result<Option<Tensor>> {
        let dev = Device::Cpu;
        Ok(match self.mask {
            Mask::None => None,
            Mask::Additive => Some(
                (Tensor::from_vec(values(self.tq * self.tk, 7), (self.tq, self.tk), &dev)? * 2.0)?,
            ),
            Mask::Padding => {
                let keep: Vec<u8> = (0..self.b)
                    .flat_map(|_| (0..self.tk).map(|j| u8::from(j + 1 < self.tk || self.tk == 1)))
                    .collect();
                Some(Tensor::from_vec(keep, (self.b, 1, 1, self.tk), &dev)?)
            }
        })
    }
}

/// Values in [-1, 1) of `shape`, rounded to `dtype`.
fn input(shape: (usize, usize, usize, usize), seed: u64, dtype: DType) -> Result<Tensor> {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    Tensor::from_vec(values(n, seed), shape, &Device::Cpu)?.to_dtype(dtype)
}

/// The output and the gradients of `sum(out * w)` for q, k and v, all as f64.
type Run = [Tensor; 4];

/// `attention` on variables holding `q`, `k`, `v` in `dtype`, differentiated through
/// `sum(out * w)` (`w` fixed, in [-1, 1)).
fn run(
    case: Case,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    dtype: DType,
    attention: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Run> {
    let var = |t: &Tensor| t.to_dtype(dtype).and_then(|t| Var::from_tensor(&t));
    let (q, k, v) = (var(q)?, var(k)?, var(v)?);
    let out = attention(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
    let w = input(out.dims4()?, 11, DType::F64)?;
    let grads = (out.to_dtype(DType::F64)? * &w)?.sum_all()?.backward()?;
    let grad = |var: &Var| -> Result<Tensor> {
        let g = grads.get(var).expect("a gradient for every operand");
        assert_eq!(
            g.dtype(),
            dtype,
            "{case:?}: a gradient in its operand's dtype"
        );
        g.to_dtype(DType::F64)
    };
    Ok([out.to_dtype(DType::F64)?, grad(&q)?, grad(&k)?, grad(&v)?])
}

/// The largest error of `got` against `want`, over the largest `|want|`, for the output and
/// each gradient.
fn errors(got: &Run, want: &Run) -> Result<[f32; 4]> {
    let mut out = [0f32; 4];
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        out[i] = max_abs_diff(g, w)? / max_abs(w)?.max(1e-30);
    }
    Ok(out)
}

/// The op against the composed math (candle ops, products in the operands' dtype, softmax in
/// f32) and both against the same math in f64 on the same rounded inputs: the output and the
/// three gradients, for f32, f16 and bf16, with and without masks and the causal mask, over
/// lengths 1, 7, 64 (two blocks) and 1000 (32 blocks, 1000 keys), grouped-query heads and a
/// KV-cache shape. Errors are over the largest value of each quantity. The op's is within the
/// dtype's bound (largest measured: f32 5.4e-7, f16 6.1e-4, bf16 5.8e-3) and of the composed
/// math's order (at most twice it, plus an f32 ulp; measured up to 1.6 times in one case, 0.7
/// to 1.0 times at the median: the two round the same products to the same dtype).
#[test]
fn matches_the_composed_math_and_f64() -> Result<()> {
    let mut cases = Vec::new();
    for len in [1, 7, 64] {
        for mask in [Mask::None, Mask::Additive, Mask::Padding] {
            for causal in [false, true] {
                cases.push(Case::square(len, mask, causal));
            }
        }
    }
    cases.push(Case {
        b: 1,
        h: 2,
        hk: 1,
        d: 8,
        ..Case::square(1000, Mask::Additive, true)
    });
    // Grouped-query attention, a KV-cache shape (fewer queries than keys) and a head size
    // that is no multiple of a SIMD width.
    cases.push(Case {
        h: 4,
        hk: 2,
        ..Case::square(7, Mask::None, true)
    });
    cases.push(Case {
        tq: 3,
        tk: 9,
        d: 5,
        ..Case::square(7, Mask::Additive, true)
    });
    for case in cases {
        let q = input((case.b, case.h, case.tq, case.d), 1, DType::F32)?;
        let k = input((case.b, case.hk, case.tk, case.d), 2, DType::F32)?;
        let v = input((case.b, case.hk, case.tk, case.d), 3, DType::F32)?;
        let mask = case.mask()?;
        for (dtype, bound) in [
            (DType::F32, 1.5e-6),
            (DType::F16, 1.5e-3),
            (DType::BF16, 1.2e-2),
        ] {
            // Both sides read the same rounded values.
            let (q, k, v) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?, v.to_dtype(dtype)?);
            let reference = run(case, (&q, &k, &v), DType::F64, |q, k, v| {
                composed(
                    q,
                    k,
                    v,
                    (mask.as_ref(), 1.0 / (case.d as f64).sqrt(), case.causal),
                    None,
                )
            })?;
            let ours = run(case, (&q, &k, &v), dtype, |q, k, v| {
                attend(q, k, v, mask.as_ref(), None, case.causal)
            })?;
            let theirs = run(case, (&q, &k, &v), dtype, |q, k, v| {
                composed(
                    q,
                    k,
                    v,
                    (mask.as_ref(), 1.0 / (case.d as f64).sqrt(), case.causal),
                    None,
                )
            })?;
            let (ours, theirs) = (errors(&ours, &reference)?, errors(&theirs, &reference)?);
            for (what, (o, t)) in ["output", "dq", "dk", "dv"]
                .iter()
                .zip(ours.iter().zip(&theirs))
            {
                assert!(
                    *o <= bound && *o <= 2.0 * t + 1.2e-7,
                    "{case:?} {dtype:?} {what}: error {o:e} (composed math: {t:e}, bound {bound:e})"
                );
            }
        }
    }
    Ok(())
}

/// A query row that sees no key (every key padded away for it, or a causal row above the
/// keys) has output 0 and gradient 0, and no NaN reaches any other row's values or gradients;
/// the other rows match the composed math. Keys no query sees get exactly zero gradients. (The
/// mask is a constant, as a padding mask is: one that takes a gradient runs the composed math,
/// `tests/ops.rs`.)
#[test]
fn rows_that_see_no_key_are_zero_and_nothing_leaks() -> Result<()> {
    let dev = Device::Cpu;
    let (b, h, tq, tk, d) = (1, 2, 5, 4, 8);
    let q = input((b, h, tq, d), 1, DType::F32)?;
    let k = input((b, h, tk, d), 2, DType::F32)?;
    let v = input((b, h, tk, d), 3, DType::F32)?;
    // Query 2 sees no key; key 1 is seen by no query.
    let keep: Vec<f32> = (0..tq)
        .flat_map(|i| {
            (0..tk).map(move |j| {
                if i == 2 || j == 1 {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(keep, (tq, tk), &dev)?;
    let (vq, vk, vv) = (
        Var::from_tensor(&q)?,
        Var::from_tensor(&k)?,
        Var::from_tensor(&v)?,
    );
    let out = attend(&vq, &vk, &vv, Some(&mask), None, false)?;
    let w = input(out.dims4()?, 11, DType::F32)?;
    let grads = (&out * &w)?.sum_all()?.backward()?;
    let (dq, dk, dv) = (
        grads.get(&vq).expect("dq").clone(),
        grads.get(&vk).expect("dk").clone(),
        grads.get(&vv).expect("dv").clone(),
    );
    for t in [&out, &dq, &dk, &dv] {
        let all: Vec<f32> = t.flatten_all()?.to_vec1()?;
        assert!(all.iter().all(|x| x.is_finite()), "no NaN or inf anywhere");
    }
    let row =
        |t: &Tensor, i: usize| -> Result<Vec<f32>> { t.narrow(2, i, 1)?.flatten_all()?.to_vec1() };
    assert!(
        row(&out, 2)?.iter().all(|&x| x == 0.0),
        "the blind row's output is 0"
    );
    assert!(
        row(&dq, 2)?.iter().all(|&x| x == 0.0),
        "and its gradient too"
    );
    assert!(
        row(&dk, 1)?.iter().all(|&x| x == 0.0),
        "an unseen key's gradient is 0"
    );
    assert!(
        row(&dv, 1)?.iter().all(|&x| x == 0.0),
        "an unseen value's gradient is 0"
    );
    let scale = 1.0 / (d as f64).sqrt();
    let reference = composed(&q, &k, &v, (Some(&mask), scale, false), None)?;
    assert!(max_abs_diff(&out, &reference)? < 1e-6);

    // Causal with more queries than keys: the first `tq - tk` rows see nothing.
    let out = attend(&q, &k, &v, None, None, true)?;
    for i in 0..tq - tk {
        assert!(
            row(&out, i)?.iter().all(|&x| x == 0.0),
            "causal row {i} sees no key"
        );
    }
    let reference = composed(&q, &k, &v, (None, 1.0 / (d as f64).sqrt(), true), None)?;
    assert!(max_abs_diff(&out, &reference)? < 1e-6);
    Ok(())
}

/// A NaN in one query makes its own row NaN (the gradient scaler must see it) and no other.
#[test]
fn a_nan_query_poisons_its_own_row_only() -> Result<()> {
    let (b, h, t, d) = (1, 1, 4, 8);
    let mut qv = values(b * h * t * d, 1);
    qv[2 * d] = f32::NAN;
    let q = Tensor::from_vec(qv, (b, h, t, d), &Device::Cpu)?;
    let k = input((b, h, t, d), 2, DType::F32)?;
    let v = input((b, h, t, d), 3, DType::F32)?;
    let out = attend(&q, &k, &v, None, None, false)?;
    for i in 0..t {
        let row: Vec<f32> = out.narrow(2, i, 1)?.flatten_all()?.to_vec1()?;
        assert_eq!(row.iter().all(|x| x.is_nan()), i == 2, "row {i}: {row:?}");
        assert!(i == 2 || row.iter().all(|x| x.is_finite()));
    }
    Ok(())
}

/// Queries, keys and values read in place from `(b, t, h, d)` tensors (the heads split by a
/// transpose, no copy) give the same bits as contiguous `(b, h, t, d)` copies, and so do the
/// gradients.
#[test]
fn reads_transposed_heads_in_place() -> Result<()> {
    for dtype in [DType::F32, DType::BF16] {
        let (b, t, h, d) = (2, 9, 3, 8);
        let packed = |seed| input((b, t, h, d), seed, dtype);
        let (q, k, v) = (packed(1)?, packed(2)?, packed(3)?);
        let heads = |x: &Tensor| x.transpose(1, 2);
        let strided = run_bits((&heads(&q)?, &heads(&k)?, &heads(&v)?))?;
        let copied = run_bits((
            &heads(&q)?.contiguous()?,
            &heads(&k)?.contiguous()?,
            &heads(&v)?.contiguous()?,
        ))?;
        for (a, b) in strided.iter().zip(&copied) {
            assert_eq!(a, b, "{dtype:?}");
        }
    }
    Ok(())
}

/// The output and gradients' values as f32, for comparisons bit for bit.
fn run_bits((q, k, v): (&Tensor, &Tensor, &Tensor)) -> Result<Vec<Vec<f32>>> {
    let (vq, vk, vv) = (
        Var::from_tensor(q)?,
        Var::from_tensor(k)?,
        Var::from_tensor(v)?,
    );
    let out = attend(&vq, &vk, &vv, None, None, true)?;
    let grads = out.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;
    [
        &out,
        grads.get(&vq).unwrap(),
        grads.get(&vk).unwrap(),
        grads.get(&vv).unwrap(),
    ]
    .iter()
    .map(|t| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1())
    .collect()
}

/// Shapes, dtypes, masks and scales that do not fit are errors naming what is wrong.
#[test]
fn bad_arguments_are_errors_naming_them() -> Result<()> {
    let q = input((1, 4, 3, 8), 1, DType::F32)?;
    let k = input((1, 2, 5, 8), 2, DType::F32)?;
    let v = input((1, 2, 5, 6), 3, DType::F32)?;
    let err = |r: Result<Tensor>| r.expect_err("an error").to_string();
    assert!(err(attend(&q.squeeze(0)?, &k, &v, None, None, false))
        .contains("(batch, heads, length, head_dim)"));
    assert!(err(attend(&q, &k.narrow(3, 0, 4)?, &v, None, None, false)).contains("head_dim"));
    assert!(err(attend(&q.narrow(1, 0, 3)?, &k, &v, None, None, false)).contains("multiple"));
    assert!(err(attend(&q, &k, &v.narrow(2, 0, 4)?, None, None, false))
        .contains("key and value differ"));
    assert!(
        err(attend(&q, &k.to_dtype(DType::F16)?, &v, None, None, false))
            .contains("one float dtype")
    );
    assert!(err(attend(&q, &k, &v, None, Some(f64::NAN), false)).contains("finite"));
    let wrong = Tensor::zeros((3, 4), DType::F32, &Device::Cpu)?;
    assert!(err(attend(&q, &k, &v, Some(&wrong), None, false)).contains("does not broadcast"));
    let ids = Tensor::zeros((3, 5), DType::U32, &Device::Cpu)?;
    assert!(err(attend(&q, &k, &v, Some(&ids), None, false)).contains("u8"));
    Ok(())
}

/// Dropout on the probabilities: the op with a fixed seed against the composed math given the
/// same keep mask (the seed's draws), values and the three gradients, in f32 (to f32's
/// precision) and bf16 (to bf16's); the share of dropped probabilities is `p` (2% slack over
/// 65,536 draws, about 14 standard deviations); each seed drops others; and `p` outside [0, 1)
/// is an error.
#[test]
fn dropout_drops_what_its_seed_says_and_the_backward_agrees() -> Result<()> {
    let case = Case {
        b: 2,
        h: 2,
        hk: 1,
        tq: 64,
        tk: 64,
        d: 16,
        mask: Mask::Additive,
        causal: true,
    };
    let q = input((case.b, case.h, case.tq, case.d), 1, DType::F32)?;
    let k = input((case.b, case.hk, case.tk, case.d), 2, DType::F32)?;
    let v = input((case.b, case.hk, case.tk, case.d), 3, DType::F32)?;
    let g = Geometry::check(&q, &k, &v)?;
    let (p, seed) = (0.25f32, 0x5eed);
    let keep = Dropout { p, seed }.mask(g, &Device::Cpu)?;
    let kept = keep.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()?;
    assert!((kept - (1.0 - p)).abs() < 0.02, "kept {kept}");
    let other = Dropout { p, seed: seed + 1 }.mask(g, &Device::Cpu)?;
    assert!(max_abs_diff(&keep.to_dtype(DType::F32)?, &other.to_dtype(DType::F32)?)? > 0.0);

    let mask = case.mask()?;
    let scale = 1.0 / (case.d as f64).sqrt();
    for (dtype, bound) in [(DType::F32, 2e-6), (DType::BF16, 2e-2)] {
        let (q, k, v) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?, v.to_dtype(dtype)?);
        let reference = run(case, (&q, &k, &v), DType::F64, |q, k, v| {
            composed(q, k, v, (mask.as_ref(), scale, true), Some((&keep, p)))
        })?;
        let ours = run(case, (&q, &k, &v), dtype, |q, k, v| {
            let options = Attention {
                mask: mask.as_ref(),
                scale: None,
                causal: true,
                dropout: p,
            };
            seeded(q, k, v, &options, seed)
        })?;
        for (what, e) in ["output", "dq", "dk", "dv"]
            .iter()
            .zip(errors(&ours, &reference)?)
        {
            assert!(e <= bound, "{dtype:?} {what}: error {e:e}");
        }
    }
    for bad in [1.0, -0.1, f32::NAN] {
        let options = Attention {
            dropout: bad,
            ..Attention::default()
        };
        let err = super::scaled_dot_product_attention(&q, &k, &v, &options)
            .expect_err("a bad dropout probability")
            .to_string();
        assert!(err.contains("dropout probability"), "{err}");
    }
    Ok(())
}

/// The packed entry is the op on the three parts of `qkv` with the output in `(b, t, h, d)`:
/// the same values and the same gradient of `qkv`, bit for bit, as the op on the views
/// (whose gradient candle assembles through the views' backward), with and without the causal
/// mask and a mask, in f32 and bf16, over lengths that end inside and on a block.
#[test]
fn the_packed_entry_is_the_op_on_the_views_bit_for_bit() -> Result<()> {
    for dtype in [DType::F32, DType::BF16] {
        for (t, causal, masked) in [(7, false, false), (33, true, false), (64, true, true)] {
            let (b, h, d) = (2, 3, 8);
            let qkv = Var::from_tensor(&input5((b, t, 3, h, d), 3, dtype)?)?;
            let mask = masked
                .then(|| input((1, 1, t, t), 5, DType::F32))
                .transpose()?;
            let options = Attention {
                mask: mask.as_ref(),
                scale: None,
                causal,
                dropout: 0.0,
            };
            let w = input((b, t, h, d), 7, DType::F32)?;
            let packed = super::packed_attention(&qkv, &options)?;
            let part = |i: usize| qkv.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2);
            let viewed =
                super::scaled_dot_product_attention(&part(0)?, &part(1)?, &part(2)?, &options)?
                    .transpose(1, 2)?;
            assert_eq!(packed.dims(), &[b, t, h, d]);
            let bits = |x: &Tensor| -> Result<Vec<f32>> {
                x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
            };
            assert_eq!(
                bits(&packed)?,
                bits(&viewed)?,
                "{dtype:?} t {t} causal {causal}: values"
            );
            let grad = |out: &Tensor| -> Result<Vec<f32>> {
                let g = (out.to_dtype(DType::F32)? * &w)?.sum_all()?.backward()?;
                bits(g.get(&qkv).expect("a gradient reaches qkv"))
            };
            assert_eq!(
                grad(&packed)?,
                grad(&viewed)?,
                "{dtype:?} t {t} causal {causal}: grad"
            );
        }
    }
    let flat = input((2, 3, 4, 8), 1, DType::F32)?;
    let e = super::packed_attention(&flat, &Attention::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("qkv must be (batch, length, 3, heads, head_dim)"),
        "{e}"
    );
    let two = input5((1, 4, 2, 2, 8), 1, DType::F32)?;
    let e = super::packed_attention(&two, &Attention::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("(dimension 2 is 2)") && !e.contains("float"),
        "{e}"
    );
    let ids = input5((1, 4, 3, 2, 8), 1, DType::F32)?.to_dtype(DType::U32)?;
    let e = super::packed_attention(&ids, &Attention::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("must be a float"), "{e}");
    Ok(())
}

fn input5(shape: (usize, usize, usize, usize, usize), seed: u64, dtype: DType) -> Result<Tensor> {
    let n = shape.0 * shape.1 * shape.2 * shape.3 * shape.4;
    Tensor::from_vec(values(n, seed), shape, &Device::Cpu)?.to_dtype(dtype)
}

/// Under a mask of -1e9 (a padding convention), f32 rounds both scores to the mask and the row's
/// probabilities are uniform; the backward's recomputed probabilities must be the same ones. A
/// kept log-sum-exp, `-1e9 + ln 2`, rounds to -1e9 and gave 1 for every key (gradients
/// `dq = -5`, `dk = [-3, -1]`, `dv = [1, 1]`). By hand: `p = [0.5, 0.5]`, `y = 2`,
/// `dv = p = [0.5, 0.5]`, `dS = p * (v - y) = [-0.5, 0.5]`, `dq = dS k = 0.5`, `dk = dS q`.
#[test]
fn a_huge_finite_mask_gives_the_forward_s_probabilities_in_the_backward() -> Result<()> {
    let dev = Device::Cpu;
    let q = Var::new(&[[[[1f32]]]], &dev)?;
    let k = Var::new(&[[[[1f32], [2.0]]]], &dev)?;
    let v = Var::new(&[[[[1f32], [3.0]]]], &dev)?;
    let mask = Tensor::new(&[[-1e9f32, -1e9]], &dev)?;
    let y = attend(&q, &k, &v, Some(&mask), Some(1.0), false)?;
    let grads = y.sum_all()?.backward()?;
    let flat = |t: &Tensor| -> Result<Vec<f32>> { t.flatten_all()?.to_vec1() };
    assert_eq!(flat(&y)?, [2.0]);
    assert_eq!(flat(grads.get(&q).expect("dq"))?, [0.5]);
    assert_eq!(flat(grads.get(&k).expect("dk"))?, [-0.5, 0.5]);
    assert_eq!(flat(grads.get(&v).expect("dv"))?, [0.5, 0.5]);
    Ok(())
}

/// The op as the public entry runs it, or with every product on the packed GEMM.
fn attend_on(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    options: &Attention,
    seed: u64,
    gemm_only: bool,
) -> Result<Tensor> {
    let g = Geometry::check(q, k, v)?;
    let (scale, dropout) = super::resolve(options, g, seed)?;
    let op = super::fused::Fused::new(options, g, scale, dropout, false)?;
    q.apply_op3(k, v, if gemm_only { op.on_the_gemm() } else { op })
}

/// On a CPU whose bf16 GEMM is `vdpbf16ps`, bf16 attention runs its products on key/value
/// panels packed once per head with the query rows read in place (`gemm::Bf16Products`); the
/// packed GEMM rounds
/// the same operands and sums the same pairs in the same order, so the output and the three
/// gradients must be its bits exactly. Cases: odd and even lengths (blocks that end inside and
/// on 32 rows, odd key counts under the causal mask), a KV cache with grouped heads, value
/// heads narrower than the keys', masks, dropout, transposed `(b, t, h, d)` views, 1000 keys.
#[test]
fn resident_bf16_products_give_the_gemm_s_bits() -> Result<()> {
    if crate::kernels::gemm::Bf16Products::detect().is_none() {
        eprintln!("no vdpbf16ps GEMM on this CPU: the resident products do not run");
        return Ok(());
    }
    // (b, h, h_kv, t_q, t_k, d, d_v), causal, mask, dropout, heads read transposed.
    let cases = [
        ((2, 2, 2, 7, 7, 16, 16), false, Mask::None, 0.0, false),
        ((2, 2, 2, 7, 7, 16, 16), true, Mask::None, 0.0, false),
        ((1, 2, 1, 64, 64, 16, 16), true, Mask::Additive, 0.0, false),
        ((2, 1, 1, 100, 100, 8, 8), true, Mask::Padding, 0.0, false),
        ((1, 4, 2, 5, 33, 16, 8), true, Mask::None, 0.0, false),
        ((2, 2, 1, 33, 33, 16, 16), true, Mask::Additive, 0.2, false),
        ((1, 1, 1, 1, 1, 2, 2), false, Mask::None, 0.0, false),
        ((2, 3, 3, 9, 9, 8, 8), true, Mask::None, 0.0, true),
        ((1, 1, 1, 40, 1000, 16, 16), false, Mask::None, 0.0, false),
    ];
    for ((b, h, hk, tq, tk, d, dv), causal, mask, dropout, transposed) in cases {
        let heads = |(n, t, w): (usize, usize, usize), seed| -> Result<Tensor> {
            if transposed {
                input((b, t, n, w), seed, DType::BF16)?.transpose(1, 2)
            } else {
                input((b, n, t, w), seed, DType::BF16)
            }
        };
        let (q, k, v) = (
            heads((h, tq, d), 1)?,
            heads((hk, tk, d), 2)?,
            heads((hk, tk, dv), 3)?,
        );
        let case = Case {
            b,
            h,
            hk,
            tq,
            tk,
            d,
            mask,
            causal,
        };
        let mask = case.mask()?;
        let options = Attention {
            mask: mask.as_ref(),
            scale: None,
            causal,
            dropout,
        };
        let w = input((b, h, tq, dv), 4, DType::F32)?;
        let bits = |gemm_only: bool| -> Result<Vec<Vec<u16>>> {
            let vars = [
                Var::from_tensor(&q)?,
                Var::from_tensor(&k)?,
                Var::from_tensor(&v)?,
            ];
            let [vq, vk, vv] = &vars;
            let out = attend_on((vq, vk, vv), &options, 0x5eed, gemm_only)?;
            let grads = (out.to_dtype(DType::F32)? * &w)?.sum_all()?.backward()?;
            let mut all = vec![out];
            for var in &vars {
                all.push(
                    grads
                        .get(var)
                        .expect("a gradient for every operand")
                        .clone(),
                );
            }
            all.iter()
                .map(|t| {
                    let t = t.flatten_all()?.to_vec1::<half::bf16>()?;
                    Ok(t.iter().map(|x| x.to_bits()).collect())
                })
                .collect()
        };
        let (resident, gemm) = (bits(false)?, bits(true)?);
        for (what, (r, g)) in ["output", "dq", "dk", "dv"]
            .iter()
            .zip(resident.iter().zip(&gemm))
        {
            assert!(
                r == g,
                "{case:?} dropout {dropout} transposed {transposed}: {what} differs"
            );
        }
        assert!(resident[0].iter().any(|&x| x != 0), "{case:?}: an output");
    }
    Ok(())
}
