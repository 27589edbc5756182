//! The GradScaler loop of the README: scale, backward, unscale, clip, one step per optimizer
//! with its own gradients, one update.
use candle_amp::{autocast, nn, GradScaler, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{Optimizer, VarBuilder, VarMap, SGD};

struct Model {
    body: nn::Linear,
    head: nn::Linear,
}

impl Model {
    #[autocast(fp16)]
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = self.body.forward(&x)?.relu()?;
        self.head.forward(&h)
    }
}

fn main() -> Result<()> {
    let (body_vars, head_vars) = (VarMap::new(), VarMap::new());
    let dev = Device::Cpu;
    let model = Model {
        body: nn::linear(4, 8, VarBuilder::from_varmap(&body_vars, DType::F32, &dev))?,
        head: nn::linear(8, 1, VarBuilder::from_varmap(&head_vars, DType::F32, &dev))?,
    };
    let mut body_opt = SGD::new(body_vars.all_vars(), 0.01)?;
    let mut head_opt = SGD::new(head_vars.all_vars(), 0.01)?;
    let mut scaler = GradScaler::new();
    let x = Tensor::<F32>::ones((2, 4), &dev)?;
    for _ in 0..3 {
        let loss = model.forward(&x)?.sqr()?.mean_all()?;
        let mut grads = scaler.unscale(scaler.scale(&loss)?.backward()?)?;
        // An f16 gradient times 65536 may overflow: that step is then skipped.
        let found_inf = grads.found_inf();
        let norm = grads.clip_grad_norm(1.0)?;
        assert_eq!(norm.is_finite(), !found_inf);
        let head_grads = grads.split_off(&head_vars.all_vars());
        let body = scaler.step(&mut body_opt, grads)?;
        let head = scaler.step(&mut head_opt, head_grads)?;
        if !found_inf {
            assert!(body.is_stepped() && head.is_stepped());
        }
        scaler.update()?;
    }
    Ok(())
}
