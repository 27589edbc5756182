//! ResNet 18, 34 and 50 from candle-amp layers, built as candle-transformers' `resnet.rs`
//! builds them (torchvision's structure and variable names: `conv1`, `bn1`,
//! `layer1.0.conv1`, .., `layer1.0.downsample.0`, `fc`), so that a backbone saved from one
//! loads into the other. Shared by `examples/resnet.rs` and `tests/resnet.rs`.
//!
//! The methods carry `#[autocast]` without a policy: they run under their caller's (the
//! training step's `#[autocast(policy = Pol, enabled = amp)]`), convolutions and the head in
//! the lower precision, batch norm on its input's precision with f32 statistics, the global
//! average pool (a mean) in f32.

use candle_amp::nn::{
    self, BatchNorm2d, Conv2d, Conv2dConfig, ConvBn2d, ConvBnReLU2d, Linear, MaxPool2d,
};
use candle_amp::{autocast, AmpTensor, Tensor, F32};
use candle_core::Result;
use candle_nn::VarBuilder;

/// Which ResNet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum Depth {
    #[value(name = "18")]
    R18,
    #[value(name = "34")]
    R34,
    #[value(name = "50")]
    R50,
}

impl Depth {
    /// Blocks per stage.
    fn blocks(self) -> [usize; 4] {
        match self {
            Self::R18 => [2, 2, 2, 2],
            Self::R34 | Self::R50 => [3, 4, 6, 3],
        }
    }

    fn bottleneck(self) -> bool {
        self == Self::R50
    }

    /// Channels of the backbone's output (the head's input).
    pub fn features(self) -> usize {
        if self.bottleneck() {
            2048
        } else {
            512
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::R18 => "ResNet-18",
            Self::R34 => "ResNet-34",
            Self::R50 => "ResNet-50",
        }
    }
}

/// A bias-free conv (`conv`) and the batch norm after it (`bn`), for one `ConvBn2d` or
/// `ConvBnReLU2d` (`pair(conv, bn)`): the variables are the two layers', under their names; on
/// CPU the conv's sums are normalised before they are rounded to the region's precision.
fn conv_bn<L>(
    (c_in, c_out, k, stride): (usize, usize, usize, usize),
    (conv, bn): (VarBuilder, VarBuilder),
    pair: impl FnOnce(Conv2d, BatchNorm2d) -> Result<L>,
) -> Result<L> {
    let cfg = Conv2dConfig {
        stride,
        padding: k / 2,
        ..Conv2dConfig::default()
    };
    pair(
        nn::conv2d_no_bias(c_in, c_out, k, cfg, conv)?,
        nn::batch_norm2d(c_out, 1e-5, bn)?,
    )
}

/// A basic block (two 3x3 convs) or a bottleneck (1x1, 3x3, 1x1 with 4x expansion), with a
/// 1x1 projection on the shortcut where the shape changes. Every conv but the last is followed
/// by a ReLU (one `ConvBnReLU2d`); the last one's comes after the shortcut is added.
struct Block {
    convs: Vec<ConvBnReLU2d>,
    last: ConvBn2d,
    downsample: Option<ConvBn2d>,
}

impl Block {
    fn new(
        depth: Depth,
        c_in: usize,
        planes: usize,
        stride: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (shapes, c_out): (Vec<(usize, usize, usize, usize)>, usize) = if depth.bottleneck() {
            let out = planes * 4;
            (
                vec![
                    (c_in, planes, 1, 1),
                    (planes, planes, 3, stride),
                    (planes, out, 1, 1),
                ],
                out,
            )
        } else {
            (
                vec![(c_in, planes, 3, stride), (planes, planes, 3, 1)],
                planes,
            )
        };
        let names = |i: usize| {
            (
                vb.pp(format!("conv{}", i + 1)),
                vb.pp(format!("bn{}", i + 1)),
            )
        };
        let last = shapes.len() - 1;
        let convs = (0..last)
            .map(|i| conv_bn(shapes[i], names(i), ConvBnReLU2d::new))
            .collect::<Result<_>>()?;
        let last = conv_bn(shapes[last], names(last), ConvBn2d::new)?;
        let downsample = if stride != 1 || c_in != c_out {
            let d = vb.pp("downsample");
            let shape = (c_in, c_out, 1, stride);
            Some(conv_bn(shape, (d.pp("0"), d.pp("1")), ConvBn2d::new)?)
        } else {
            None
        };
        Ok(Self {
            convs,
            last,
            downsample,
        })
    }
}

