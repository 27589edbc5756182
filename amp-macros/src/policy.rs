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

use crate::runtime::Rt;
use proc_macro2::TokenStream;
use quote::quote;
use syn::parse::{Parse, ParseStream};
use syn::{braced, Attribute, Ident, Token, Visibility};

pub(crate) struct PolicyDef {
    attrs: Vec<Attribute>,
    vis: Visibility,
    name: Ident,
    lower: Ident,
    moves: Vec<(Ident, Ident)>,
}

const CLASSES: &[(&str, &str)] = &[
    ("lower_precision", "LowerPrecision"),
    ("fp32", "Fp32"),
    ("promote", "Promote"),
    ("preserve", "Preserve"),
];

const FORM: &str = "expected `policy! { pub struct Name: fp16 { op: class, ... } }` with a \
     lower dtype `fp16` or `bf16` and classes `lower_precision`, `fp32`, `promote`, `preserve`";

impl Parse for PolicyDef {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis: Visibility = input.parse()?;
        input
            .parse::<Token![struct]>()
            .map_err(|e| syn::Error::new(e.span(), FORM))?;
        let name: Ident = input.parse()?;
        input.parse::<Token![:]>()?;
        let lower: Ident = input.parse()?;
        if lower != "fp16" && lower != "bf16" {
            return Err(syn::Error::new(
                lower.span(),
                "the lower dtype of a policy is `fp16` or `bf16`",
            ));
        }
        let body;
        braced!(body in input);
        let mut moves: Vec<(Ident, Ident)> = Vec::new();
        while !body.is_empty() {
            let op: Ident = body.parse()?;
            body.parse::<Token![:]>()?;
            let class: Ident = body.parse()?;
            if !CLASSES.iter().any(|(c, _)| class == c) {
                return Err(syn::Error::new(
                    class.span(),
                    "unknown op class: use `lower_precision`, `fp32`, `promote` or `preserve`",
                ));
            }
            if moves.iter().any(|(seen, _)| *seen == op) {
                return Err(syn::Error::new(op.span(), format!("`{op}` is moved twice")));
            }
            moves.push((op, class));
            if !body.is_empty() {
                body.parse::<Token![,]>()?;
            }
        }
        Ok(Self {
            attrs,
            vis,
            name,
            lower,
            moves,
        })
    }
}

pub(crate) fn expand(input: TokenStream) -> TokenStream {
    match syn::parse2::<PolicyDef>(input) {
        Ok(def) => generate(&def),
        Err(e) => e.into_compile_error(),
    }
}

fn generate(def: &PolicyDef) -> TokenStream {
    let PolicyDef {
        attrs,
        vis,
        name,
        lower,
        moves,
    } = def;
    let (policy, op) = (Rt::Policy, Rt::Op);
    let lower_ty = if lower == "fp16" { Rt::F16 } else { Rt::BF16 };
    let arms = moves.iter().map(|(op_name, class)| {
        let variant = CLASSES
            .iter()
            .find(|(c, _)| class == c)
            .map(|(_, v)| Ident::new(v, class.span()))
            .expect("validated while parsing");
        let marker = quote::quote_spanned!(op_name.span()=> #op::#op_name);
        quote! {
            if ::core::any::TypeId::of::<O>() == ::core::any::TypeId::of::<#marker>() {
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
            type Lower = #lower_ty;
            const NAME: &'static str = #label;
            fn class<O: #op::Op>() -> #op::OpClass {
                #(#arms)*
                <O as #op::Op>::CLASS
            }
        }
    }
}
