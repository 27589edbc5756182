//! The one spelling of the runtime paths generated code names.
//!
//! Every path the macros emit into user code is `::candle_amp::__private::NAME`, with `NAME` one
//! of the variants of [`Rt`]. The facade's `__private` module provides exactly these names, flat,
//! so that the runtime can move its items around without touching the macros, and the macros
//! cannot drift into a dozen hand-written spellings of the same path.

use proc_macro2::{Ident, Span, TokenStream};
use quote::{quote_spanned, ToTokens};

/// A name in the facade's `__private` module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rt {
    Fp16Policy,
    Bf16Policy,
    Fp32Policy,
    /// The policy of the innermost region running on this thread.
    CallerPolicy,
    Policy,
    /// A region part's extent, for `CallerPolicy`.
    PolicyScope,
    Routed,
    /// The module of method markers: `calls::forward`, `calls::forward_t`, ...
    Calls,
    RegionCall,
    /// `RegionCall` of a module whose method takes `&mut self`.
    RegionCallMut,
    /// The module of the traits a module call's rewrite names (`__amp_forward`, ..).
    ModuleCall,
    RegionGuard,
    AsAmp,
    Enter,
    /// The bound of a module call's tensor argument, by the parameter's declared type.
    EnterAs,
    /// A declared tensor type's value in a region (`Option<&Tensor<P>>` arguments).
    RegionParam,
    /// The bound of a region fn's `Tensor<P>` parameter: a `Tensor<P>` or a region value.
    TensorArg,
    EnterFp32,
    EnterCast,
    /// How a part's results leave it, decided at entry (`Leave::at_entry`).
    Leave,
    /// A returned value on its way out, the three traits of its ways out and the refusal.
    Leaving,
    LeaveConverted,
    LeaveAsIs,
    LeaveAsDeclared,
    LeaveUnsupported,
    /// A tensor parameter's dtype, when floating.
    FloatingDtype,
    ExitToRegion,
    /// A module's result back to its calling region in its declared `output = ..` precision.
    ExitToRegionAs,
    /// A module method's declared return type in region form (its `RegionCall::Output`).
    RegionOutput,
    /// A candle module called from a region.
    CandleModuleCall,
    GradLike,
    GradsLike,
    F32,
    F16,
    BF16,
    /// The op-marker module: `op::softmax`, `op::Op`, `op::OpClass`.
    Op,
    CandleCore,
    /// The identity `.__amp_policy::<Pol>()` of values other than routed free-op calls.
    Unrouted,
    /// `candle_core::Tensor::cat`/`stack` under the names of candle-amp's routed ones.
    ForeignJoin,
    /// The check on the first argument of another crate's function named like an op.
    ForeignArg,
    /// A call of a function named like candle-nn's op, and the traits of its two ways
    /// (`region/foreign.rs`).
    CandleNnFn,
    CandleNnRouted,
    AsWritten,
    /// The candle-nn crate.
    CandleNn,
    /// `h.apply(&m)`'s module, and the traits of its two ways (`region/module.rs`).
    Applied,
    ApplyRegionCall,
    ApplyTRegionCall,
    ApplyAmpModule,
    /// An operator's operands, and the traits of its three ways (`region/operators.rs`).
    Operands,
    TensorOperators,
    ScalarRight,
    ScalarLeft,
    PlainAdd,
    PlainSub,
    PlainMul,
    PlainDiv,
    /// An op call's place in the source, for the precision report.
    /// Ops taken as values: `taken::of2(Tensor::matmul, |a, b| ..)` (`region/taken.rs`).
    Taken,
    Site,
    /// Marks the op call site running while it lives.
    SiteGuard,
}

