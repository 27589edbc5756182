//! `#[custom_fwd]` and `#[custom_bwd]` for user ops (PyTorch's `torch.amp.custom_fwd/bwd`).

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{FnArg, Ident, Item, ItemFn, Pat, Token, Type};

use crate::args::{AutocastArgs, PolicyArg};
use crate::expand::{expand_impl, fallback, is_tensor_type, named_precision, Mode};
use crate::runtime::Rt;

mod kw {
    syn::custom_keyword!(cast_inputs);
}

/// `cast_inputs = f32|f16|bf16`, as the precision marker's name (`F32`).
struct CustomFwdArgs {
    cast_inputs: Option<Ident>,
}

impl Parse for CustomFwdArgs {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        if input.is_empty() {
            return Ok(Self { cast_inputs: None });
        }
        input.parse::<kw::cast_inputs>().map_err(|e| {
            syn::Error::new(e.span(), "accepted forms: `#[custom_fwd]`, `#[custom_fwd(cast_inputs = f32)]` (or f16, bf16)")
        })?;
        input.parse::<Token![=]>()?;
        let p: Ident = input.parse()?;
        let marker = match p.to_string().as_str() {
            "f32" => "F32",
            "f16" => "F16",
            "bf16" => "BF16",
            _ => {
                return Err(syn::Error::new(
                    p.span(),
                    "cast_inputs is `f32`, `f16` or `bf16`",
                ))
            }
        };
        if !input.is_empty() {
            return Err(syn::Error::new(
                input.span(),
                "unexpected argument after cast_inputs",
            ));
        }
        Ok(Self {
            cast_inputs: Some(Ident::new(marker, p.span())),
        })
    }
}

