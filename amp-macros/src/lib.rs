//! Procedural macros of candle-amp: `#[autocast]`, `#[keep_fp32]`, `#[custom_fwd]`,
//! `#[custom_bwd]` and `policy!`.
//!
//! Users depend on the `candle-amp` facade, which re-exports these; the generated code names
//! only `::candle_amp::__private::NAME` paths (`runtime.rs`). See ARCHITECTURE.md for the design.
//!
//! Every macro runs in phases: syn input -> an intermediate form keeping the syn nodes
//! (`model.rs`; `args.rs` for attribute arguments) -> validation collecting every error
//! (`validate.rs`) -> code generation that cannot fail (`expand.rs`, with `rewrite.rs` for region
//! bodies). On any error the output is the errors plus the item and stand-ins for what other
//! code expects of it (`fallback.rs`; `policy!`'s in `policy.rs`), so that one mistake is reported once. `errors.rs`
//! (error collection) and `syntax.rs` (syntax for generated code) are leaves every phase may use:
//! the modules import one another without a cycle (a test checks it). `custom.rs` and
//! `policy.rs` hold what is specific to `#[custom_fwd]`/`#[custom_bwd]` and `policy!`, in the
//! same phases.

mod args;
mod custom;
mod errors;
mod expand;
mod fallback;
mod model;
mod optable;
mod policy;
mod rewrite;
mod runtime;
mod syntax;
#[cfg(test)]
mod tests;
mod validate;

use proc_macro::TokenStream;
use proc_macro2::TokenStream as TokenStream2;

use crate::model::{AttrKind, Region};

/// Runs a fn, a method or every method of an impl block under an autocast policy.
///
/// `#[autocast(fp16)]`, `#[autocast(bf16)]`, `#[autocast(policy = path::To::Policy)]`, or bare
/// `#[autocast]` (a module that inherits its caller's policy), each optionally with
/// `enabled = <bool expr>` (false: the plain f32 path). Tensor parameters enter the region; op
/// calls, `ops::*`/`loss::*` calls and module `forward` calls inside are routed by op class; a
/// `Result<Tensor<P>>` result leaves cast to `P`. See the crate README for the tour.
#[proc_macro_attribute]
pub fn autocast(args: TokenStream, item: TokenStream) -> TokenStream {
    region_attr(AttrKind::Autocast, args.into(), item.into()).into()
}

/// Keeps a part of an autocast region in f32 (inputs upcast at the boundary): on a statement, a
/// block or a method inside `#[autocast]`, or on a module's impl block. Anywhere else it is a
/// compile error that says so.
#[proc_macro_attribute]
pub fn keep_fp32(args: TokenStream, item: TokenStream) -> TokenStream {
    region_attr(AttrKind::KeepFp32, args.into(), item.into()).into()
}

/// Declares an autocast policy at compile time: a lower dtype and moves of ops between classes.
///
/// ```text
/// policy! {
///     /// Softmax stays in f16 for a fused attention kernel; gelu runs in f32.
///     pub struct AttentionPolicy: fp16 {
///         softmax: lower_precision,
///         gelu: fp32,
///     }
/// }
/// ```
///
/// Classes: `lower_precision`, `fp32`, `promote`, `preserve`; op names are those of
/// `candle_amp::op`. Use it as `#[autocast(policy = AttentionPolicy)]`.
#[proc_macro]
pub fn policy(input: TokenStream) -> TokenStream {
    policy::expand(input.into()).into()
}

/// Makes a user op callable from autocast regions, as PyTorch's `custom_fwd`.
///
/// - `#[custom_fwd]` on the op's impl: its `forward` runs under the caller's policy.
/// - `#[custom_fwd(cast_inputs = f32)]` (or `f16`, `bf16`) on the op's impl or on a fn: tensor
///   inputs, typed or region values, are cast to that precision and the body runs as written,
///   with autocast off.
#[proc_macro_attribute]
pub fn custom_fwd(args: TokenStream, item: TokenStream) -> TokenStream {
    region_attr(AttrKind::CustomFwd, args.into(), item.into()).into()
}

/// Makes a custom op's backward (candle's `CustomOp1/2/3::bwd`) run in the dtypes its forward
/// ran with: the incoming gradient is cast to the forward result's dtype, and each returned
/// gradient to its input's dtype.
#[proc_macro_attribute]
pub fn custom_bwd(args: TokenStream, item: TokenStream) -> TokenStream {
    custom_bwd_attr(args.into(), item.into()).into()
}

/// `#[autocast]`, `#[keep_fp32]`, `#[custom_fwd]`: the item's model, validated, then expanded;
/// on any error the fallback.
fn region_attr(kind: AttrKind, args: TokenStream2, item: TokenStream2) -> TokenStream2 {
    let parsed = syn::parse2::<syn::Item>(item.clone());
    let expanded = parsed.as_ref().map_err(Clone::clone).and_then(|ast| {
        let region = Region::from_syn(kind, args, ast)?;
        validate::region(&region)?;
        Ok(expand::region(&region))
    });
    expanded.unwrap_or_else(|errors| fallback::region(&errors, item, parsed.as_ref().ok()))
}

/// `#[custom_bwd]`: the backward's model, validated, then expanded; on any error the errors and
/// the fn as written.
fn custom_bwd_attr(args: TokenStream2, item: TokenStream2) -> TokenStream2 {
    let expanded = syn::parse2::<syn::ItemFn>(item.clone()).and_then(|ast| {
        let backward = custom::Backward::from_syn(args, &ast);
        backward.validate()?;
        Ok(backward.expand())
    });
    expanded.unwrap_or_else(|errors| fallback::item(&errors, item))
}

/// The op table for the runtime crate (`__op_table!(markers => callback)`, `methods`, `free`):
/// calls the runtime's `callback!` with the rows of that view. Not a public API.
#[doc(hidden)]
#[proc_macro]
pub fn __op_table(input: TokenStream) -> TokenStream {
    optable::expand(input.into())
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}
