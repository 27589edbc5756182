//! Kernels: the CPU compute of the lower-precision ops, the half-precision paths candle 0.11
//! lacks, the fp32-class ops that read half inputs as they are, and the gradient scaler's fused
//! pass. This file is the map; each room is one topic, and a room uses only rooms above it in
//! this list (a test keeps it so).
//!
//! Foundations:
//! - `elem`: the element trait `Real` (f32, f16, bf16 read as f32, written rounded once) and
//!   `with_floats!`, the one dtype dispatch of the kernels.
//! - `layout`: what the kernels read of candle's layouts (contiguous runs, strided offsets).
//! - `simd` (x86-64): AVX-512 f32 <-> bf16/f16 conversions, bit-identical to `half`.
//! - `convert`: vectorised f32 <-> half conversions and the `to_dtype` op built on them.
//! - `parallel`: the pool every parallel kernel runs on (candle's own) and `Disjoint`, the one
//!   way tasks write disjoint parts of one buffer.
//! - `widen`: half values widened to f32 a block at a time (`map_widened`, `zip_map`, sums).
//! - `testing` (tests only): the error measures the kernels' tests use.
//! - `leaf_grads`: the variables' gradients ops hand to the scaler directly.
//! - `custom_grad`: a value computed by candle's ops with a gradient rule of its own.
//! - `borrow`: many storages borrowed at once for one pass.
//! - `channels`: per-channel geometry, affine pass and sums (batch norm, bias add).
//! - `cuda` (feature `cuda`): each op's CUDA launches beside its `.cu` source, and what they
//!   share (NVRTC compilation, addresses, launch geometry).
//!
//! Ops:
//! - `bias`: the layers' bias add, its gradient summed in f32.
//! - `gemm`: a packed, cache-blocked GEMM with f32 accumulation for f32, bf16 and f16.
//! - `matmul`: half `matmul`, `Linear` on f32 masters, and products off the CPU as one op.
//! - `conv`: convolutions on CPU as GEMMs (im2col/col2im), forward and both gradients.
//! - `batch_norm`: batch norm as one op with its own backward, and conv + batch norm fused.
//! - `activation`, `affine`, `binary`: element-wise ops computed in f32 with one-pass backwards.
//! - `extrema`: maxima, minima, `argmax`, `clamp` and `abs` with PyTorch's values and gradients
//!   at ties, bounds and NaN (candle's skip NaN and double ties).
//! - `scan`: cumulative sums in f64, infinities reaching only the sums after them.
//! - `softmax`, `layer_norm`, `mse`: fp32-class ops reading half inputs as they are.
//! - `pow`: `x ^ y` with PyTorch's values and gradients (candle's is `exp(y ln x)`).
//! - `pool`: max and average pooling and their backward.
//! - `attention`: scaled dot-product attention as one op, its score blocks on the GEMM.
//! - `rope`: rotary position embeddings (candle-nn's three layouts) with a backward.
//! - `embedding`: the lookup of an f32 table, its backward writing the table's gradient once.
//! - `optim`: the in-place update passes of `crate::optim`'s SGD and AdamW.
//! - [`unscale`]: the multi-tensor unscale behind `GradScaler`, one pass over every gradient.

mod borrow;
mod channels;
mod convert;
#[cfg(feature = "cuda")]
mod cuda;
pub(crate) mod custom_grad;
pub(crate) mod elem;
pub(crate) mod extrema;
pub(crate) mod layout;
pub(crate) mod leaf_grads;
pub(crate) mod parallel;
#[cfg(target_arch = "x86_64")]
pub(crate) mod simd;
#[cfg(test)]
pub(crate) mod testing;
pub(crate) mod widen;

pub(crate) mod activation;
mod affine;
pub(crate) mod attention;
pub(crate) mod batch_norm;
mod bias;
mod binary;
mod conv;
mod embedding;
pub(crate) mod gemm;
pub(crate) mod layer_norm;
mod matmul;
mod mse;
pub(crate) mod optim;
mod pool;
mod pow;
pub(crate) mod reduce;
pub(crate) mod rope;
mod scan;
mod softmax;
pub mod unscale;

pub(crate) use activation::{gelu, gelu_erf, in_f32, relu, silu};
pub(crate) use affine::{affine, div_scalar, masked_scale, rdiv_scalar};
pub(crate) use attention::scaled_dot_product_attention;
pub(crate) use bias::add_bias;
pub(crate) use binary::{
    add, broadcast_add, broadcast_div, broadcast_maximum, broadcast_minimum, broadcast_mul,
    broadcast_sub, spread, sub, widening_sum,
};
pub(crate) use conv::{
    conv1d, conv2d, conv_transpose, handles as conv2d_handles,
    one_op_on_cuda as conv_one_op_on_cuda, Conv2dParams, TransposeParams,
};
pub(crate) use convert::to_dtype;
pub(crate) use elem::{cpu_float, wide};
pub(crate) use embedding::{candle_ids, embedding, id_outside, index_select};
pub(crate) use layer_norm::layer_norm;
pub(crate) use matmul::{broadcast_matmul, linear, linear_act, matmul};
pub(crate) use mse::mse;
pub(crate) use pool::{avg_pool2d, batched, max_pool2d, Pool2d};
pub(crate) use pow::{pow, powf};
pub(crate) use scan::cumsum;
pub(crate) use softmax::{log_softmax_last_dim, softmax_last_dim};