pub(crate) fn custom_fwd(args: TokenStream, item: TokenStream) -> TokenStream {
    let result = syn::parse2::<CustomFwdArgs>(args).and_then(|args| {
        let inherit = AutocastArgs {
            policy: PolicyArg::Inherit,
            enabled: None,
            output: None,
        };
        match (syn::parse2::<Item>(item.clone())?, args.cast_inputs) {
            (Item::Impl(imp), None) => expand_impl(&inherit, Mode::Autocast, imp),
            (Item::Impl(imp), Some(p)) => expand_impl(&inherit, Mode::CastInputs(p), imp),
            (Item::Fn(f), Some(p)) => cast_inputs_fn(f, &p).map(|f| quote!(#f)),
            (Item::Fn(f), None) => Err(syn::Error::new(
                f.sig.ident.span(),
                "#[custom_fwd] without cast_inputs runs under the caller's policy, which reaches \
                 ops called as modules: put it on the op's impl (`impl MyOp { fn forward(..) }`, \
                 called as `my_op.forward(&x)`), or give this fn `cast_inputs = f32`",
            )),
            (other, _) => Err(syn::Error::new(
                other.span(),
                "#[custom_fwd] applies to a user op's impl block or fn",
            )),
        }
    });
    result.unwrap_or_else(|e| fallback(vec![e], item))
}

/// Input:  `fn op(x: &Tensor<F32>, k: f64) -> R { body }` with `cast_inputs = f32`
/// Output: `fn op(x: impl AsAmp, k: f64) -> R { let __x = enter_cast::<F32, _>(&x)?;
///          let x = &__x; body }`: any tensor in, the body plain typed code.
pub(crate) fn cast_inputs_fn(mut f: ItemFn, precision: &Ident) -> syn::Result<ItemFn> {
    let mut prologue = Vec::new();
    for input in &mut f.sig.inputs {
        let FnArg::Typed(typed) = input else { continue };
        let Pat::Ident(pat) = &*typed.pat else {
            continue;
        };
        if !is_tensor_type(&typed.ty) {
            continue;
        }
        if let Some(declared) = named_precision(&typed.ty) {
            if declared != *precision
                && ["F32", "F16", "BF16"].contains(&declared.to_string().as_str())
            {
                return Err(syn::Error::new(
                    declared.span(),
                    format!("cast_inputs casts to {precision}, but this parameter is declared {declared}"),
                ));
            }
        }
        let name = &pat.ident;
        let (enter_cast, marker) = (Rt::EnterCast, precision_marker(precision));
        let owned = format_ident!("__amp_{}", name, span = name.span());
        let is_ref = matches!(&*typed.ty, Type::Reference(_));
        prologue.push(quote_spanned!(name.span()=>
            let #owned = #enter_cast::<#marker, _>(&#name)?;
        ));
        prologue.push(if is_ref {
            quote!(let #name = &#owned;)
        } else {
            quote!(let #name = #owned;)
        });
        let as_amp = Rt::AsAmp;
        *typed.ty = syn::parse_quote_spanned!(typed.ty.span()=> impl #as_amp);
    }
    let body = &f.block;
    *f.block = syn::parse2(quote!({ #(#prologue)* #body }))?;
    Ok(f)
}

pub(crate) fn custom_bwd(args: TokenStream, item: TokenStream) -> TokenStream {
    let result = if args.is_empty() {
        syn::parse2::<ItemFn>(item.clone()).and_then(custom_bwd_fn)
    } else {
        Err(syn::Error::new(
            args.span(),
            "#[custom_bwd] takes no arguments",
        ))
    };
    result.unwrap_or_else(|e| fallback(vec![e], item))
}

/// Input:  `fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> R { body }`
/// Output: the same fn whose `grad_res` is first cast to `res`'s dtype (the dtype the forward
///         produced) and whose returned gradients are cast to their inputs' dtypes.
fn custom_bwd_fn(mut f: ItemFn) -> syn::Result<TokenStream> {
    let (grad_like, grads_like) = (Rt::GradLike, Rt::GradsLike);
    let names: Vec<Ident> = f
        .sig
        .inputs
        .iter()
        .filter_map(|a| match a {
            FnArg::Typed(t) => match &*t.pat {
                Pat::Ident(p) => Some(Ok(p.ident.clone())),
                other => Some(Err(syn::Error::new(
                    other.span(),
                    "#[custom_bwd] needs named parameters",
                ))),
            },
            FnArg::Receiver(_) => None,
        })
        .collect::<syn::Result<_>>()?;
    let [inputs @ .., res, grad] = names.as_slice() else {
        return Err(syn::Error::new(
            f.sig.ident.span(),
            "#[custom_bwd] applies to a backward taking the op's inputs, its result and the \
             result's gradient, as candle's `CustomOp1/2/3::bwd`",
        ));
    };
    if inputs.is_empty() || inputs.len() > 3 {
        return Err(syn::Error::new(
            f.sig.ident.span(),
            "#[custom_bwd] supports ops of 1 to 3 inputs",
        ));
    }
    let syn::ReturnType::Type(_, ret) = &f.sig.output else {
        return Err(syn::Error::new(
            f.sig.ident.span(),
            "#[custom_bwd] needs the backward's Result return type",
        ));
    };
    let body = &f.block;
    let grads = syn::Ident::new("__amp_grads", proc_macro2::Span::mixed_site());
    // The user's parameters may be `_res`-style names; the generated uses are ours.
    *f.block = syn::parse2(quote!({
        #[allow(clippy::used_underscore_binding)]
        let #grad = &#grad_like(#grad, #res)?;
        let #grads: #ret = (|| -> #ret #body)();
        #[allow(clippy::needless_question_mark)]
        let #grads = Ok(#grads_like::like(#grads?, (#(#inputs,)*))?);
        #grads
    }))?;
    Ok(quote!(#f))
}

/// The runtime marker of a validated `cast_inputs` precision (`F32`, `F16`, `BF16`).
pub(crate) fn precision_marker(marker: &Ident) -> Rt {
    match marker.to_string().as_str() {
        "F16" => Rt::F16,
        "BF16" => Rt::BF16,
        _ => Rt::F32,
    }
}
