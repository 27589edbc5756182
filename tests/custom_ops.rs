//! User ops: `#[custom_fwd]` (caller's policy, or inputs cast with autocast off) and
//! `#[custom_bwd]` (backward in the forward's dtypes).

use std::cell::RefCell;

use candle_amp::nn;
use candle_amp::{autocast, custom_bwd, custom_fwd, Tensor, F16, F32};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape};
use candle_nn::{VarBuilder, VarMap};

fn dev() -> Device {
    Device::Cpu
}

/// A user op that runs under whatever policy its caller has.
struct GatedProjection {
    w: Tensor<F32>,
    seen: RefCell<Vec<DType>>,
}

#[custom_fwd]
impl GatedProjection {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = x.matmul(&self.w)?; // lower-precision class
        self.seen.borrow_mut().push(h.dtype());
        Ok(h.sigmoid()?.mul(&h)?)
    }
}

/// A user op that wants f32 inputs whatever the caller runs in (PyTorch's
/// `custom_fwd(cast_inputs=torch.float32)`): its body is plain typed code.
struct StableLogSumExp {
    dim: usize,
}

#[custom_fwd(cast_inputs = f32)]
impl StableLogSumExp {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        x.log_sum_exp(self.dim) // a Tensor<F32> method: would not compile on a half input
    }
}

/// The same as a free function.
#[custom_fwd(cast_inputs = f32)]
fn l2_normalize(x: &Tensor<F32>) -> Result<Tensor<F32>> {
    let norm = x.sqr()?.sum_keepdim(1)?.sqrt()?;
    x.broadcast_div(&norm)
}

struct Model {
    gate: GatedProjection,
    lse: StableLogSumExp,
}

#[autocast(fp16)]
impl Model {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = self.gate.forward(&x)?;
        assert_eq!(h.dtype(), DType::F16);
        let n = l2_normalize(&h)?; // region value in, f32 out
        assert_eq!(n.dtype(), DType::F32);
        Ok(self.lse.forward(&h)?)
    }
}

#[autocast(bf16)]
fn gate_bf16(gate: &GatedProjection, x: &Tensor<F32>) -> Result<Tensor<F32>> {
    Ok(gate.forward(&x)?)
}

#[test]
fn custom_fwd_ops_follow_the_caller_or_cast_their_inputs() -> Result<()> {
    let w = Tensor::<F32>::randn(0.0, 0.5, (4, 4), &dev())?;
    let model = Model {
        gate: GatedProjection {
            w,
            seen: RefCell::default(),
        },
        lse: StableLogSumExp { dim: 1 },
    };
    let x = Tensor::<F32>::randn(0.0, 1.0, (3, 4), &dev())?;
    let y = model.forward(&x)?;
    assert_eq!(y.dims(), &[3]);
    assert_eq!(*model.gate.seen.borrow(), [DType::F16]);
    gate_bf16(&model.gate, &x)?;
    // Outside any region the op is plain f32 code.
    model.gate.forward(&x)?;
    assert_eq!(
        *model.gate.seen.borrow(),
        [DType::F16, DType::BF16, DType::F32]
    );

    // cast_inputs: a half input is cast to f32, and the result matches the f32 computation on
    // the same (rounded) values exactly.
    let x16 = x.cast::<F16>()?;
    let direct = l2_normalize(&x16)?.to_vec2::<f32>()?;
    let reference = l2_normalize(&x16.cast::<F32>()?)?.to_vec2::<f32>()?;
    assert_eq!(direct, reference);
    let bf = StableLogSumExp { dim: 1 }.forward(&x.cast::<F32>()?)?;
    assert_eq!(bf.dtype(), DType::F32);
    Ok(())
}

// ---- custom_bwd: a backward that computes in f32 for accuracy. ----

/// `y = x^3`, forward in the input's dtype; backward `3 x^2 g` computed in f32.
macro_rules! cube_op {
    ($name:ident, $($bwd_attr:meta)?) => {
        struct $name;

        impl CustomOp1 for $name {
            fn name(&self) -> &'static str {
                "cube"
            }

            fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
                let (start, end) = layout.contiguous_offsets().expect("contiguous input");
                let out = match storage {
                    CpuStorage::F16(v) => CpuStorage::F16(v[start..end].iter().map(|x| x * x * x).collect()),
                    CpuStorage::F32(v) => CpuStorage::F32(v[start..end].iter().map(|x| x * x * x).collect()),
                    _ => candle_core::bail!("cube: f16 or f32"),
                };
                Ok((out, layout.shape().clone()))
            }

            $(#[$bwd_attr])?
            fn bwd(&self, arg: &candle_core::Tensor, res: &candle_core::Tensor, grad_res: &candle_core::Tensor) -> Result<Option<candle_core::Tensor>> {
                let _ = res;
                let x = arg.to_dtype(DType::F32)?;
                let g = grad_res.to_dtype(DType::F32)?;
                // Returned in f32 whatever the input's dtype: the bug class #[custom_bwd] removes.
                Ok(Some(((x.sqr()? * 3.0)? * g)?))
            }
        }
    };
}

