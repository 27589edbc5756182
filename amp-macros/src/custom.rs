//! User ops (PyTorch's `torch.amp.custom_fwd/custom_bwd`).
//!
//! `#[custom_fwd]` goes through the region phases (`model.rs`, `validate.rs`, `expand.rs`); what
//! is specific to it is the code for a fn with `cast_inputs`, below. `#[custom_bwd]` has its own
//! small model, validation and code generation here, in the same phases.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::{Block, FnArg, Ident, ItemFn, Pat, Signature, Type};

use crate::errors::Errors;
use crate::model::{is_candle_tensor, is_tensor_type};
use crate::rewrite::at_site;
use crate::runtime::Rt;
use crate::syntax::verbatim_block;

/// `#[custom_fwd(cast_inputs = ..)]` on a fn:
/// Input:  `fn op(x: &Tensor<F32>, k: f64) -> R { body }` with `cast_inputs = f32`
/// Output: `fn op(x: impl AsAmp, k: f64) -> R { let (__amp_x,) = { site; (enter_cast::<F32,
///          _>(&x)?,) }; let x = &__amp_x; { body } }`: any tensor in, the body plain typed
///          code; the casts marked with the op's site for the precision report
pub(crate) fn cast_inputs_fn(item: &ItemFn, precision: &Ident) -> ItemFn {
    let mut f = item.clone();
    cast_inputs_in_place(
        &mut f.sig,
        &mut f.block,
        precision,
        &item.sig.ident.to_string(),
    );
    f
}

/// The same on a method of a `cast_inputs` impl other than the module calls (`forward`, which
/// region values reach through its `RegionCall`): `function` names it for the report.
pub(crate) fn cast_inputs_in_place(
    sig: &mut Signature,
    block: &mut Block,
    precision: &Ident,
    function: &str,
) {
    // Invariant established by validation, which rejects any other precision.
    let marker =
        Rt::precision(&precision.to_string()).expect("validated: cast_inputs is f32, f16 or bf16");
    let (enter_cast, as_amp) = (Rt::EnterCast, Rt::AsAmp);
    let (mut owned, mut casts, mut rebind) = (Vec::new(), Vec::new(), Vec::new());
    for input in &mut sig.inputs {
        let FnArg::Typed(typed) = input else { continue };
        let Pat::Ident(pat) = &*typed.pat else {
            continue;
        };
        if !is_tensor_type(&typed.ty) || is_candle_tensor(&typed.ty) {
            continue;
        }
        let name = &pat.ident;
        let cast = format_ident!("__amp_{}", name, span = name.span());
        casts.push(quote_spanned!(name.span()=> #enter_cast::<#marker, _>(&#name)?));
        rebind.push(if matches!(&*typed.ty, Type::Reference(_)) {
            quote!(let #name = &#cast;)
        } else {
            quote!(let #name = #cast;)
        });
        owned.push(cast);
        *typed.ty = Type::Verbatim(quote_spanned!(typed.ty.span()=> impl #as_amp));
    }
    // The casts are reported at the op's name, as `cast_inputs`.
    let cast = at_site(sig.ident.span(), function, quote!((#(#casts,)*)));
    let prologue = quote!(let (#(#owned,)*) = #cast; #(#rebind)*);
    // Autocast is off inside, also for the helpers the body calls.
    let scope = Ident::new("__amp_policy", Span::mixed_site());
    let (policy_scope, fp32) = (Rt::PolicyScope, Rt::Fp32Policy);
    let body = block.clone();
    *block = verbatim_block(quote!(
        #prologue
        let #scope = #policy_scope::enter::<#fp32>();
        #body
    ));
}

/// `#[custom_bwd]` on a backward: `fn bwd(&self, arg.., res, grad_res) -> Result<..>`, as
/// candle's `CustomOp1/2/3::bwd`.
pub(crate) struct Backward<'a> {
    item: &'a ItemFn,
    /// Arguments it was given (it takes none).
    stray: Option<TokenStream>,
    /// The typed parameters: their names, or the pattern where one is not a plain name.
    params: Vec<Result<&'a Ident, &'a Pat>>,
    /// The backward's `Result` type.
    ret: Option<&'a Type>,
}

impl<'a> Backward<'a> {
    pub(crate) fn from_syn(args: TokenStream, item: &'a ItemFn) -> Self {
        let params = item
            .sig
            .inputs
            .iter()
            .filter_map(|input| match input {
                FnArg::Typed(t) => Some(match &*t.pat {
                    Pat::Ident(p) => Ok(&p.ident),
                    other => Err(other),
                }),
                FnArg::Receiver(_) => None,
            })
            .collect();
        let ret = match &item.sig.output {
            syn::ReturnType::Type(_, ret) => Some(&**ret),
            syn::ReturnType::Default => None,
        };
        Self {
            item,
            stray: (!args.is_empty()).then_some(args),
            params,
            ret,
        }
    }

    pub(crate) fn validate(&self) -> syn::Result<()> {
        let mut errors = Errors::default();
        let at_name = self.item.sig.ident.span();
        if let Some(args) = &self.stray {
            errors.spanned(args, "#[custom_bwd] takes no arguments");
        }
        for pat in self.params.iter().filter_map(|p| p.err()) {
            errors.at(pat.span(), "#[custom_bwd] needs named parameters");
        }
        match self.params.len() {
            0 | 1 => errors.at(
                at_name,
                "#[custom_bwd] applies to a backward taking the op's inputs, its result and the \
                 result's gradient, as candle's `CustomOp1/2/3::bwd`",
            ),
            // The inputs, then the result and its gradient.
            2 | 6.. => errors.at(at_name, "#[custom_bwd] supports ops of 1 to 3 inputs"),
            _ => {}
        }
        if self.ret.is_none() {
            errors.at(
                at_name,
                "#[custom_bwd] needs the backward's Result return type",
            );
        }
        errors.finish()
    }

    /// Input:  `fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> R { body }`
    /// Output: the same fn whose `grad_res` is first cast to `res`'s dtype (the dtype the
    ///         forward produced) and whose returned gradients are cast to their inputs' dtypes.
    pub(crate) fn expand(&self) -> TokenStream {
        let names: Vec<&Ident> = self.params.iter().filter_map(|p| p.ok()).collect();
        let ([inputs @ .., res, grad], Some(ret)) = (names.as_slice(), self.ret) else {
            // Validation requires both; unreachable on a validated model.
            return self.item.to_token_stream();
        };
        let (grad_like, grads_like) = (Rt::GradLike, Rt::GradsLike);
        let mut f = self.item.clone();
        let body = &self.item.block;
        let grads = Ident::new("__amp_grads", Span::mixed_site());
        // The user's parameters may be `_res`-style names; the generated uses are ours.
        *f.block = verbatim_block(quote! {
            #[allow(clippy::used_underscore_binding)]
            let #grad = &#grad_like(#grad, #res)?;
            let #grads: #ret = (|| -> #ret #body)();
            #[allow(clippy::needless_question_mark)]
            let #grads = Ok(#grads_like::like(#grads?, (#(#inputs,)*))?);
            #grads
        });
        f.into_token_stream()
    }
}
