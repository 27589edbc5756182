//! The precision report and the overflow locator: sites are the user's lines, classes and
//! dtypes are the policy's, and the first inf is pinned to the op that made it.

use candle_amp::nn::{self, loss};
use candle_amp::report::{self, PrecisionReport};
use candle_amp::{autocast, ops, GradScaler, RegionValue, Tensor, F16, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};

fn dev() -> Device {
    Device::Cpu
}

/// The finite check is process-wide: the tests that turn it on and off take turns.
static CHECK_FINITE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The 1-based line of this file holding `marker`.
fn line_of(marker: &str) -> u32 {
    let src = include_str!("report.rs");
    let line = src
        .lines()
        .position(|l| l.contains(marker) && !l.contains("line_of("))
        .expect("marker in this file");
    u32::try_from(line + 1).unwrap()
}

struct Mlp {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

#[autocast(fp16)]
impl Mlp {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = self.fc1.forward(x)?.relu()?; // site: fc1
        let s = ops::softmax(&h, 1)?; // site: softmax
        Ok(self.fc2.forward(&(s * 1000.0)?)?) // site: fc2
    }
}

fn mlp(vb: &VarBuilder) -> Result<Mlp> {
    Ok(Mlp {
        fc1: nn::linear(8, 16, vb.pp("fc1"))?,
        fc2: nn::linear(16, 4, vb.pp("fc2"))?,
    })
}

#[test]
fn the_report_names_each_op_site_with_its_class_and_dtypes() -> Result<()> {
    let map = VarMap::new();
    let model = mlp(&VarBuilder::from_varmap(&map, DType::F32, &dev()))?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (4, 8), &dev())?;
    let ((), rep): ((), PrecisionReport) = report::record(|| {
        for _ in 0..3 {
            model.forward(&x).unwrap();
        }
    });
    let linears: Vec<_> = rep.op("linear").collect();
    assert_eq!(linears.len(), 2, "{rep}");
    let sites: Vec<u32> = linears.iter().map(|e| e.site.unwrap().line).collect();
    assert_eq!(
        sites,
        [line_of("// site: fc1"), line_of("// site: fc2")],
        "{rep}"
    );
    for e in &linears {
        assert_eq!((e.output, e.calls), (DType::F16, 3), "{rep}");
        assert_eq!(e.site.unwrap().function, "Mlp::forward");
        assert!(e.site.unwrap().file.ends_with("report.rs"));
    }
    // fc1 takes the f32 input: one input cast plus the layer's weight and bias, per call.
    assert_eq!(linears[0].inputs, [DType::F32]);
    assert_eq!(linears[0].casts, 3 * 3, "{rep}");
    let softmax = rep.op("softmax").next().expect("softmax reported");
    assert_eq!(
        (softmax.output, softmax.inputs.as_slice()),
        (DType::F32, &[DType::F16][..])
    );
    assert_eq!(softmax.site.unwrap().line, line_of("// site: softmax"));
    // The fused softmax widens its f16 input while reading it: no f32 copy, no cast.
    assert_eq!(softmax.casts, 0, "{rep}");
    let table = rep.to_string();
    assert!(
        table.contains("Mlp::forward") && table.contains("softmax") && table.contains("lower"),
        "{table}"
    );
    // Not recording: nothing is kept.
    let ((), empty) = report::record(|| ());
    assert!(empty.entries.is_empty());
    Ok(())
}

/// A layer whose fp16 activations pass 65504 on one line.
struct Planted {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

#[autocast(fp16)]
impl Planted {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = self.fc1.forward(x)?.relu()?;
        let big = h.matmul(&h.t()?)?; // planted overflow
        let h = (big.sum_keepdim(1)? * 0.0)?.broadcast_add(&h)?;
        Ok(self.fc2.forward(&h)?)
    }
}

