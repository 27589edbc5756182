use candle_core::{Result, Var};
use candle_nn::VarBuilder;

use super::{expect_dims, master, weight_as, AmpLayer};
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
        weight_as::<F32>(&self.embeddings)?
            .index_select(&ids.flatten_all()?, 0)?
            .reshape(dims)
    }
}

impl AmpLayer for Embedding {
    type Op = op::embedding;
}

/// Ids are integers, not region values: the lookup returns the f32 table's rows.
impl<Pol: Policy> RegionCall<Pol, calls::forward, (&candle_core::Tensor,)> for Embedding {
    fn region_call(&self, (ids,): (&candle_core::Tensor,)) -> Result<AmpTensor> {
        Ok(self.forward(ids)?.to_amp())
    }
}

/// An embedding with a standard-normal table, as candle-nn's `embedding`.
pub fn embedding(vocab: usize, hidden: usize, vb: VarBuilder) -> Result<Embedding> {
    let init = candle_nn::Init::Randn {
        mean: 0.,
        stdev: 1.,
    };
    Embedding::new(Var::from_tensor(&vb.get_with_hints(
        (vocab, hidden),
        "weight",
        init,
    )?)?)
}
