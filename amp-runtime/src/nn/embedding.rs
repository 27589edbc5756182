//! The lookup table, PyTorch's `nn.Embedding`: integer ids index the rows of an f32 table
//! `(vocab, hidden)`.
//!
//! `Embedding` (`op::embedding`) is on none of autocast's lists (PyTorch's CUDA autocast leaves
//! `embedding` alone too): it returns the table's precision, f32, inside a region as outside.
//! The ids are a plain `candle_core::Tensor` of integers (`u32`, say), not a typed tensor; the
//! layers after the lookup pick their own precision (a `Linear` in a bf16 region runs in bf16).
//!
//! ```
//! # extern crate amp_runtime as candle_amp;
//! # use amp_macros::autocast;
//! use candle_amp::nn::{self, Embedding, Linear};
//! use candle_amp::{Tensor, F32};
//! use candle_core::{DType, Device};
//! use candle_nn::{VarBuilder, VarMap};
//! // Ids are a plain candle tensor. `#[autocast]` takes any parameter whose type is named
//! // `Tensor` for a typed input, so the region below names the ids' type `Ids` (taken by value).
//! use candle_core::Tensor as Ids;
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let vars = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
//! let emb = nn::embedding(10, 6, vb.pp("emb"))?; // f32 table (10, 6)
//! let ids = Ids::new(&[[1u32, 4, 4], [9, 0, 2]], &dev)?;
//! let e: Tensor<F32> = emb.forward(&ids)?; // no region: f32 rows
//! assert_eq!(e.dims(), &[2, 3, 6]);
//!
//! struct Encoder { emb: Embedding, fc: Linear }
//! #[autocast(bf16)]
//! impl Encoder {
//!     fn forward(&self, ids: Ids) -> candle_core::Result<Tensor<F32>> {
//!         let e = self.emb.forward(&ids)?;
//!         assert_eq!(e.dtype(), DType::F32); // on no list: the table's precision
//!         let h = self.fc.forward(&e)?;
//!         assert_eq!(h.dtype(), DType::BF16); // the next linear runs in bf16
//!         Ok(h)
//!     }
//! }
//! let enc = Encoder { emb, fc: nn::linear(6, 4, vb.pp("fc"))? };
//! assert_eq!(enc.forward(ids)?.dims(), &[2, 3, 4]);
//! # Ok(()) }
//! ```

use candle_core::{Result, Var};
use candle_nn::VarBuilder;

use super::{expect_dims, master, AmpLayer};
use crate::op;
use crate::precision::F32;
use crate::region::{calls, AmpTensor, AsAmp, Policy, RegionCall};
use crate::tensor::Tensor;

/// A lookup table of f32 vectors; on no autocast list, so it returns the table's precision.
#[derive(Clone, Debug)]
pub struct Embedding {
    embeddings: Var,
}

impl Embedding {
    /// An embedding from an f32 table `(vocab, hidden)`.
    pub fn new(embeddings: Var) -> Result<Self> {
        let embeddings = master(embeddings, "Embedding table")?;
        expect_dims(&embeddings, "Embedding table", 2)?;
        Ok(Self { embeddings })
    }

    /// The f32 table `(vocab, hidden)`.
    pub fn embeddings(&self) -> &Var {
        &self.embeddings
    }

    /// Looks up integer `ids` of any shape; the result has shape `ids.dims() + [hidden]`.
    pub fn forward(&self, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
        let mut dims = ids.dims().to_vec();
        dims.push(self.embeddings.dim(1)?);
        Tensor::<F32>::wrap(crate::kernels::embedding(self.embeddings.as_tensor(), ids)?)
            .reshape(dims)
    }
}

impl AmpLayer for Embedding {
    type Op = op::embedding;
}

/// Ids are integers (a candle tensor, or a region value computed from one), never cast: the
/// lookup returns the f32 table's rows, routed as `op::embedding` (`routed_lookup`).
impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for Embedding {
    type Output = AmpTensor;
    fn region_call(&self, (ids,): (A,)) -> Result<AmpTensor> {
        routed_lookup::<Pol>(self.embeddings.as_tensor(), &ids.to_amp())
    }
}

/// The rows `ids` of `table` in a region (candle-amp's `Embedding` and candle-nn's): looked up
/// as [`Embedding::forward`] does (ids range-checked, a `u8` 255 a row), shaped
/// `ids.dims() + [hidden]`, then routed as `op::embedding`, so that a `policy!` that moves
/// `embedding` gets the rows in its dtype (the built-in policies keep the table's) and the
/// precision report sees the lookup.
pub(crate) fn routed_lookup<Pol: Policy>(
    table: &candle_core::Tensor,
    ids: &AmpTensor,
) -> Result<AmpTensor> {
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim(1)?);
    let rows = crate::kernels::embedding(table, ids)?.reshape(dims)?;
    crate::region::unary::<Pol, op::embedding>(&rows, |rows| Ok(rows.clone()))
}

/// An embedding with a standard-normal table, as candle-nn's `embedding`.
pub fn embedding(vocab: usize, hidden: usize, vb: VarBuilder) -> Result<Embedding> {
    let init = candle_nn::Init::Randn {
        mean: 0.,
        stdev: 1.,
    };
    Embedding::new(Var::from_tensor(&super::parameter(
        &vb,
        (vocab, hidden),
        "weight",
        init,
    )?)?)
}
