//! Error collection shared by every phase: all errors of an item combined into one
//! (`syn::Error::combine`), and the one rule for arguments given twice.

use std::fmt::Display;

use proc_macro2::Span;
use quote::ToTokens;

/// Errors collected across a whole item.
#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    pub(crate) fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    pub(crate) fn at(&mut self, span: Span, message: impl Display) {
        self.push(syn::Error::new(span, message));
    }

    /// An error over all of `tokens` (rustc underlines from their first to their last token).
    pub(crate) fn spanned(&mut self, tokens: impl ToTokens, message: impl Display) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    pub(crate) fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

/// The one rule for anything that may be given once (an attribute argument, a method's marker,
/// a policy's move of an op): the first occurrence is the one used, and each later one is an
/// error on its own tokens, so a repeat is reported once, where the user added it.
pub(crate) fn once<K: Copy>(
    first: &mut Option<K>,
    this: K,
    at: impl ToTokens,
    errors: &mut Errors,
    message: impl FnOnce(K, K) -> String,
) {
    match *first {
        Some(first) => errors.spanned(at, message(first, this)),
        None => *first = Some(this),
    }
}