cube_op!(CubePlain,);
cube_op!(CubeAmp, custom_bwd);

#[test]
fn custom_bwd_returns_gradients_in_the_inputs_dtype() -> Result<()> {
    let x =
        candle_core::Var::from_tensor(&candle_core::Tensor::new(&[1.0f32, -2.0, 0.5], &dev())?)?;
    let run = |op: &dyn Fn(&candle_core::Tensor) -> Result<candle_core::Tensor>| -> Result<candle_core::Tensor> {
        let y = op(&x.to_dtype(DType::F16)?)?;
        let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
        Ok(grads.get(&x).expect("gradient of x").clone())
    };
    // Without #[custom_bwd], candle receives an f32 gradient for an f16 input and fails.
    let plain = run(&|t| t.apply_op1(CubePlain));
    let err = plain
        .expect_err("an f32 gradient for an f16 input")
        .to_string();
    assert!(err.contains("dtype mismatch"), "{err}");
    // With it, the gradient is cast back to f16 and reaches the f32 master: 3 x^2.
    let g = run(&|t| t.apply_op1(CubeAmp))?.to_vec1::<f32>()?;
    assert_eq!(g, vec![3.0, 12.0, 0.75]);
    Ok(())
}

#[test]
fn custom_fwd_ops_sit_in_models_built_from_layers() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let fc = nn::linear(4, 4, vb)?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 4), &dev())?;
    let gate = GatedProjection {
        w: Tensor::from_candle(fc.weight().as_tensor().clone())?,
        seen: RefCell::default(),
    };
    let y = gate_bf16(&gate, &x)?;
    let grads = y.sum_all()?.as_candle().backward()?;
    // The op's weight is a master Var: its gradient arrives in f32 through the bf16 region.
    assert_eq!(
        grads.get(fc.weight()).expect("gradient").dtype(),
        DType::F32
    );
    Ok(())
}

// ---- custom_bwd: gradients that are absent or of the wrong shape. ----

/// `y = x` (a copy); the backward returns `None` (`Absent`) or a gradient summed to one value
/// (`Summed`, the wrong shape).
macro_rules! copy_op {
    ($name:ident, |$grad:ident| $bwd:expr) => {
        struct $name;

        impl CustomOp1 for $name {
            fn name(&self) -> &'static str {
                stringify!($name)
            }

            fn cpu_fwd(
                &self,
                storage: &CpuStorage,
                layout: &Layout,
            ) -> Result<(CpuStorage, Shape)> {
                let (start, end) = layout.contiguous_offsets().expect("contiguous input");
                let CpuStorage::F32(v) = storage else {
                    candle_core::bail!("copy: f32")
                };
                Ok((
                    CpuStorage::F32(v[start..end].to_vec()),
                    layout.shape().clone(),
                ))
            }

            #[custom_bwd]
            fn bwd(
                &self,
                _arg: &candle_core::Tensor,
                _res: &candle_core::Tensor,
                $grad: &candle_core::Tensor,
            ) -> Result<Option<candle_core::Tensor>> {
                $bwd
            }
        }
    };
}

copy_op!(Absent, |_grad| Ok(None));
copy_op!(Summed, |grad| Ok(Some(grad.sum_all()?)));

/// A `None` gradient for an input another op computed made candle's backward panic ("grad not
/// populated"): it is zeros now, so the variable before that op gets a zero gradient (PyTorch
/// leaves it `None`). A gradient of the wrong shape is an error naming `#[custom_bwd]` and both
/// shapes, where candle's named its own `add`.
#[test]
fn custom_bwd_absent_and_misshapen_gradients() -> Result<()> {
    let x = candle_core::Var::new(&[1f32, 2.0], &dev())?;
    let y = (x.as_tensor() * 2.0)?.apply_op1(Absent)?;
    let grads = y.sum_all()?.backward()?;
    let g = grads.get(&x).expect("a zero gradient").to_vec1::<f32>()?;
    assert_eq!(g, [0.0, 0.0]);
    let y = (x.as_tensor() * 2.0)?.apply_op1(Summed)?;
    let err = y
        .sum_all()?
        .backward()
        .expect_err("a gradient of shape []")
        .to_string();
    assert!(
        err.contains("#[custom_bwd]: a returned gradient has shape []"),
        "{err}"
    );
    Ok(())
}

/// `cast_inputs` casts floating tensors only, as PyTorch's `custom_fwd` (which leaves int64 ids
/// alone): a parameter declared as candle's tensor (token ids) enters as it is, in the fn form
/// and the impl form. It was retyped and cast like a typed input, and the body's
/// `index_select(ids, 0)` failed to compile on a `Tensor<F32>`.
#[custom_fwd(cast_inputs = f32)]
fn pick_rows(x: &Tensor<F32>, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
    x.index_select(ids, 0)
}

