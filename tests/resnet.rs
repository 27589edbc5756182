//! The ResNet of `examples/resnet.rs` at a tiny size: trained end to end, every parameter gets
//! a finite gradient (in f32 and under bf16 autocast); with the backbone frozen, only the head
//! does and the backbone gets none.

#[path = "../examples/models/resnet.rs"]
#[allow(dead_code)] // the example uses the rest
mod resnet;

use candle_amp::nn::loss;
use candle_amp::{autocast, Policy, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use resnet::{Depth, ResNet};

mod common;

#[autocast(policy = Pol, enabled = amp)]
fn logits<Pol: Policy>(
    model: &ResNet,
    x: &Tensor<F32>,
    frozen: bool,
    amp: bool,
) -> Result<Tensor<F32>> {
    model.forward(x, true, frozen)
}

/// `(name, finite)` for the variables that got a gradient, and the names of those that did not.
type Gradients = (Vec<(String, bool)>, Vec<String>);

/// Gradients of every variable after one cross-entropy backward.
fn gradients(depth: Depth, frozen: bool, amp: bool, dev: &Device) -> Result<Gradients> {
    let vars = VarMap::new();
    let model = ResNet::new(depth, 3, &VarBuilder::from_varmap(&vars, DType::F32, dev))?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 3, 8, 8), dev)?;
    let y = candle_core::Tensor::new(&[0u32, 2], dev)?;
    let l = loss::cross_entropy(
        &logits::<candle_amp::Bf16Policy>(&model, &x, frozen, amp)?,
        &y,
    )?;
    let grads = l.as_candle().backward()?;
    let data = vars.data().lock().unwrap();
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for (name, var) in data.iter() {
        match grads.get(var) {
            Some(g) => {
                let finite = g
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .all(|v| v.is_finite());
                with.push((name.clone(), finite));
            }
            None => without.push(name.clone()),
        }
    }
    Ok((with, without))
}

/// The parameters batch norm's running statistics are not: the trainable ones.
fn trainable(name: &str) -> bool {
    !name.ends_with("running_mean") && !name.ends_with("running_var")
}

fn every_trainable_parameter_gets_a_finite_gradient_in_f32_and_bf16(dev: &Device) -> Result<()> {
    for depth in [Depth::R18, Depth::R50] {
        for amp in [false, true] {
            let (with, without) = gradients(depth, false, amp, dev)?;
            let missing: Vec<_> = without.iter().filter(|n| trainable(n)).collect();
            assert!(
                missing.is_empty(),
                "{depth:?} amp={amp}: no gradient for {missing:?}"
            );
            let bad: Vec<_> = with.iter().filter(|(_, finite)| !finite).collect();
            assert!(bad.is_empty(), "{depth:?} amp={amp}: non-finite {bad:?}");
            assert!(with
                .iter()
                .any(|(n, _)| n == "layer4.0.downsample.0.weight"));
        }
    }
    Ok(())
}

test_device!(
    every_trainable_parameter_gets_a_finite_gradient_in_f32_and_bf16,
    finite_gradients_cpu,
    finite_gradients_cuda
);

#[test]
fn a_frozen_backbone_gets_no_gradient_and_the_head_trains() -> Result<()> {
    let (with, _) = gradients(Depth::R18, true, true, &Device::Cpu)?;
    let mut names: Vec<_> = with.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["fc.bias", "fc.weight"]);
    assert!(with.iter().all(|(_, finite)| *finite));
    Ok(())
}

/// `--weights`: a backbone saved under torchvision's names loads into a fresh model, the head
/// stays new; a file without those names is an error.
#[test]
fn a_saved_backbone_loads_by_name_and_the_head_stays_new() -> Result<()> {
    let dev = Device::Cpu;
    let (saved, fresh) = (VarMap::new(), VarMap::new());
    ResNet::new(
        Depth::R18,
        10,
        &VarBuilder::from_varmap(&saved, DType::F32, &dev),
    )?;
    ResNet::new(
        Depth::R18,
        3,
        &VarBuilder::from_varmap(&fresh, DType::F32, &dev),
    )?;
    let path = std::env::temp_dir().join(format!(
        "candle-amp-resnet-{}.safetensors",
        std::process::id()
    ));
    saved.save(&path)?;
    let loaded = resnet::load_backbone(&fresh, &path, &dev);
    std::fs::remove_file(&path).ok();
    let (s, f) = (saved.data().lock().unwrap(), fresh.data().lock().unwrap());
    assert_eq!(
        loaded?,
        s.len() - 2,
        "every backbone tensor, not fc.weight and fc.bias"
    );
    let same = |name: &str| -> Result<bool> {
        let diff = (s[name].as_tensor() - f[name].as_tensor())?
            .abs()?
            .sum_all()?
            .to_scalar::<f32>()?;
        Ok(diff == 0.0)
    };
    assert!(same("layer3.1.conv2.weight")? && same("bn1.running_var")?);
    assert_eq!(
        f["fc.weight"].dims(),
        [3, 512],
        "the new head keeps its own shape"
    );
    drop((s, f));
    let empty = std::env::temp_dir().join(format!(
        "candle-amp-empty-{}.safetensors",
        std::process::id()
    ));
    candle_core::safetensors::save(
        &std::collections::HashMap::from([(
            "x".to_string(),
            candle_core::Tensor::zeros(1, DType::F32, &dev)?,
        )]),
        &empty,
    )?;
    let err = resnet::load_backbone(&fresh, &empty, &dev);
    std::fs::remove_file(&empty).ok();
    assert!(err.unwrap_err().to_string().contains("no backbone tensor"));
    Ok(())
}