#[test]
fn the_locator_names_the_line_and_op_of_a_planted_overflow_and_the_params_it_reached() -> Result<()>
{
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &dev());
    let model = Planted {
        fc1: nn::linear(8, 64, vb.pp("fc1"))?,
        fc2: nn::linear(64, 4, vb.pp("fc2"))?,
    };
    // Inputs large enough that h h^T passes 65504 in f16, while h itself stays finite.
    let x = (Tensor::<F32>::ones((4, 8), &dev())? * 100.0)?;
    let y = Tensor::<F32>::zeros((4, 4), &dev())?;
    let _check = CHECK_FINITE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    report::set_check_finite(true);
    report::take_first_nonfinite();
    let mut opt = <candle_nn::SGD as candle_nn::Optimizer>::new(map.all_vars(), 0.1)?;
    let mut scaler = GradScaler::new();
    let l = loss::mse(&model.forward(&x)?, &y)?;
    let outcome = scaler.step(&mut opt, scaler.scale(l.as_candle())?.backward()?)?;
    scaler.update()?;
    report::set_check_finite(false);
    assert!(outcome.is_skipped());
    let found = report::take_first_nonfinite().expect("an overflow located");
    let site = found.site.expect("a site");
    assert_eq!(
        (site.line, found.op, found.dtype),
        (line_of("// planted overflow"), "matmul", DType::F16),
        "{found}"
    );
    assert!(found.input_absmax.is_finite() && found.input_absmax > 0.0);
    let names = scaler.nonfinite_params(&map);
    assert!(!names.is_empty(), "some gradient was non-finite");
    assert!(names.iter().all(|n| n.starts_with("fc")), "{names:?}");
    Ok(())
}

/// `x x^T` in an fp16 region, the scores of an attention without its `1/sqrt(d)`.
#[autocast(fp16)]
fn gram(x: &Tensor<F32>) -> Result<Tensor<F32>> {
    Ok(x.matmul(&x.t()?)?) // gram overflow
}

/// The locator's largest finite output is that of the values that stayed finite, and says so
/// when none did (it read 0 there).
#[test]
fn the_locator_reports_the_largest_finite_output_or_that_there_was_none() -> Result<()> {
    let _check = CHECK_FINITE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut found = Vec::new();
    // Rows (300, 300) and (1, 1): x x^T = [[180000, 600], [600, 2]], 180000 past f16's 65504.
    // Then every row (300, 300): all four products overflow.
    for rows in [[300f32, 300.0, 1.0, 1.0], [300.0; 4]] {
        let x = Tensor::<F32>::from_vec(rows.to_vec(), (2, 2), &dev())?;
        report::set_check_finite(true);
        report::take_first_nonfinite();
        let y = gram(&x);
        report::set_check_finite(false);
        y?;
        found.push(report::take_first_nonfinite().expect("an overflow located"));
    }
    assert_eq!(
        found[0].site.map(|s| s.line),
        Some(line_of("// gram overflow"))
    );
    assert_eq!(
        found[0].output_absmax.map(f64::to_bits),
        Some(600f64.to_bits())
    );
    assert!(
        found[0].to_string().contains("largest finite output 6e2"),
        "{}",
        found[0]
    );
    assert_eq!(found[1].output_absmax, None);
    assert!(
        found[1].to_string().contains("no finite output"),
        "{}",
        found[1]
    );
    assert_eq!(found[1].input_absmax.to_bits(), 300f64.to_bits());
    Ok(())
}

#[path = "../examples/models/sine.rs"]
mod sine;