struct Picker {
    dim: usize,
}

#[custom_fwd(cast_inputs = f32)]
impl Picker {
    fn forward(&self, x: &Tensor<F32>, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
        assert_eq!(ids.dtype(), DType::U32, "the ids are not cast");
        x.index_select(ids, self.dim)
    }
}

#[autocast(bf16)]
fn pick_in_region(
    picker: &Picker,
    x: &Tensor<F32>,
    ids: &candle_core::Tensor,
) -> Result<(Tensor<F32>, Tensor<F32>)> {
    let h = x.matmul(&x.t()?)?;
    assert_eq!(h.dtype(), DType::BF16);
    Ok((pick_rows(&h, ids)?, picker.forward(&h, ids)?))
}

#[test]
fn cast_inputs_leaves_candle_tensor_parameters_alone() -> Result<()> {
    let x = Tensor::<F32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], (2, 2), &Device::Cpu)?;
    let ids = candle_core::Tensor::new(&[1u32, 0], &Device::Cpu)?;
    let (a, b) = pick_in_region(&Picker { dim: 0 }, &x, &ids)?;
    // x x^T = [[5, 11], [11, 25]] (exact in bf16), rows 1 and 0.
    let want = [[11.0, 25.0], [5.0, 11.0]];
    assert_eq!(a.as_candle().to_vec2::<f32>()?, want);
    assert_eq!(b.as_candle().to_vec2::<f32>()?, want);
    Ok(())
}

/// `cast_inputs` on the impl form casts an optional tensor and a slice of tensors too, as
/// PyTorch's casts tensors inside its arguments and passes `None` through. The region's values
/// given as `Some(&h)` and `&[h]` failed to compile inside the generated call. A method that is
/// not a module call (`scaled`) casts its tensors as the fn form does: it took none.
struct Biased {
    seen: RefCell<Vec<DType>>,
}

#[custom_fwd(cast_inputs = f32)]
impl Biased {
    fn forward(
        &self,
        x: &Tensor<F32>,
        bias: Option<&Tensor<F32>>,
        extra: &[Tensor<F32>],
    ) -> Result<Tensor<F32>> {
        let mut y = x.clone();
        for t in bias.into_iter().chain(extra) {
            self.seen.borrow_mut().push(t.as_candle().dtype());
            y = y.add(t)?;
        }
        Ok(y)
    }

    /// Not a module call: its tensors are cast as a fn's are.
    fn scaled(&self, x: &Tensor<F32>, by: f64) -> Result<Tensor<F32>> {
        self.seen.borrow_mut().push(x.as_candle().dtype());
        x.affine(by, 0.0)
    }
}

#[autocast(bf16)]
fn call_biased(m: &Biased, x: &Tensor<F32>) -> Result<(Tensor<F32>, Tensor<F32>, Tensor<F32>)> {
    let h = x.matmul(x)?; // bf16
    Ok((
        m.forward(&h, Some(&h), &[h.clone(), h.clone()])?,
        m.forward(&h, None, &[])?,
        m.scaled(&h, 0.5)?,
    ))
}

#[test]
fn cast_inputs_casts_optional_and_slice_parameters_of_the_impl_form() -> Result<()> {
    let x = Tensor::<F32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], (2, 2), &dev())?;
    let m = Biased {
        seen: RefCell::new(Vec::new()),
    };
    let (out, rep) = candle_amp::report::record(|| call_biased(&m, &x));
    let (four, one, half) = out?;
    // Each tensor cast is reported at the method's name: x, the bias and the slice's two
    // tensors, then x; and `scaled`'s x at its own.
    let at = |function: &str| {
        let entry = rep
            .entries
            .iter()
            .find(|e| e.op == "cast_inputs" && e.site.is_some_and(|s| s.function == function));
        entry.map(|e| (e.calls, e.casts))
    };
    assert_eq!(at("Biased::forward"), Some((5, 5)), "{rep}");
    assert_eq!(at("Biased::scaled"), Some((1, 1)), "{rep}");
    // x x by hand: [[7, 10], [15, 22]] (exact in bf16); four times it, it alone, half of it.
    assert_eq!(four.to_vec2::<f32>()?, [[28.0, 40.0], [60.0, 88.0]]);
    assert_eq!(one.to_vec2::<f32>()?, [[7.0, 10.0], [15.0, 22.0]]);
    assert_eq!(half.to_vec2::<f32>()?, [[3.5, 5.0], [7.5, 11.0]]);
    assert_eq!(*m.seen.borrow(), [DType::F32; 4]);
    // Plain code calls the method as written.
    let y = m.forward(&x, Some(&x), &[])?;
    assert_eq!(y.to_vec2::<f32>()?, [[2.0, 4.0], [6.0, 8.0]]);
    Ok(())
}
