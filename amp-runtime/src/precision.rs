//! Precision markers: the type parameter of [`Tensor<P>`](crate::Tensor).
//!
//! A marker is a zero-sized type naming one floating dtype. The trait is sealed: the set of
//! precisions is closed so that the promotion table below is total and checked by rustc.
//! `F8E4M3`/`F8E5M2` will join as further markers once candle's f8 kernels cover the op set.

use candle_core::DType;

mod sealed {
    pub trait Sealed {}
}

/// A floating-point precision a typed tensor can hold.
///
/// Implemented by [`F32`], [`F16`] and [`BF16`] only.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a precision marker",
    label = "expected `F32`, `F16` or `BF16` here",
    note = "typed tensors are `Tensor<F32>`, `Tensor<F16>` or `Tensor<BF16>`"
)]
pub trait Precision:
    sealed::Sealed + Copy + Default + Send + Sync + std::fmt::Debug + 'static
{
    /// The candle dtype of tensors of this precision.
    const DTYPE: DType;
    /// The marker's name as written in types (`"F16"`), for messages.
    const NAME: &'static str;
}

macro_rules! precision {
    ($(#[$doc:meta])* $name:ident => $dtype:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        pub struct $name;
        impl sealed::Sealed for $name {}
        impl Precision for $name {
            const DTYPE: DType = DType::$dtype;
            const NAME: &'static str = stringify!($name);
        }
    };
}

precision!(
    /// IEEE single precision: master weights, reductions, losses.
    F32 => F32
);
precision!(
    /// IEEE half precision (5-bit exponent): fast on tensor cores, needs loss scaling to train.
    F16 => F16
);
precision!(
    /// bfloat16 (f32's 8-bit exponent, 7-bit mantissa): f32's range, no loss scaling needed.
    BF16 => BF16
);

/// The half precisions, [`F16`] and [`BF16`]: the lower dtype of an autocast policy.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a half precision",
    label = "expected `F16` or `BF16` here",
    note = "an autocast policy lowers to `F16` or `BF16`"
)]
pub trait Half: Precision {}
impl Half for F16 {}
impl Half for BF16 {}

/// Whether two precisions are the same, decided at compile time.
pub(crate) const fn same<P: Precision, Q: Precision>() -> bool {
    // DType has no const PartialEq; compare the names, which are unique per marker.
    let (a, b) = (P::NAME.as_bytes(), Q::NAME.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Type promotion of two precisions, as PyTorch's promote-class ops do under autocast: the widest
/// input wins, so any `F32` input makes the result `F32`.
///
/// `F16` with `BF16` has no implementation on purpose: PyTorch silently promotes that pair to f32;
/// here it is a compile error, and the user casts one side explicitly.
#[diagnostic::on_unimplemented(
    message = "`{Self}` and `{Rhs}` do not promote implicitly",
    label = "`Tensor<{Self}>` and `Tensor<{Rhs}>` meet here",
    note = "F16 and BF16 never mix implicitly; cast one side first with `.cast::<F32>()`, \
            `.cast::<F16>()` or `.cast::<BF16>()`"
)]
pub trait Promote<Rhs: Precision>: Precision {
    /// The precision both operands are cast to.
    type Output: Precision;
}

impl<P: Precision> Promote<P> for P {
    type Output = P;
}
macro_rules! promote_to_f32 {
    ($($half:ident),*) => {$(
        impl Promote<$half> for F32 {
            type Output = F32;
        }
        impl Promote<F32> for $half {
            type Output = F32;
        }
    )*};
}
promote_to_f32!(F16, BF16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_carry_their_dtype() {
        assert_eq!(F32::DTYPE, DType::F32);
        assert_eq!(F16::DTYPE, DType::F16);
        assert_eq!(BF16::DTYPE, DType::BF16);
        assert!(same::<F16, F16>());
        assert!(!same::<F16, BF16>());
        assert!(!same::<F32, F16>());
    }

    fn output_dtype<A: Promote<B>, B: Precision>() -> DType {
        <A as Promote<B>>::Output::DTYPE
    }

    #[test]
    fn promotion_table_matches_pytorch_autocast() {
        assert_eq!(output_dtype::<F32, F16>(), DType::F32);
        assert_eq!(output_dtype::<BF16, F32>(), DType::F32);
        assert_eq!(output_dtype::<F16, F16>(), DType::F16);
        assert_eq!(output_dtype::<BF16, BF16>(), DType::BF16);
    }
}
