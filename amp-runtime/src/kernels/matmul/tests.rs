//! The half matmul and `Linear` against candle's f32 ops.

use candle_core::{Device, Var};

use super::*;

fn max_rel_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let diff = (a.to_dtype(DType::F32)? - b)?
        .abs()?
        .flatten_all()?
        .max(0)?;
    let scale = b.abs()?.flatten_all()?.max(0)?;
    Ok(diff.to_scalar::<f32>()? / scale.to_scalar::<f32>()?.max(1e-30))
}

/// The off-CPU `Linear` op (run here on CPU, where its forward is candle's matmul on
/// storages) against the candle composition: the master cast to the input's dtype, `x *
/// w^T + b` with the bias rounded to that dtype, and all three gradients (the weight's
/// rounded to that dtype once, then widened; the bias's summed in f32), in f32 and bf16, for a
/// rank-2 input and a rank-3 one read as its rows.
#[test]
fn the_master_linear_op_is_the_composition() -> Result<()> {
    let dev = Device::Cpu;
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 8e-3)] {
        for (bias, lead) in [(true, vec![37]), (false, vec![37]), (true, vec![5, 7])] {
            let x_shape = [lead.as_slice(), &[19]].concat();
            let y_shape = [lead.as_slice(), &[11]].concat();
            let x = Var::from_tensor(&Tensor::randn(0f32, 1., x_shape, &dev)?.to_dtype(dtype)?)?;
            let w = Var::randn(0f32, 1., (11, 19), &dev)?;
            let b = Var::randn(0f32, 1., 11, &dev)?;
            let ours = fused::<MasterLinear>(&x, &w, bias.then_some(b.as_tensor()))?;
            assert_eq!((ours.dtype(), ours.dims()), (dtype, y_shape.as_slice()));
            let product = x.broadcast_matmul(&w.to_dtype(dtype)?.t()?)?;
            let theirs = if bias {
                product.broadcast_add(&b.to_dtype(dtype)?)?
            } else {
                product
            };
            assert!(
                max_rel_diff(&ours, &theirs.to_dtype(DType::F32)?)? <= tol,
                "{dtype:?}"
            );
            let r = Tensor::randn(0f32, 1., y_shape.as_slice(), &dev)?;
            let loss = |y: &Tensor| (y.to_dtype(DType::F32)? * &r)?.sum_all()?.backward();
            let (g_ours, g_theirs) = (loss(&ours)?, loss(&theirs)?);
            let vars: Vec<&Var> = if bias { vec![&x, &w, &b] } else { vec![&x, &w] };
            for v in vars {
                let (a, e) = (
                    g_ours.get(v).expect("ours"),
                    g_theirs.get(v).expect("theirs"),
                );
                assert_eq!((a.dtype(), a.dims()), (v.dtype(), v.dims()));
                // candle's own bias gradient is summed in bf16: compare with room for it.
                let tol = if v.dims() == [11] { 4.0 * tol } else { tol };
                assert!(
                    max_rel_diff(a, &e.to_dtype(DType::F32)?)? <= tol,
                    "{dtype:?} {:?}",
                    v.dims()
                );
            }
        }
    }
    Ok(())
}

/// Forward and both gradients against candle's f32 matmul on the same rounded values,
/// batched, transposed and broadcast.
#[test]
fn half_matmul_and_its_gradients_match_f32() -> Result<()> {
    let dev = Device::Cpu;
    for (dtype, tol) in [(DType::BF16, 1e-2), (DType::F16, 2e-3)] {
        for (a_dims, b_dims, transpose_b) in [
            (vec![7, 17], vec![17, 5], false),
            (vec![3, 33, 70], vec![3, 70, 40], false),
            (vec![2, 3, 9, 16], vec![2, 3, 11, 16], true),
        ] {
            let a = Tensor::randn(0f32, 1., a_dims.as_slice(), &dev)?.to_dtype(dtype)?;
            let b = Tensor::randn(0f32, 1., b_dims.as_slice(), &dev)?.to_dtype(dtype)?;
            let (av, bv) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?);
            let b_op = if transpose_b {
                bv.t()?
            } else {
                bv.as_tensor().clone()
            };
            let y = matmul(&av, &b_op)?;
            assert_eq!(y.dtype(), dtype);
            let grads = y.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;

            let (a32, b32) = (
                Var::from_tensor(&a.to_dtype(DType::F32)?)?,
                Var::from_tensor(&b.to_dtype(DType::F32)?)?,
            );
            let b32_op = if transpose_b {
                b32.t()?
            } else {
                b32.as_tensor().clone()
            };
            let y32 = a32.matmul(&b32_op)?;
            let grads32 = y32.sqr()?.sum_all()?.backward()?;
            assert!(
                max_rel_diff(&y, &y32)? <= tol,
                "{dtype:?} {a_dims:?} forward"
            );
            let ga = grads.get(&av).unwrap();
            assert_eq!(ga.dtype(), dtype);
            assert!(
                max_rel_diff(ga, grads32.get(&a32).unwrap())? <= 3.0 * tol,
                "{dtype:?} {a_dims:?} grad a"
            );
            assert!(
                max_rel_diff(grads.get(&bv).unwrap(), grads32.get(&b32).unwrap())? <= 3.0 * tol,
                "{dtype:?} {a_dims:?} grad b"
            );
        }
    }
    Ok(())
}

