//! `policy!`: a policy declared at compile time.
//!
//! Input:
//! ```text
//! policy! {
//!     /// Softmax stays in f16 for a fused attention kernel; gelu runs in f32.
//!     pub struct AttentionPolicy: fp16 {
//!         softmax: lower_precision,
//!         gelu: fp32,
//!     }
//! }
//! ```
//! Output: a unit struct `AttentionPolicy` and `impl Policy for AttentionPolicy` whose `class`
//! returns the moved class for those ops (compared by `TypeId`, folded at compile time) and the
//! declared class for every other op. Op names resolve as `::candle_amp::__private::op::NAME`,
//! so a misspelt op is a "cannot find type" error on the user's token.
//!
//! The same phases as the attribute macros: parsing (syntax only, keeping the tokens), then
//! validation collecting every error, then code generation that cannot fail. On an error, once
//! the struct's name is known, the struct and a default `impl Policy` are still emitted (see
//! `fallback.rs`), so that `#[autocast(policy = AttentionPolicy)]` elsewhere does not add errors
//! of its own.

use std::collections::BTreeMap;

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::parse::{ParseStream, Parser};
use syn::{braced, Attribute, Ident, Token, Visibility};

use crate::errors::{once, Errors};
use crate::runtime::Rt;

/// What precedes the moves: enough for the fallback to declare the policy.
pub(crate) struct Header {
    pub(crate) attrs: Vec<Attribute>,
    pub(crate) vis: Visibility,
    pub(crate) name: Ident,
    /// The lower dtype as written, once parsed.
    pub(crate) lower: Option<Ident>,
}

impl Header {
    /// The lower precision, if the declared one is valid.
    pub(crate) fn lower_precision(&self) -> Option<Rt> {
        match self.lower.as_ref()?.to_string().as_str() {
            "fp16" => Some(Rt::F16),
            "bf16" => Some(Rt::BF16),
            _ => None,
        }
    }
}

/// `op: class`, as written.
struct Move {
    op: Ident,
    class: Ident,
}

const CLASSES: &[(&str, &str)] = &[
    ("lower_precision", "LowerPrecision"),
    ("fp32", "Fp32"),
    ("promote", "Promote"),
    ("preserve", "Preserve"),
];

const FORM: &str = "expected `policy! { pub struct Name: fp16 { op: class, ... } }` with a \
     lower dtype `fp16` or `bf16` and classes `lower_precision`, `fp32`, `promote`, `preserve`";

/// Parses the declaration into its moves; `header` receives what precedes them as soon as the
/// struct's name is read, so that it is there for the fallback after a later syntax error.
fn parse(input: ParseStream, header: &mut Option<Header>) -> syn::Result<Vec<Move>> {
    let attrs = input.call(Attribute::parse_outer)?;
    let vis: Visibility = input.parse()?;
    input
        .parse::<Token![struct]>()
        .map_err(|e| syn::Error::new(e.span(), FORM))?;
    let name: Ident = input.parse()?;
    let header = header.insert(Header {
        attrs,
        vis,
        name,
        lower: None,
    });
    input.parse::<Token![:]>()?;
    header.lower = Some(input.parse()?);
    let body;
    braced!(body in input);
    let mut moves = Vec::new();
    while !body.is_empty() {
        let op: Ident = body.parse()?;
        body.parse::<Token![:]>()?;
        let class: Ident = body.parse()?;
        moves.push(Move { op, class });
        if !body.is_empty() {
            body.parse::<Token![,]>()?;
        }
    }
    Ok(moves)
}

fn validate(header: &Header, moves: &[Move]) -> syn::Result<()> {
    let mut errors = Errors::default();
    if let Some(lower) = &header.lower {
        if header.lower_precision().is_none() {
            errors.at(
                lower.span(),
                "the lower dtype of a policy is `fp16` or `bf16`",
            );
        }
    }
    let mut moved = BTreeMap::new();
    for Move { op, class } in moves {
        if !CLASSES.iter().any(|(c, _)| class == c) {
            errors.at(
                class.span(),
                "unknown op class: use `lower_precision`, `fp32`, `promote` or `preserve`",
            );
        }
        let first = moved.entry(op.to_string()).or_insert(None);
        once(first, (), op, &mut errors, |(), ()| {
            format!("`{op}` is moved twice")
        });
    }
    errors.finish()
}

pub(crate) fn expand(input: TokenStream) -> TokenStream {
    let mut header = None;
    let moves = (|input: ParseStream| parse(input, &mut header)).parse2(input);
    let Some(header) = header else {
        // A syntax error before the struct's name: nothing to declare, the error alone.
        return match moves {
            Err(errors) => errors.into_compile_error(),
            Ok(_) => TokenStream::new(),
        };
    };
    match moves.and_then(|moves| validate(&header, &moves).map(|()| moves)) {
        Ok(moves) => {
            // Invariant established by validation: the lower dtype is `fp16` or `bf16`.
            let lower = header
                .lower_precision()
                .expect("validated: the lower dtype is fp16 or bf16");
            generate(&header, lower, &moves)
        }
        Err(errors) => fallback(&errors, &header),
    }
}

/// `policy!` with errors, once the struct's name is known: the struct and an `impl Policy` with
/// the declared lower dtype (fp16 when it is not known) and every op in its declared class.
fn fallback(errors: &syn::Error, header: &Header) -> TokenStream {
    let errors = errors.to_compile_error();
    let declared = generate_default(header, header.lower_precision().unwrap_or(Rt::F16));
    quote!(#errors #declared)
}

/// The struct and its `impl Policy`, with `moves` (none: every op in its declared class).
pub(crate) fn generate_default(header: &Header, lower: Rt) -> TokenStream {
    generate(header, lower, &[])
}

fn generate(header: &Header, lower: Rt, moves: &[Move]) -> TokenStream {
    let Header {
        attrs, vis, name, ..
    } = header;
    let (policy, op) = (Rt::Policy, Rt::Op);
    let arms = moves.iter().map(|Move { op: op_name, class }| {
        // Invariant established by validation: every class is one of `CLASSES`.
        let variant = CLASSES
            .iter()
            .find(|(c, _)| class == c)
            .map(|(_, v)| Ident::new(v, class.span()))
            .expect("validated: a known op class");
        let marker = quote_spanned!(op_name.span()=> #op::#op_name);
        quote! {
            if op == ::core::any::TypeId::of::<#marker>() {
                return #op::OpClass::#variant;
            }
        }
    });
    let label = name.to_string();
    quote! {
        #(#attrs)*
        #[derive(Clone, Copy, Debug, Default)]
        #vis struct #name;

        impl #policy for #name {
            type Lower = #lower;
            const NAME: &'static str = #label;
            fn class_of(
                op: ::core::any::TypeId,
                declared: #op::OpClass,
            ) -> #op::OpClass {
                #(#arms)*
                declared
            }
        }
    }
}
