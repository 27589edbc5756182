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
    EnterFp32,
    EnterCast,
    Exit,
    ExitToRegion,
    /// A module's result back to its calling region in its declared `output = ..` precision.
    ExitToRegionAs,
    /// A module method's declared return type in region form (its `RegionCall::Output`).
    RegionOutput,
    /// A candle module's input entering as the region value it is.
    EnterActivation,
    /// A candle module's result leaving as a candle tensor in the input's dtype.
    ExitLike,
    /// The dtype a candle module's result leaves in, decided at its entry.
    CandleExitDtype,
    /// A candle module called from a region.
    CandleModuleCall,
    /// A region value.
    AmpTensor,
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
    /// An op call's place in the source, for the precision report.
    Site,
    /// Marks the op call site running while it lives.
    SiteGuard,
}

impl Rt {
    /// Every name, for the test that pins the contract with the facade.
    #[cfg(test)]
    pub(crate) const ALL: [Self; 39] = [
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
        Self::EnterFp32,
        Self::EnterCast,
        Self::Exit,
        Self::ExitToRegion,
        Self::ExitToRegionAs,
        Self::RegionOutput,
        Self::EnterActivation,
        Self::ExitLike,
        Self::CandleExitDtype,
        Self::CandleModuleCall,
        Self::AmpTensor,
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
        Self::Site,
        Self::SiteGuard,
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
            Self::EnterFp32 => "enter_fp32",
            Self::EnterCast => "enter_cast",
            Self::Exit => "exit",
            Self::ExitToRegion => "exit_to_region",
            Self::ExitToRegionAs => "exit_to_region_as",
            Self::RegionOutput => "RegionOutput",
            Self::EnterActivation => "enter_activation",
            Self::ExitLike => "exit_like",
            Self::CandleExitDtype => "candle_exit_dtype",
            Self::CandleModuleCall => "candle_module_call",
            Self::AmpTensor => "AmpTensor",
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
            Self::Site => "Site",
            Self::SiteGuard => "SiteGuard",
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