/// Operands that track nothing (the data, a frozen bias) get no gradient from a half
/// `Linear`, nor from the loss on its output (the target), where candle's own matmul and
/// composition give each one; the weight's gradient is the same, to the bit, as when the
/// input is a variable too.
#[test]
fn operands_that_track_nothing_get_no_gradient() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (37, 70), &dev)?.to_dtype(DType::BF16)?;
    let target = Tensor::randn(0f32, 1., (37, 19), &dev)?;
    let w = Var::randn(0f32, 1., (19, 70), &dev)?;
    let frozen_bias = Tensor::randn(0f32, 1., 19, &dev)?;
    let grads_from = |x: &Tensor| -> Result<candle_core::backprop::GradStore> {
        let y = linear(x, &w, Some(&frozen_bias))?.to_dtype(DType::F32)?;
        crate::kernels::mse::mse(&y, &target)?
            .expect("an f32 pair on CPU")
            .backward()
    };
    let grads = grads_from(&x)?;
    assert!(grads.get(&x).is_none(), "the data");
    assert!(grads.get(&frozen_bias).is_none(), "a frozen bias");
    assert!(grads.get(&target).is_none(), "the target");
    let xv = Var::from_tensor(&x)?;
    let with_x = grads_from(xv.as_tensor())?;
    assert!(with_x.get(&xv).is_some(), "a variable input gets one");
    let (gw, gw_with_x) = (grads.get(&w).unwrap(), with_x.get(&w).unwrap());
    assert_eq!(gw.to_vec2::<f32>()?, gw_with_x.to_vec2::<f32>()?);
    // candle's own ops compute and store one for an untracked operand.
    let y = x.to_dtype(DType::F32)?.matmul(&w.t()?)?;
    let grads = (y - &target)?.sqr()?.mean_all()?.backward()?;
    assert!(grads.get(&target).is_some());
    Ok(())
}

/// The fused linear on f32 masters (with and without bias, contiguous and transposed
/// input) against the composition PyTorch's autocast runs (masters cast to half, half
/// matmul, half bias add), in f32 on the same rounded values: the output and every
/// gradient, the masters' gradients in f32.
#[test]
fn half_linear_on_f32_masters_matches_the_composition() -> Result<()> {
    let dev = Device::Cpu;
    for (dtype, tol) in [(DType::BF16, 1e-2), (DType::F16, 2e-3)] {
        for (with_bias, transposed) in [(false, false), (true, false), (true, true)] {
            let x = Tensor::randn(0f32, 1., (37, 70), &dev)?.to_dtype(dtype)?;
            let w = Var::randn(0f32, 1., (19, 70), &dev)?;
            let b = Var::randn(0f32, 1., 19, &dev)?;
            // A transposed input: the (37, 70) view of a (70, 37) tensor.
            let xin = if transposed {
                Var::from_tensor(&x.t()?.contiguous()?)?
            } else {
                Var::from_tensor(&x)?
            };
            let x_op = if transposed {
                xin.t()?
            } else {
                xin.as_tensor().clone()
            };
            let y = linear(&x_op, &w, with_bias.then_some(b.as_tensor()))?;
            assert_eq!(y.dtype(), dtype);
            let grads = y.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;

            // The reference: f32 math on the half-rounded values.
            let x32 = Var::from_tensor(&x.to_dtype(DType::F32)?)?;
            let w32 = Var::from_tensor(&w.to_dtype(dtype)?.to_dtype(DType::F32)?)?;
            let b32 = Var::from_tensor(&b.to_dtype(dtype)?.to_dtype(DType::F32)?)?;
            let mut y32 = x32.matmul(&w32.t()?)?;
            if with_bias {
                y32 = y32.broadcast_add(&b32)?;
            }
            let grads32 = y32.sqr()?.sum_all()?.backward()?;
            let what = format!("{dtype:?} bias={with_bias} transposed={transposed}");
            assert!(max_rel_diff(&y, &y32)? <= tol, "{what} forward");
            let gx = grads.get(&xin).unwrap();
            let gx = if transposed { gx.t()? } else { gx.clone() };
            assert_eq!(gx.dtype(), dtype);
            let close = |g: &Tensor, g32: &Tensor| -> Result<bool> {
                Ok(max_rel_diff(g, g32)? <= 3.0 * tol)
            };
            assert!(close(&gx, grads32.get(&x32).unwrap())?, "{what} grad x");
            let gw = grads.get(&w).unwrap();
            assert_eq!(
                gw.dtype(),
                DType::F32,
                "{what}: the master's gradient is f32"
            );
            assert!(close(gw, grads32.get(&w32).unwrap())?, "{what} grad w");
            if with_bias {
                let gb = grads.get(&b).unwrap();
                assert_eq!(gb.dtype(), DType::F32);
                assert!(close(gb, grads32.get(&b32).unwrap())?, "{what} grad b");
            }
        }
    }
    Ok(())
}

