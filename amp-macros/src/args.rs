//! Attribute arguments, parsed as written: `#[autocast(...)]` and `#[custom_fwd(...)]`.
//!
//! `#[autocast]` accepts `fp16`, `bf16`, `policy = path::To::Policy`, each optionally with
//! `enabled = <bool expr>`, `cache = <bool expr>` and `output = f32|f16|bf16|input`; or no
//! arguments at all (inherit the caller's policy). `#[custom_fwd]` accepts nothing or `cast_inputs = f32|f16|bf16`.
//!
//! Parsing checks syntax only and keeps every argument with its tokens. The rules about values
//! (one policy, a known `output`, a known precision) are checked in `validate.rs`, so that
//! `#[autocast(fp16, bf16, output = f8)]` reports both mistakes, not only the first.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::parse::{Parse, ParseStream};
use syn::{Expr, Ident, Token};

mod kw {
    syn::custom_keyword!(fp16);
    syn::custom_keyword!(bf16);
    syn::custom_keyword!(policy);
    syn::custom_keyword!(enabled);
    syn::custom_keyword!(output);
    syn::custom_keyword!(cache);
    syn::custom_keyword!(cast_inputs);
}

pub(crate) const ACCEPTED: &str = "accepted forms: `#[autocast]` (inherit the caller's policy), \
     `#[autocast(fp16)]`, `#[autocast(bf16)]`, `#[autocast(policy = path::To::Policy)]`, \
     each optionally with `, enabled = <bool expression>`, `, cache = <bool expression>` and \
     `, output = f32|f16|bf16|input`";

/// One `#[autocast(..)]` argument, with its keyword (errors about the argument point there).
pub(crate) enum AutocastArg {
    Fp16(kw::fp16),
    Bf16(kw::bf16),
    Policy { kw: kw::policy, path: syn::Path },
    Enabled { kw: kw::enabled, expr: Expr },
    Cache { kw: kw::cache, expr: Expr },
    Output { kw: kw::output, value: Ident },
}

impl AutocastArg {
    /// The argument's keyword.
    pub(crate) fn keyword(&self) -> TokenStream {
        match self {
            Self::Fp16(k) => k.to_token_stream(),
            Self::Bf16(k) => k.to_token_stream(),
            Self::Policy { kw, .. } => kw.to_token_stream(),
            Self::Enabled { kw, .. } => kw.to_token_stream(),
            Self::Cache { kw, .. } => kw.to_token_stream(),
            Self::Output { kw, .. } => kw.to_token_stream(),
        }
    }
}

/// `#[autocast(..)]`'s arguments in the order written, repeats included: validation reports a
/// repeat, and the accessors below read the first occurrence.
#[derive(Default)]
pub(crate) struct AutocastArgs {
    pub(crate) list: Vec<AutocastArg>,
}

/// Where a region's policy comes from.
#[derive(Clone, Copy)]
pub(crate) enum PolicyArg<'a> {
    /// No policy argument: a module inherits its caller's policy; called from outside any region
    /// it runs in f32.
    Inherit,
    /// `fp16`, at its keyword.
    Fp16(Span),
    /// `bf16`, at its keyword.
    Bf16(Span),
    /// `policy = path::To::Policy`.
    Named(&'a syn::Path),
}

impl AutocastArgs {
    pub(crate) fn policy(&self) -> PolicyArg<'_> {
        self.list
            .iter()
            .find_map(|arg| match arg {
                AutocastArg::Fp16(k) => Some(PolicyArg::Fp16(k.span)),
                AutocastArg::Bf16(k) => Some(PolicyArg::Bf16(k.span)),
                AutocastArg::Policy { path, .. } => Some(PolicyArg::Named(path)),
                AutocastArg::Enabled { .. }
                | AutocastArg::Cache { .. }
                | AutocastArg::Output { .. } => None,
            })
            .unwrap_or(PolicyArg::Inherit)
    }

    /// `enabled = <bool expr>`: false runs the region's plain f32 path.
    pub(crate) fn enabled(&self) -> Option<&Expr> {
        self.list.iter().find_map(|arg| match arg {
            AutocastArg::Enabled { expr, .. } => Some(expr),
            _ => None,
        })
    }

    /// `cache = <bool expr>`: false turns the weight-cast cache off for the region part and what
    /// it calls (PyTorch's `cache_enabled=False`).
    pub(crate) fn cache(&self) -> Option<&Expr> {
        self.list.iter().find_map(|arg| match arg {
            AutocastArg::Cache { expr, .. } => Some(expr),
            _ => None,
        })
    }

    /// `output = f32|f16|bf16|input`: an assertion on the precision the signature returns.
    pub(crate) fn output(&self) -> Option<&Ident> {
        self.list.iter().find_map(|arg| match arg {
            AutocastArg::Output { value, .. } => Some(value),
            _ => None,
        })
    }
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
        let mut list = Vec::new();
        while !input.is_empty() {
            let lookahead = input.lookahead1();
            list.push(if lookahead.peek(kw::fp16) {
                AutocastArg::Fp16(input.parse()?)
            } else if lookahead.peek(kw::bf16) {
                AutocastArg::Bf16(input.parse()?)
            } else if lookahead.peek(kw::policy) {
                let kw: kw::policy = input.parse()?;
                expect_eq(input, kw.span, "policy = path::To::Policy")?;
                let path = input.parse()?;
                AutocastArg::Policy { kw, path }
            } else if lookahead.peek(kw::enabled) {
                let kw: kw::enabled = input.parse()?;
                expect_eq(input, kw.span, "enabled = <bool expression>")?;
                let expr = input.parse()?;
                AutocastArg::Enabled { kw, expr }
            } else if lookahead.peek(kw::cache) {
                let kw: kw::cache = input.parse()?;
                expect_eq(input, kw.span, "cache = <bool expression>")?;
                let expr = input.parse()?;
                AutocastArg::Cache { kw, expr }
            } else if lookahead.peek(kw::output) {
                let kw: kw::output = input.parse()?;
                expect_eq(input, kw.span, "output = f32|f16|bf16|input")?;
                let value = input.parse()?;
                AutocastArg::Output { kw, value }
            } else {
                let mut err = lookahead.error();
                err.combine(syn::Error::new(err.span(), ACCEPTED));
                return Err(err);
            });
            if !input.is_empty() {
                input.parse::<Token![,]>()?;
            }
        }
        Ok(Self { list })
    }
}

/// `#[custom_fwd]` or `#[custom_fwd(cast_inputs = f32|f16|bf16)]`; the precision as written
/// (validation checks it is one of the three).
#[derive(Default)]
pub(crate) struct CustomFwdArgs {
    pub(crate) cast_inputs: Option<Ident>,
}

impl Parse for CustomFwdArgs {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        if input.is_empty() {
            return Ok(Self { cast_inputs: None });
        }
        input.parse::<kw::cast_inputs>().map_err(|e| {
            syn::Error::new(
                e.span(),
                "accepted forms: `#[custom_fwd]`, `#[custom_fwd(cast_inputs = f32)]` (or f16, bf16)",
            )
        })?;
        input.parse::<Token![=]>()?;
        let precision: Ident = input.parse()?;
        if !input.is_empty() {
            return Err(syn::Error::new(
                input.span(),
                "unexpected argument after cast_inputs",
            ));
        }
        Ok(Self {
            cast_inputs: Some(precision),
        })
    }
}
