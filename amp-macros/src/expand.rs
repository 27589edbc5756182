//! Code generation for `#[autocast]` and `#[keep_fp32]` on fns, methods and impl blocks.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::{Block, FnArg, GenericParam, ImplItem, Item, ItemFn, ItemImpl, Pat, ReturnType, Type};

use crate::args::{fp32_policy, AutocastArgs, PolicyArg};
use crate::optable::MODULE_CALLS;
use crate::rewrite::{take_marker, Rewriter};
use crate::runtime::Rt;

/// On error: `compile_error!` plus the original item untouched, so that the user sees one
/// error and not a cascade from a half-rewritten body.
pub(crate) fn fallback(errors: Vec<syn::Error>, original: TokenStream) -> TokenStream {
    let errors = errors.into_iter().map(syn::Error::into_compile_error);
    quote!(#(#errors)* #original)
}

pub(crate) fn autocast(args: TokenStream, item: TokenStream) -> TokenStream {
    let result = syn::parse2::<AutocastArgs>(args).and_then(|args| {
        match syn::parse2::<Item>(item.clone())? {
            Item::Fn(f) => expand_fn(&args, Mode::Autocast, f).map(ToTokens::into_token_stream),
            Item::Impl(imp) => expand_impl(&args, Mode::Autocast, imp),
            other => Err(syn::Error::new(
                item_span(&other),
                "#[autocast] applies to a fn, a method or an impl block",
            )),
        }
    });
    result.unwrap_or_else(|errors| fallback(errors.into_iter().collect(), item))
}

pub(crate) fn keep_fp32(args: TokenStream, item: TokenStream) -> TokenStream {
    if !args.is_empty() {
        let e = syn::Error::new(args.span(), "#[keep_fp32] takes no arguments");
        return fallback(vec![e], item);
    }
    let result = match syn::parse2::<Item>(item.clone()) {
        // On a module's impl: the module always runs in f32, also when called from a region.
        Ok(Item::Impl(imp)) => {
            let args = AutocastArgs {
                policy: PolicyArg::Named(fp32_policy()),
                enabled: None,
                output: None,
            };
            expand_impl(&args, Mode::KeepFp32, imp)
        }
        Ok(other) => Err(syn::Error::new(
            item_span(&other),
            "#[keep_fp32] only has meaning inside an #[autocast] region: put it on a statement, \
             a block or a method there, or on a module's impl block to keep that module in f32",
        )),
        Err(e) => Err(e),
    };
    result.unwrap_or_else(|errors| fallback(errors.into_iter().collect(), item))
}

/// All errors as one, reported together (pyo3's `combine_errors`).
fn combine(errors: impl IntoIterator<Item = syn::Error>) -> Option<syn::Error> {
    errors.into_iter().reduce(|mut all, e| {
        all.combine(e);
        all
    })
}

fn item_span(item: &Item) -> Span {
    item.to_token_stream()
        .into_iter()
        .next()
        .map_or_else(Span::call_site, |t| t.span())
}

/// How a part runs: under the region's policy, kept in f32 (inputs upcast on entry), or as a
/// `#[custom_fwd(cast_inputs = ..)]` op (inputs cast to the named precision, body left as
/// written, autocast off).
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Mode {
    Autocast,
    KeepFp32,
    CastInputs(syn::Ident),
}

/// A parameter that enters the region as a tensor: `x: Tensor<P>` or `x: &Tensor<P>`.
fn tensor_param(arg: &FnArg) -> Option<&syn::Ident> {
    let FnArg::Typed(typed) = arg else {
        return None;
    };
    let Pat::Ident(pat) = &*typed.pat else {
        return None;
    };
    is_tensor_type(&typed.ty).then_some(&pat.ident)
}

pub(crate) fn is_tensor_type(ty: &Type) -> bool {
    match ty {
        Type::Reference(r) => is_tensor_type(&r.elem),
        Type::Path(p) => p.path.segments.last().is_some_and(|s| s.ident == "Tensor"),
        Type::Paren(p) => is_tensor_type(&p.elem),
        _ => false,
    }
}

/// Whether the signature returns `Result<Tensor<..>, ..>`: then the region's value leaves as
/// that typed tensor, cast to its precision.
fn returns_tensor_result(output: &ReturnType) -> bool {
    let ReturnType::Type(_, ty) = output else {
        return false;
    };
    let Type::Path(p) = &**ty else { return false };
    let Some(last) = p.path.segments.last() else {
        return false;
    };
    if last.ident != "Result" {
        return false;
    }
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return false;
    };
    matches!(args.args.first(), Some(syn::GenericArgument::Type(t)) if is_tensor_type(t))
}