/// A contiguous rank-3 input is read in place as its rows: the same bits as the input flattened
/// to 2-D first, for the output and every gradient, with one graph node (no reshapes).
#[test]
fn a_rank_3_input_is_its_rows() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::BF16, DType::F16] {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1., (3, 5, 16), &dev)?.to_dtype(dtype)?)?;
        let w = Var::randn(0f32, 1., (7, 16), &dev)?;
        let b = Var::randn(0f32, 1., 7, &dev)?;
        let run = |flat: bool| -> Result<Vec<Vec<f32>>> {
            let y = if flat {
                linear(&x.reshape((15, 16))?, &w, Some(&b))?.reshape((3, 5, 7))?
            } else {
                linear(&x, &w, Some(&b))?
            };
            assert_eq!(y.dims(), [3, 5, 7]);
            let grads = y.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;
            [
                &y,
                grads.get(&x).unwrap(),
                grads.get(&w).unwrap(),
                grads.get(&b).unwrap(),
            ]
            .iter()
            .map(|t| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1())
            .collect()
        };
        assert_eq!(run(false)?, run(true)?, "{dtype:?}");
        let y = linear(&x, &w, Some(&b))?;
        assert_eq!(y.sorted_nodes().len(), 4, "one op over x, w and b");
    }
    Ok(())
}

#[test]
fn shapes_candle_rejects_get_candles_error() {
    let dev = Device::Cpu;
    let a = Tensor::zeros((2, 3), DType::BF16, &dev).unwrap();
    let b = Tensor::zeros((4, 5), DType::BF16, &dev).unwrap();
    let err = matmul(&a, &b).unwrap_err().to_string();
    assert!(err.contains("shape mismatch"), "{err}");
}

/// A broadcast operand of `broadcast_matmul` gets its gradient summed over the batch in f32:
/// 300 matrices of bf16 ones give 300 (summed in bf16, as candle's backward of a broadcast
/// view does, they stick at 256), for a shared right operand and a broadcast left one.
#[test]
fn a_broadcast_operand_gets_its_gradient_summed_in_f32() -> Result<()> {
    let dev = Device::Cpu;
    let ones = |shape: &[usize]| Tensor::ones(shape, DType::BF16, &dev);
    let grad_of = |y: &Tensor, v: &candle_core::Var| -> Result<Vec<f32>> {
        let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let g = grads.get(v).expect("a gradient").to_dtype(DType::F32)?;
        g.flatten_all()?.to_vec1()
    };
    let w = candle_core::Var::from_tensor(&ones(&[1, 2])?)?;
    let y = broadcast_matmul(&ones(&[300, 1, 1])?, &w)?;
    assert_eq!(y.dims(), [300, 1, 2]);
    assert_eq!(grad_of(&y, &w)?, [300.0, 300.0]);
    let v = candle_core::Var::from_tensor(&ones(&[1, 2])?)?;
    let y = broadcast_matmul(&v, &ones(&[300, 2, 1])?)?;
    assert_eq!(y.dims(), [300, 1, 1]);
    assert_eq!(grad_of(&y, &v)?, [300.0, 300.0]);
    Ok(())
}
