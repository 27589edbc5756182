//! Library code generic over the precision: precision-preserving and lower-precision ops work
//! for any `P`, and fp32-class ops are reached through an explicit cast.
use candle_amp::{Precision, Tensor, BF16, F16, F32};
use candle_core::Device;

fn mlp_block<P: Precision>(x: &Tensor<P>, w: &Tensor<P>) -> candle_core::Result<Tensor<F32>> {
    let h = x.matmul(&w.t()?)?.relu()?;
    h.cast::<F32>()?.mean_all()
}

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::<F32>::ones((4, 8), &dev)?;
    let w = Tensor::<F32>::full(0.5, (8, 8), &dev)?;
    let a = mlp_block(&x, &w)?.to_scalar::<f32>()?;
    let b = mlp_block(&x.cast::<F16>()?, &w.cast::<F16>()?)?.to_scalar::<f32>()?;
    let c = mlp_block(&x.cast::<BF16>()?, &w.cast::<BF16>()?)?.to_scalar::<f32>()?;
    assert_eq!((a, b, c), (4.0, 4.0, 4.0));
    Ok(())
}
