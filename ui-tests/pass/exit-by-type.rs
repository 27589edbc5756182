//! A region's result leaves by the type its signature resolves to, however it is spelt: a renamed
//! import, a generic alias with an error type of the user's (as `anyhow::Result`), candle's
//! `Tensor`, `Self`, plain values, tuples.
use candle_amp::{autocast, Tensor as TensorF32, F32};
use candle_core::{DType, Device, Tensor};

#[derive(Debug)]
struct MyError(#[allow(dead_code)] String);
impl From<candle_core::Error> for MyError {
    fn from(e: candle_core::Error) -> Self {
        Self(e.to_string())
    }
}
type R<T> = std::result::Result<T, MyError>;

struct Model {
    w: Tensor,
}

#[autocast(bf16)]
impl Model {
    fn new(dev: &Device) -> R<Self> {
        Ok(Self { w: Tensor::ones((2, 2), DType::F32, dev)? })
    }

    fn width(&self) -> usize {
        self.w.dim(1).unwrap_or(0)
    }

    /// A typed result through a renamed import: cast to f32.
    fn typed(&self, x: &TensorF32<F32>) -> R<TensorF32<F32>> {
        Ok(x.matmul(&self.w)?)
    }

    /// A candle result: bf16 inside a region, the input's f32 to plain code.
    fn candle(&self, x: &Tensor) -> R<Tensor> {
        let y = x.matmul(&self.w)?;
        if y.dims()[0] == 0 {
            return Ok(y); // an early return leaves the same way
        }
        Ok(y)
    }

    fn both(&self, x: &Tensor) -> R<(Tensor, usize)> {
        Ok((self.candle(x)?, self.width()))
    }
}

#[autocast(bf16)]
fn inside(m: &Model, x: &Tensor) -> candle_core::Result<DType> {
    // Called from a region, the helper's candle result is what its body made.
    Ok(m.candle(x).map_err(|e| candle_core::Error::Msg(format!("{e:?}")))?.dtype())
}

fn main() -> R<()> {
    let dev = Device::Cpu;
    let m = Model::new(&dev)?;
    let x = Tensor::ones((3, 2), DType::F32, &dev)?;
    assert_eq!(m.width(), 2);
    assert_eq!(m.typed(&TensorF32::<F32>::from_candle(x.clone())?)?.dtype(), DType::F32);
    assert_eq!(m.candle(&x)?.dtype(), DType::F32);
    assert_eq!(m.both(&x)?.0.dtype(), DType::F32);
    assert_eq!(inside(&m, &x)?, DType::BF16);
    Ok(())
}
