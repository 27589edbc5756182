//! Arguments of `#[autocast(...)]`.
//!
//! Accepted forms: `fp16`, `bf16`, `policy = path::To::Policy`, each optionally followed by
//! `enabled = <bool expr>`; or no arguments at all (inherit the caller's policy).

use proc_macro2::{Span, TokenStream};
use quote::{quote, ToTokens};
use syn::parse::{Parse, ParseStream};
use syn::{Expr, Token};

use crate::runtime::Rt;

mod kw {
    syn::custom_keyword!(fp16);
    syn::custom_keyword!(bf16);
    syn::custom_keyword!(policy);
    syn::custom_keyword!(enabled);
    syn::custom_keyword!(output);
}

pub(crate) const ACCEPTED: &str = "accepted forms: `#[autocast]` (inherit the caller's policy), \
     `#[autocast(fp16)]`, `#[autocast(bf16)]`, `#[autocast(policy = path::To::Policy)]`, \
     each optionally with `, enabled = <bool expression>` and `, output = f32|f16|bf16|input`";

/// Where a region's policy comes from.
#[derive(Clone)]
pub(crate) enum PolicyArg {
    /// No policy argument: a module inherits its caller's policy; called from outside any region
    /// it runs in f32.
    Inherit,
    /// A named policy type.
    Named(TokenStream),
}

impl PolicyArg {
    /// The policy type's path for code outside any calling region.
    pub(crate) fn own(&self) -> TokenStream {
        match self {
            Self::Inherit => fp32_policy(),
            Self::Named(path) => path.clone(),
        }
    }
}

pub(crate) fn fp32_policy() -> TokenStream {
    Rt::Fp32Policy.into_token_stream()
}

pub(crate) struct AutocastArgs {
    pub(crate) policy: PolicyArg,
    pub(crate) enabled: Option<Expr>,
    /// `output = f32|f16|bf16|input`: an assertion on the precision the signature returns.
    pub(crate) output: Option<syn::Ident>,
}

/// Records an argument once; a repeat is reported on its own span (serde's `Attr::set`).
fn set<T>(slot: &mut Option<T>, value: T, span: Span, what: &str) -> syn::Result<()> {
    if slot.is_some() {
        return Err(syn::Error::new(span, format!("duplicate {what} argument")));
    }
    *slot = Some(value);
    Ok(())
}

/// The `=` after a named argument, with an error on the argument's name if it is missing.
fn expect_eq(input: ParseStream, name: Span, form: &str) -> syn::Result<()> {
    if input.peek(Token![=]) {
        input.parse::<Token![=]>().map(drop)
    } else {
        Err(syn::Error::new(
            name,
            format!("this argument needs a value: `{form}`"),
        ))
    }
}

impl Parse for AutocastArgs {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut policy: Option<TokenStream> = None;
        let mut enabled: Option<Expr> = None;
        let mut output: Option<syn::Ident> = None;
        while !input.is_empty() {
            let lookahead = input.lookahead1();
            if lookahead.peek(kw::fp16) {
                let k: kw::fp16 = input.parse()?;
                let path = Rt::Fp16Policy.at(k.span).into_token_stream();
                set(&mut policy, path, k.span, "policy")?;
            } else if lookahead.peek(kw::bf16) {
                let k: kw::bf16 = input.parse()?;
                let path = Rt::Bf16Policy.at(k.span).into_token_stream();
                set(&mut policy, path, k.span, "policy")?;
            } else if lookahead.peek(kw::policy) {
                let k: kw::policy = input.parse()?;
                expect_eq(input, k.span, "policy = path::To::Policy")?;
                let path: syn::Path = input.parse()?;
                set(&mut policy, quote!(#path), k.span, "policy")?;
            } else if lookahead.peek(kw::enabled) {
                let k: kw::enabled = input.parse()?;
                expect_eq(input, k.span, "enabled = <bool expression>")?;
                let expr: Expr = input.parse()?;
                set(&mut enabled, expr, k.span, "`enabled`")?;
            } else if lookahead.peek(kw::output) {
                let k: kw::output = input.parse()?;
                expect_eq(input, k.span, "output = f32|f16|bf16|input")?;
                let value: syn::Ident = input.parse()?;
                if !["f32", "f16", "bf16", "input"].contains(&value.to_string().as_str()) {
                    return Err(syn::Error::new(
                        value.span(),
                        "output is `f32`, `f16`, `bf16` or `input`",
                    ));
                }
                set(&mut output, value, k.span, "`output`")?;
            } else {
                let mut err = lookahead.error();
                err.combine(syn::Error::new(err.span(), ACCEPTED));
                return Err(err);
            }
            if !input.is_empty() {
                input.parse::<Token![,]>()?;
            }
        }
        Ok(Self {
            policy: policy.map_or(PolicyArg::Inherit, PolicyArg::Named),
            enabled,
            output,
        })
    }
}