/// The rewritten body of one region part:
/// Input:  `{ stmts; tail }` with tensor params `x`
/// Output: `{ let _g = RegionGuard::enter(); let x = enter(&x); exit({ stmts'; tail' }) }`
fn region_body(
    block: &Block,
    params: &[syn::Ident],
    policy: &TokenStream,
    enabled: Option<&syn::Expr>,
    upcast: bool,
    exit: Option<TokenStream>,
) -> syn::Result<TokenStream> {
    let guard = syn::Ident::new("__amp_region", Span::mixed_site());
    let (enter, enter_fp32) = (Rt::Enter, Rt::EnterFp32);
    let enter = params.iter().map(|p| {
        if upcast {
            quote_spanned!(p.span()=> let #p = #enter_fp32(&#p)?;)
        } else {
            quote_spanned!(p.span()=> let #p = #enter(&#p);)
        }
    });
    let rewrite = |policy: &TokenStream| -> syn::Result<TokenStream> {
        let mut body = block.clone();
        let mut rewriter = Rewriter::new(policy.clone(), exit.clone());
        syn::visit_mut::VisitMut::visit_block_mut(&mut rewriter, &mut body);
        if let Some(error) = combine(rewriter.errors) {
            return Err(error);
        }
        Ok(match &exit {
            Some(exit) => quote!(#exit(#body)),
            None => body.into_token_stream(),
        })
    };
    let run = match enabled {
        None => rewrite(policy)?,
        Some(cond) => {
            let (on, off) = (rewrite(policy)?, rewrite(&fp32_policy())?);
            quote_spanned!(cond.span()=> if #cond { #on } else { #off })
        }
    };
    let region_guard = Rt::RegionGuard;
    Ok(quote!({
        let #guard = #region_guard::enter();
        #(#enter)*
        #run
    }))
}

/// The precision marker a `Tensor<X>`, `&Tensor<X>` or `Result<Tensor<X>, ..>` type names, if
/// any (a bare `Tensor` is `Tensor<F32>`), with its span.
pub(crate) fn named_precision(ty: &Type) -> Option<syn::Ident> {
    let ty = match ty {
        Type::Reference(r) => &*r.elem,
        other => other,
    };
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return (last.ident == "Tensor").then(|| syn::Ident::new("F32", last.ident.span()));
    };
    match args.args.first()? {
        syn::GenericArgument::Type(inner) if last.ident == "Result" => named_precision(inner),
        syn::GenericArgument::Type(Type::Path(p)) => p.path.get_ident().cloned(),
        _ => None,
    }
}

/// `output = ..` asserts what the signature already decides: the precision of the returned
/// `Tensor<X>` (`input`: the first tensor parameter's). A contradiction is a compile error on
/// the argument, so the signature stays the one source of truth.
fn check_output(args: &AutocastArgs, f: &ItemFn) -> syn::Result<()> {
    let Some(output) = &args.output else {
        return Ok(());
    };
    let returned = match &f.sig.output {
        ReturnType::Type(_, ret) => named_precision(ret).map(|p| p.to_string()),
        ReturnType::Default => None,
    };
    let wanted = match output.to_string().as_str() {
        "input" => f.sig.inputs.iter().find_map(|a| match a {
            FnArg::Typed(t) if is_tensor_type(&t.ty) => {
                named_precision(&t.ty).map(|p| p.to_string())
            }
            _ => None,
        }),
        other => Some(other.to_uppercase()),
    };
    if returned.is_some() && returned == wanted {
        return Ok(());
    }
    let returns = returned.map_or_else(
        || "no `Result<Tensor<F32|F16|BF16>>`".to_string(),
        |p| format!("`Tensor<{p}>`"),
    );
    Err(syn::Error::new(
        output.span(),
        format!(
            "output = {output} contradicts the signature, which returns {returns}: a region's \
             result leaves in the precision its signature declares"
        ),
    ))
}

fn expand_fn(args: &AutocastArgs, mode: Mode, mut f: ItemFn) -> syn::Result<ItemFn> {
    check_output(args, &f)?;
    let params: Vec<_> = f
        .sig
        .inputs
        .iter()
        .filter_map(tensor_param)
        .cloned()
        .collect();
    let exit = returns_tensor_result(&f.sig.output).then(|| Rt::Exit.into_token_stream());
    let policy = match mode {
        Mode::Autocast => args.policy.own(),
        Mode::KeepFp32 | Mode::CastInputs(_) => fp32_policy(),
    };
    let body = region_body(
        &f.block,
        &params,
        &policy,
        args.enabled.as_ref(),
        mode == Mode::KeepFp32,
        exit,
    )?;
    *f.block = syn::parse2(body)?;
    Ok(f)
}

/// A method's own markers inside an annotated impl: `#[keep_fp32]` or its own `#[autocast(..)]`.
fn method_markers(attrs: &mut Vec<syn::Attribute>) -> syn::Result<(bool, Option<AutocastArgs>)> {
    let keep = take_marker(attrs, "keep_fp32");
    let mut own = None;
    let mut rest = Vec::with_capacity(attrs.len());
    for attr in attrs.drain(..) {
        if attr.path().is_ident("autocast") {
            let parsed = match &attr.meta {
                syn::Meta::Path(_) => AutocastArgs {
                    policy: PolicyArg::Inherit,
                    enabled: None,
                    output: None,
                },
                _ => attr.parse_args::<AutocastArgs>()?,
            };
            if own.replace(parsed).is_some() {
                return Err(syn::Error::new(
                    attr.span(),
                    "duplicate #[autocast] on this method",
                ));
            }
        } else {
            rest.push(attr);
        }
    }
    *attrs = rest;
    if keep && own.is_some() {
        return Err(syn::Error::new(
            Span::call_site(),
            "a method is either #[keep_fp32] or #[autocast(..)], not both",
        ));
    }
    Ok((keep, own))
}

/// Every method of the impl becomes a region; `forward`, `forward_t` and `forward_train` also
/// get a `RegionCall` impl, so that a calling region passes its policy on (or the module keeps
/// its own when it names one).
pub(crate) fn expand_impl(
    args: &AutocastArgs,
    mode: Mode,
    mut imp: ItemImpl,
) -> syn::Result<TokenStream> {
    let mut region_calls = Vec::new();
    let mut errors: Vec<syn::Error> = Vec::new();
    let (generics, self_ty) = (imp.generics.clone(), imp.self_ty.clone());
    for item in &mut imp.items {
        let ImplItem::Fn(method) = item else { continue };
        let (keep, own) = match method_markers(&mut method.attrs) {
            Ok(m) => m,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        let method_mode = if keep { Mode::KeepFp32 } else { mode.clone() };
        let method_args = own.as_ref().unwrap_or(args);
        let as_fn = ItemFn {
            attrs: Vec::new(),
            vis: syn::Visibility::Inherited,
            sig: method.sig.clone(),
            block: Box::new(method.block.clone()),
        };
        if MODULE_CALLS.contains(&method.sig.ident.to_string().as_str()) {
            match region_call_impl(
                &generics,
                &self_ty,
                method_args,
                method_mode.clone(),
                &as_fn,
            ) {
                Ok(Some(tokens)) => region_calls.push(tokens),
                Ok(None) => {}
                Err(e) => errors.push(e),
            }
        }
        if let Mode::CastInputs(_) = method_mode {
            // Called with typed tensors outside a region, the op runs exactly as written.
            continue;
        }
        match expand_fn(method_args, method_mode, as_fn) {
            Ok(f) => method.block = *f.block,
            Err(e) => errors.push(e),
        }
    }
    if let Some(error) = combine(errors) {
        return Err(error);
    }
    Ok(quote!(#imp #(#region_calls)*))
}

/// `impl<Pol, A0: AsAmp> RegionCall<Pol, calls::forward, (A0, bool)> for Module { .. }` for a
/// `fn forward(&self, x: &Tensor<F32>, train: bool) -> Result<Tensor<F32>>`.
fn region_call_impl(
    impl_generics: &syn::Generics,
    self_ty: &Type,
    args: &AutocastArgs,
    mode: Mode,
    method: &ItemFn,
) -> syn::Result<Option<TokenStream>> {
    let (policy_trait, as_amp, enter_cast, exit_to_region) =
        (Rt::Policy, Rt::AsAmp, Rt::EnterCast, Rt::ExitToRegion);
    let (region_call, calls, amp_tensor, candle_core) =
        (Rt::RegionCall, Rt::Calls, Rt::AmpTensor, Rt::CandleCore);
    let mut inputs = method.sig.inputs.iter();
    match inputs.next() {
        Some(FnArg::Receiver(r)) if r.reference.is_some() && r.mutability.is_none() => {}
        // Only `&self` modules can be called from a region; others get the trait's error there.
        _ => return Ok(None),
    }
    let pol = syn::Ident::new("__AmpPol", Span::mixed_site());
    let mut generics = impl_generics.clone();
    generics.params.push(syn::parse_quote!(#pol: #policy_trait));
    let (mut pats, mut types, mut params) = (Vec::new(), Vec::new(), Vec::new());
    for (i, input) in inputs.enumerate() {
        let FnArg::Typed(typed) = input else { continue };
        let pat = &typed.pat;
        if let Some(ident) = tensor_param(input) {
            let a = format_ident!("__AmpA{}", i, span = Span::mixed_site());
            generics
                .params
                .push(GenericParam::Type(syn::parse_quote!(#a: #as_amp)));
            types.push(quote!(#a));
            params.push(ident.clone());
        } else {
            if contains_reference(&typed.ty) {
                return Err(syn::Error::new(
                    typed.ty.span(),
                    "a module called from an autocast region takes tensors and owned values; \
                     a reference parameter other than a tensor is not supported yet",
                ));
            }
            types.push(typed.ty.to_token_stream());
        }
        pats.push(pat.to_token_stream());
    }
    let policy = match (&args.policy, &mode) {
        (_, Mode::KeepFp32 | Mode::CastInputs(_)) => fp32_policy(),
        (PolicyArg::Inherit, Mode::Autocast) => quote!(#pol),
        (PolicyArg::Named(path), Mode::Autocast) => path.clone(),
    };
    let body = if let Mode::CastInputs(precision) = &mode {
        // Autocast is off inside: cast the tensor inputs and call the op's own method.
        let call_args = method.sig.inputs.iter().skip(1).map(|input| match input {
            FnArg::Typed(t) if tensor_param(input).is_some() => {
                let pat = &t.pat;
                if matches!(&*t.ty, Type::Reference(_)) {
                    quote!(&#pat)
                } else {
                    quote!(#pat)
                }
            }
            FnArg::Typed(t) => t.pat.to_token_stream(),
            FnArg::Receiver(_) => quote!(self),
        });
        let name = &method.sig.ident;
        let marker = crate::custom::precision_marker(precision);
        quote!({
            #(let #params = #enter_cast::<#marker, _>(&#params)?;)*
            #exit_to_region(Self::#name(self, #(#call_args),*))
        })
    } else {
        let exit = Some(exit_to_region.into_token_stream());
        let upcast = mode == Mode::KeepFp32;
        region_body(
            &method.block,
            &params,
            &policy,
            args.enabled.as_ref(),
            upcast,
            exit,
        )?
    };
    let name = &method.sig.ident;
    let (impl_generics, _, where_clause) = generics.split_for_impl();
    Ok(Some(quote! {
        impl #impl_generics #region_call<#pol, #calls::#name, (#(#types,)*)>
            for #self_ty #where_clause
        {
            fn region_call(
                &self,
                (#(#pats,)*): (#(#types,)*),
            ) -> #candle_core::Result<#amp_tensor> #body
        }
    }))
}

fn contains_reference(ty: &Type) -> bool {
    ty.to_token_stream()
        .into_iter()
        .any(|t| matches!(t, proc_macro2::TokenTree::Punct(p) if p.as_char() == '&'))
}