/// The `quantized_sine` model's report of one bf16 training step: each conv + batch norm +
/// ReLU (`ConvBnReLU2d`, no separate ReLU) and the last conv run in bf16 (lower precision: the
/// batch norm computes in f32 inside and rounds once), with the casts the step needs: the
/// input once, each conv's weight and bias once.
#[test]
fn the_quantized_sine_report_lists_convs_in_bf16_and_casts_per_step() -> Result<()> {
    let map = VarMap::new();
    let model = sine::Model::new(8, &VarBuilder::from_varmap(&map, DType::F32, &dev()))?;
    let x = Tensor::<F32>::rand(0.0, 1.0, (1, 2, 6, 6), &dev())?;
    let target = Tensor::<F32>::rand(0.0, 1.0, (1, 1, 6, 6), &dev())?;
    let (grads, rep) = report::record(|| -> Result<_> {
        let y = model.forward::<candle_amp::Bf16Policy>(&x, true, true)?;
        loss::mse(&y, &target)?.as_candle().backward()
    });
    grads?;
    assert_eq!(rep.op("relu").count(), 0, "{rep}");
    for (op, calls) in [("conv_bn_relu2d", 3), ("conv2d", 1)] {
        let sites: Vec<_> = rep.op(op).collect();
        assert_eq!(
            sites.iter().map(|e| e.calls).sum::<u64>(),
            calls,
            "{op}\n{rep}"
        );
        assert!(
            sites
                .iter()
                .all(|e| e.output == DType::BF16 && e.class == candle_amp::OpClass::LowerPrecision),
            "{rep}"
        );
    }
    // 1 input cast + 4 weights + 4 biases.
    assert_eq!(rep.casts().0, 9, "{rep}");
    // The same step with autocast off: every op in f32, no cast.
    let (_, off) = report::record(|| model.forward::<candle_amp::Bf16Policy>(&x, true, false));
    assert_eq!(off.casts().0, 0, "{off}");
    assert!(off.entries.iter().all(|e| e.output == DType::F32), "{off}");
    Ok(())
}

#[path = "../examples/overflow.rs"]
#[allow(dead_code)] // its `main` and flags
mod overflow_example;

/// `examples/overflow.rs --json` names the line of its `// planted overflow` comment.
#[test]
fn the_overflow_example_names_its_planted_line_in_json() -> Result<()> {
    let _check = CHECK_FINITE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let run = overflow_example::train(3, false)?;
    let json = run.json();
    let src = include_str!("../examples/overflow.rs");
    let planted = src
        .lines()
        .position(|l| l.trim_end().ends_with("// planted overflow"))
        .expect("the marker");
    let first = &json["first_nonfinite"];
    assert_eq!(first["line"], planted + 1, "{json}");
    assert!(
        first["file"]
            .as_str()
            .unwrap()
            .ends_with("examples/overflow.rs"),
        "{json}"
    );
    assert_eq!(
        (first["op"].as_str(), first["dtype"].as_str()),
        (Some("matmul"), Some("f16"))
    );
    assert_eq!(json["skipped_steps"], 3);
    assert!(
        !json["nonfinite_grads"].as_array().unwrap().is_empty(),
        "{json}"
    );
    Ok(())
}

#[autocast(bf16)]
fn spread_over_lines(a: &Tensor<F32>, layer: &nn::Linear) -> Result<Tensor<F32>> {
    let h = a.matmul(&a.t()?)?;
    let halves = ops::softmax(
        &(&h / 2.0)?, // site: div
        1,
    )?;
    let through = ops::softmax(
        &h.apply(layer)?, // site: apply
        1,
    )?;
    let n = [0u8; 2 * 2].len() + 1; // constant expressions stay as they are
    assert_eq!(n, 5);
    Ok((halves.sum_all()? + through.sum_all()?)?)
}

/// An operator and a `.apply(&layer)` written on their own lines inside another call's
/// arguments are reported on their lines, not on the enclosing call's.
#[test]
fn operators_and_apply_are_reported_on_their_own_lines() -> Result<()> {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &dev());
    let layer = nn::linear(4, 3, vb.pp("l"))?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (4, 4), &dev())?;
    let (y, rep) = report::record(|| spread_over_lines(&x, &layer));
    y?;
    let line = |op: &str| rep.op(op).next().and_then(|e| e.site).map(|s| s.line);
    assert_eq!(line("affine"), Some(line_of("// site: div")), "{rep}");
    assert_eq!(line("linear"), Some(line_of("// site: apply")), "{rep}");
    Ok(())
}

