//! The model of the `quantized_sine` example (the ROCm blog's 1x1-conv net), shared with
//! `tests/report.rs`, which checks its precision report.

use candle_amp::nn;
use candle_amp::{autocast, Policy, Tensor, F32};
use candle_core::Result;
use candle_nn::VarBuilder;

/// Conv(2, h) + BN + ReLU, two hidden Conv(h, h) + BN + ReLU, Conv(h, 1): all 1x1. Each conv,
/// the batch norm and the ReLU after it are one `ConvBnReLU2d`: the same layers and variables,
/// the conv's output normalised before it is rounded to the region's precision.
pub struct Model {
    blocks: Vec<nn::ConvBnReLU2d>,
    head: nn::Conv2d,
}

impl Model {
    pub fn new(hidden: usize, vb: &VarBuilder) -> Result<Self> {
        let cfg = nn::Conv2dConfig::default();
        let widths = [2, hidden, hidden, hidden, 1];
        let conv =
            |i: usize| nn::conv2d(widths[i], widths[i + 1], 1, cfg, vb.pp(format!("conv{i}")));
        let blocks = (0..3)
            .map(|i| {
                nn::ConvBnReLU2d::new(
                    conv(i)?,
                    nn::batch_norm2d(hidden, 1e-5, vb.pp(format!("bn{i}")))?,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            blocks,
            head: conv(3)?,
        })
    }

    /// The forward pass; `amp` switches autocast under the policy `Pol` on (`Bf16Policy`:
    /// bf16, `Fp16Policy`: f16), nothing else changes.
    #[autocast(policy = Pol, enabled = amp)]
    pub fn forward<Pol: Policy>(
        &self,
        x: &Tensor<F32>,
        train: bool,
        amp: bool,
    ) -> Result<Tensor<F32>> {
        let mut h = x.clone();
        for block in &self.blocks {
            h = block.forward_t(&h, train)?;
        }
        self.head.forward(&h)
    }
}