#[autocast]
impl Block {
    fn forward(&self, x: &Tensor<F32>, train: bool) -> Result<Tensor<F32>> {
        let mut h = x.clone();
        for conv_bn_relu in &self.convs {
            h = conv_bn_relu.forward_t(&h, train)?;
        }
        let h = self.last.forward_t(&h, train)?;
        let shortcut = match &self.downsample {
            Some(conv_bn) => conv_bn.forward_t(x, train)?,
            None => x.clone(),
        };
        Ok((h + shortcut)?.relu()?)
    }
}

/// The ResNet: a backbone (stem and four stages) and a linear head of `classes` outputs.
pub struct ResNet {
    stem: ConvBnReLU2d,
    pool: MaxPool2d,
    layers: Vec<Vec<Block>>,
    pub fc: Linear,
}

impl ResNet {
    pub fn new(depth: Depth, classes: usize, vb: &VarBuilder) -> Result<Self> {
        let mut c_in = 64;
        let layers = depth
            .blocks()
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let planes = 64 << i;
                let stage = vb.pp(format!("layer{}", i + 1));
                (0..n)
                    .map(|b| {
                        let stride = if b == 0 && i > 0 { 2 } else { 1 };
                        let block =
                            Block::new(depth, c_in, planes, stride, stage.pp(b.to_string()))?;
                        c_in = if depth.bottleneck() {
                            planes * 4
                        } else {
                            planes
                        };
                        Ok(block)
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            stem: conv_bn(
                (3, 64, 7, 2),
                (vb.pp("conv1"), vb.pp("bn1")),
                ConvBnReLU2d::new,
            )?,
            pool: MaxPool2d::with_stride(3, 2).with_padding(1),
            layers,
            fc: nn::linear(depth.features(), classes, vb.pp("fc"))?,
        })
    }
}

#[autocast]
impl ResNet {
    /// The backbone: `(batch, 3, h, w)` images to `(batch, features)`, globally average-pooled
    /// (a helper: it takes and returns region values, under its caller's policy).
    fn backbone(&self, x: &AmpTensor, train: bool) -> Result<AmpTensor> {
        let h = self.stem.forward_t(x, train)?;
        let mut h = self.pool.forward(&h)?;
        for stage in &self.layers {
            for block in stage {
                h = block.forward(&h, train)?;
            }
        }
        h.mean((2, 3))
    }

    /// Class logits. With `frozen`, the backbone runs in eval mode (running statistics) and is
    /// cut from the graph: only the head trains, and the backbone's parameters get no gradient.
    pub fn forward(&self, x: &Tensor<F32>, train: bool, frozen: bool) -> Result<Tensor<F32>> {
        let f = if frozen {
            self.backbone(x, false)?.detach()
        } else {
            self.backbone(x, train)?
        };
        Ok(self.fc.forward(&f)?)
    }
}

/// Sets every backbone variable that `path` holds under the same name and shape; the head
/// (`fc.*`) stays new. Returns how many were loaded; a shape mismatch is an error.
pub fn load_backbone(
    vars: &candle_nn::VarMap,
    path: &std::path::Path,
    dev: &candle_core::Device,
) -> Result<usize> {
    let tensors = candle_core::safetensors::load(path, dev)?;
    let data = vars
        .data()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut loaded = 0;
    for (name, var) in data.iter().filter(|(n, _)| !n.starts_with("fc.")) {
        if let Some(t) = tensors.get(name) {
            if t.dims() != var.dims() {
                candle_core::bail!(
                    "{name}: the file has {:?}, the model {:?}",
                    t.dims(),
                    var.dims()
                );
            }
            var.set(&t.to_dtype(candle_core::DType::F32)?)?;
            loaded += 1;
        }
    }
    if loaded == 0 {
        candle_core::bail!("{}: no backbone tensor under the model's names (conv1.weight, layer1.0.conv1.weight, ..)", path.display());
    }
    Ok(loaded)
}