/// A helper region without a policy of its own: it runs under its caller's.
#[autocast]
fn shared_product(x: &Tensor<F32>) -> Result<Tensor<F32>> {
    Ok(x.matmul(x)?) // shared site
}

#[autocast(fp16)]
fn from_fp16(x: &Tensor<F32>) -> Result<Tensor<F32>> {
    shared_product(x)
}

#[autocast(bf16)]
fn from_bf16(x: &Tensor<F32>) -> Result<Tensor<F32>> {
    shared_product(x)
}

/// One site that runs under an fp16 and then a bf16 region is two entries, each with its own
/// dtypes and calls (it was one `(F16, calls: 2)` entry, the bf16 calls counted as f16).
#[test]
fn a_site_run_under_two_policies_is_two_entries() -> Result<()> {
    let x = Tensor::<F32>::ones((2, 2), &dev())?;
    let ((), rep) = report::record(|| {
        from_fp16(&x).unwrap();
        from_bf16(&x).unwrap();
        from_bf16(&x).unwrap();
    });
    let mut seen: Vec<(DType, u64)> = rep
        .op("matmul")
        .filter(|e| e.site.is_some_and(|s| s.line == line_of("// shared site")))
        .map(|e| (e.output, e.calls))
        .collect();
    seen.sort_by_key(|&(d, _)| d.as_str());
    assert_eq!(seen, [(DType::BF16, 2), (DType::F16, 1)], "{rep}");
    Ok(())
}

#[autocast(bf16)]
fn f64_product(a: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    a.matmul(a)
}

/// An f64 result past f32's range is finite: the locator reads values in f64 (it read them as
/// f32, took 1e40 for an overflow and said "f64 tops out at 3.4e38").
#[test]
fn the_locator_takes_f64_values_as_f64() -> Result<()> {
    let _check = CHECK_FINITE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let a = candle_core::Tensor::new(&[[1e20f64]], &dev())?;
    report::set_check_finite(true);
    report::take_first_nonfinite();
    let y = f64_product(&a);
    let found = report::take_first_nonfinite();
    report::set_check_finite(false);
    assert_eq!(y?.to_vec2::<f64>()?, [[1e40]]);
    assert!(found.is_none(), "{found:?}");
    Ok(())
}

/// A `cast_inputs` op's body runs with autocast off; its input casts are what autocast did
/// there. They were missing from the report, and an input that the cast made `inf` went past
/// the locator.
#[candle_amp::custom_fwd(cast_inputs = f16)]
fn half_scores(x: &Tensor<F16>) -> Result<Tensor<F16>> {
    // The line above holds the op's name.
    x.affine(0.5, 0.0)
}

#[autocast(bf16)]
fn through_half_scores(x: &Tensor<F32>) -> Result<Tensor<F32>> {
    let h = x.matmul(x)?; // bf16
    Ok(half_scores(&h)?.cast::<F32>()?)
}

#[test]
fn cast_inputs_casts_are_reported_and_checked_at_the_op_s_name() -> Result<()> {
    let _check = CHECK_FINITE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // x x = [[7, 10], [15, 22]]: exact in bf16 and f16.
    let x = Tensor::<F32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], (2, 2), &dev())?;
    let (y, rep) = report::record(|| through_half_scores(&x));
    assert_eq!(y?.to_vec2::<f32>()?, [[3.5, 5.0], [7.5, 11.0]]);
    let cast = rep.op("cast_inputs").next().expect("cast_inputs reported");
    let site = cast.site.expect("at the op's name");
    assert_eq!(
        (site.line, site.function),
        (
            line_of("// The line above holds the op's name.") - 1,
            "half_scores"
        )
    );
    assert_eq!(
        (&cast.inputs[..], cast.output, cast.calls, cast.casts),
        (&[DType::BF16][..], DType::F16, 1, 1)
    );
    // 1e5 (exact in bf16 as 99840) is past f16's 65504: the cast makes it inf.
    let big = Tensor::<F32>::from_vec(vec![1e5f32], (1, 1), &dev())?;
    report::set_check_finite(true);
    report::take_first_nonfinite();
    let y = half_scores(&big);
    report::set_check_finite(false);
    assert!(y?.to_vec2::<f32>()?[0][0].is_infinite());
    let found = report::take_first_nonfinite().expect("the cast located");
    assert_eq!((found.op, found.dtype), ("cast_inputs", DType::F16));
    assert_eq!(found.site.map(|s| s.function), Some("half_scores"));
    Ok(())
}