impl Rt {
    /// Every name, for the test that pins the contract with the facade.
    #[cfg(test)]
    pub(crate) const ALL: [Self; 59] = [
        Self::Fp16Policy,
        Self::Bf16Policy,
        Self::Fp32Policy,
        Self::CallerPolicy,
        Self::Policy,
        Self::PolicyScope,
        Self::Routed,
        Self::Calls,
        Self::RegionCall,
        Self::RegionCallMut,
        Self::ModuleCall,
        Self::RegionGuard,
        Self::AsAmp,
        Self::Enter,
        Self::EnterAs,
        Self::RegionParam,
        Self::TensorArg,
        Self::EnterFp32,
        Self::EnterCast,
        Self::Leave,
        Self::Leaving,
        Self::LeaveConverted,
        Self::LeaveAsIs,
        Self::LeaveAsDeclared,
        Self::LeaveUnsupported,
        Self::FloatingDtype,
        Self::ExitToRegion,
        Self::ExitToRegionAs,
        Self::RegionOutput,
        Self::CandleModuleCall,
        Self::GradLike,
        Self::GradsLike,
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Op,
        Self::CandleCore,
        Self::Unrouted,
        Self::ForeignJoin,
        Self::ForeignArg,
        Self::CandleNnFn,
        Self::CandleNnRouted,
        Self::AsWritten,
        Self::CandleNn,
        Self::Applied,
        Self::ApplyRegionCall,
        Self::ApplyTRegionCall,
        Self::ApplyAmpModule,
        Self::Operands,
        Self::TensorOperators,
        Self::ScalarRight,
        Self::ScalarLeft,
        Self::PlainAdd,
        Self::PlainSub,
        Self::PlainMul,
        Self::PlainDiv,
        Self::Site,
        Self::SiteGuard,
        Self::Taken,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Fp16Policy => "Fp16Policy",
            Self::Bf16Policy => "Bf16Policy",
            Self::Fp32Policy => "Fp32Policy",
            Self::CallerPolicy => "CallerPolicy",
            Self::PolicyScope => "PolicyScope",
            Self::Policy => "Policy",
            Self::Routed => "Routed",
            Self::Calls => "calls",
            Self::RegionCall => "RegionCall",
            Self::RegionCallMut => "RegionCallMut",
            Self::ModuleCall => "module_call",
            Self::RegionGuard => "RegionGuard",
            Self::AsAmp => "AsAmp",
            Self::Enter => "enter",
            Self::EnterAs => "EnterAs",
            Self::RegionParam => "RegionParam",
            Self::TensorArg => "TensorArg",
            Self::EnterFp32 => "enter_fp32",
            Self::EnterCast => "enter_cast",
            Self::Leave => "Leave",
            Self::Leaving => "Leaving",
            Self::LeaveConverted => "LeaveConverted",
            Self::LeaveAsIs => "LeaveAsIs",
            Self::LeaveAsDeclared => "LeaveAsDeclared",
            Self::LeaveUnsupported => "LeaveUnsupported",
            Self::FloatingDtype => "floating_dtype",
            Self::ExitToRegion => "exit_to_region",
            Self::ExitToRegionAs => "exit_to_region_as",
            Self::RegionOutput => "RegionOutput",
            Self::CandleModuleCall => "candle_module_call",
            Self::GradLike => "grad_like",
            Self::GradsLike => "GradsLike",
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Op => "op",
            Self::CandleCore => "candle_core",
            Self::Unrouted => "Unrouted",
            Self::ForeignJoin => "ForeignJoin",
            Self::ForeignArg => "foreign_arg",
            Self::CandleNnFn => "CandleNnFn",
            Self::CandleNnRouted => "CandleNnRouted",
            Self::AsWritten => "AsWritten",
            Self::CandleNn => "candle_nn",
            Self::Applied => "Applied",
            Self::ApplyRegionCall => "ApplyRegionCall",
            Self::ApplyTRegionCall => "ApplyTRegionCall",
            Self::ApplyAmpModule => "ApplyAmpModule",
            Self::Operands => "Operands",
            Self::TensorOperators => "TensorOperators",
            Self::ScalarRight => "ScalarRight",
            Self::ScalarLeft => "ScalarLeft",
            Self::PlainAdd => "PlainAdd",
            Self::PlainSub => "PlainSub",
            Self::PlainMul => "PlainMul",
            Self::PlainDiv => "PlainDiv",
            Self::Site => "Site",
            Self::SiteGuard => "SiteGuard",
            Self::Taken => "taken",
        }
    }

    /// The precision marker of a user-written precision (`f32`, `f16`, `bf16`), if it is one.
    pub(crate) fn precision(written: &str) -> Option<Self> {
        match written {
            "f32" => Some(Self::F32),
            "f16" => Some(Self::F16),
            "bf16" => Some(Self::BF16),
            _ => None,
        }
    }

    /// The path with every token at `span`: used where the generated code stands for a user's
    /// token (`fp16` in `#[autocast(fp16)]`, a routed method call), so that rustc's errors about
    /// that code point at what the user wrote.
    pub(crate) fn at(self, span: Span) -> RtPath {
        RtPath { name: self, span }
    }
}

/// The path at the macro's call site.
impl ToTokens for Rt {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        self.at(Span::call_site()).to_tokens(tokens);
    }
}

/// A runtime path with the span its tokens carry.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RtPath {
    name: Rt,
    span: Span,
}

impl ToTokens for RtPath {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        let name = Ident::new(self.name.name(), self.span);
        tokens.extend(quote_spanned!(self.span=> ::candle_amp::__private::#name));
    }
}
