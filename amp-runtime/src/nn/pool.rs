use candle_core::Result;

use super::{region_forward, AmpLayer};
use crate::op;
use crate::precision::Precision;
use crate::tensor::Tensor;

macro_rules! pool_layer {
    ($(#[$doc:meta])* $name:ident, $op:ident, $with_stride:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct $name {
            kernel: usize,
            stride: usize,
        }

        impl $name {
            /// A square window of `kernel`, stride = kernel (PyTorch's default).
            pub fn new(kernel: usize) -> Self {
                Self::with_stride(kernel, kernel)
            }

            /// A square window of `kernel` moved by `stride`.
            pub fn with_stride(kernel: usize, stride: usize) -> Self {
                Self { kernel, stride }
            }

            /// Pools the last two dimensions of `(batch, channels, h, w)`, in `x`'s precision.
            pub fn forward<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
                if self.kernel == 0 || self.stride == 0 {
                    candle_core::bail!(
                        "{}: kernel and stride must be positive",
                        stringify!($name)
                    )
                }
                x.$with_stride(self.kernel, self.stride)
            }
        }

        impl AmpLayer for $name {
            type Op = op::$op;
        }
        region_forward!($name);
    };
}

pool_layer!(
    /// 2-D max pooling, precision-preserving.
    MaxPool2d,
    max_pool2d,
    max_pool2d_with_stride
);
pool_layer!(
    /// 2-D average pooling, precision-preserving.
    ///
    /// candle 0.11 has no backward for average pooling with a stride other than the kernel
    /// size; training through `with_stride(k, s)`, `s != k`, returns candle's error.
    AvgPool2d,
    avg_pool2d,
    avg_pool2d_with_stride
);