struct Left;
struct Right;

#[autocast(bf16)]
impl Left {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        Ok(x.matmul(x)?)
    }
}

#[autocast(bf16)]
impl Right {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let logits = x.matmul(x)?;
        Ok(loss::binary_cross_entropy_with_logits(&logits, x)?)
    }
}

mod enc {
    use super::{autocast, Result, Tensor, F32};
    pub struct Layer;
    #[autocast(bf16)]
    impl Layer {
        pub fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
            Ok(x.matmul(x)?)
        }
    }
}

mod dec {
    use super::{autocast, Result, Tensor, F32};
    pub struct Layer;
    #[autocast(bf16)]
    impl Layer {
        pub fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
            Ok(x.matmul(x)?)
        }
    }
}

/// A plain helper: its typed op follows the calling region and is reported without a site.
fn plain_exp(x: &Tensor<F32>) -> Result<Tensor<F32>> {
    x.exp()
}

#[autocast(bf16)]
fn calls_plain_exp(x: &Tensor<F32>) -> Result<Tensor<F32>> {
    plain_exp(&x.cast::<F32>()?)
}

/// The table's groups are functions as written (`Left::forward` and `Right::forward` in one
/// file were one `forward` group; `enc::Layer` and `dec::Layer` are told apart by their module),
/// its columns fit their longest value (a long op name shifted the row), and ops without a site
/// come under a plain heading (it was `  ((no site))`).
#[test]
fn the_table_groups_methods_by_type_and_aligns_its_columns() -> Result<()> {
    let x = Tensor::<F32>::from_vec(vec![0.5, 0.25, 0.125, 1.0], (2, 2), &dev())?;
    let ((), rep) = report::record(|| {
        Left.forward(&x).unwrap();
        Right.forward(&x).unwrap();
        calls_plain_exp(&x).unwrap();
        enc::Layer.forward(&x).unwrap();
        dec::Layer.forward(&x).unwrap();
    });
    let table = rep.to_string();
    let functions: Vec<_> = rep
        .entries
        .iter()
        .filter_map(|e| e.site.map(|s| s.function))
        .collect();
    assert!(
        functions.contains(&"Left::forward") && functions.contains(&"Right::forward"),
        "{table}"
    );
    assert!(
        table.contains("\nLeft::forward  (") && table.contains("\nRight::forward  ("),
        "{table}"
    );
    assert!(
        table.contains("\n(no site: ops outside #[autocast] code)\n"),
        "{table}"
    );
    assert!(!table.contains("((no site))"), "{table}");
    // Same-named types of two modules are two groups, named with their module.
    for group in ["\nenc::Layer::forward  (", "\ndec::Layer::forward  ("] {
        assert!(table.contains(group), "{table}");
    }
    // Every row's class starts where the header's `class` does.
    let header = table
        .lines()
        .find(|l| l.contains("line:col"))
        .expect("a header");
    let column = header.find("class").expect("a class column");
    let rows: Vec<_> = table
        .lines()
        .filter(|l| l.starts_with("  ") && !l.contains("line:col"))
        .collect();
    assert!(
        rows.iter()
            .any(|l| l.contains("binary_cross_entropy_with_logits")),
        "{table}"
    );
    for row in rows {
        let class = ["lower", "fp32", "promote", "preserve"]
            .iter()
            .filter_map(|c| row.find(&format!(" {c} ")))
            .min()
            .expect("a class");
        assert_eq!(class + 1, column, "{row}\n{table}");
    }
    Ok(())
}
