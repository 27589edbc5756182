//! What a macro emits when the item has errors: the errors, the item as written, and stand-ins
//! for what other code expects the successful expansion to have declared.
//!
//! The errors alone would leave a hole: an `#[autocast]` module's callers would get a second,
//! misleading "is not autocast-aware" error, and a `policy!`'s users "cannot find type". So the
//! item is kept, and the impls and declarations other code relies on are stubbed with the same
//! shape; their bodies never run, since the crate does not compile.

use proc_macro2::TokenStream;
use quote::quote;
use syn::visit_mut::{self, VisitMut};
use syn::{ImplItem, Item};

use crate::expand::RegionCallHeader;
use crate::model::{is_marker, region_call_sig};
use crate::rewrite::{expr_attrs, take_marker};
use crate::runtime::Rt;

/// The errors and the item as written, for an item none of whose code is generated.
pub(crate) fn item(errors: &syn::Error, original: TokenStream) -> TokenStream {
    let errors = errors.to_compile_error();
    quote!(#errors #original)
}

/// `#[autocast]`, `#[keep_fp32]`, `#[custom_fwd]` with errors:
/// Input:  the errors; the item's tokens; the item, if it parsed
/// Output: the errors; the item without the region markers inside it; for an impl, a stub
///         `RegionCall` impl per module method (`forward`, `forward_t`, `forward_train`)
pub(crate) fn region(
    errors: &syn::Error,
    original: TokenStream,
    item: Option<&Item>,
) -> TokenStream {
    let errors = errors.to_compile_error();
    let Some(item) = item else {
        return quote!(#errors #original);
    };
    let stubs: Vec<_> = match item {
        // A reference's region call is its referent's: a stub would overlap it.
        Item::Impl(imp) if !matches!(&*imp.self_ty, syn::Type::Reference(_)) => imp
            .items
            .iter()
            .filter_map(|item| match item {
                ImplItem::Fn(method) => region_call_sig(&method.sig),
                _ => None,
            })
            .map(|sig| region_call_stub(RegionCallHeader::new(imp, &sig)))
            .collect(),
        _ => Vec::new(),
    };
    // The markers are inert attributes the successful expansion consumes; left in place, each
    // would be one more error (`#[keep_fp32]` on a method or a statement outside a region).
    // Without any, the item goes out as the very tokens it came in as.
    let mut stripped = item.clone();
    let mut strip = StripMarkers { removed: false };
    strip.visit_item_mut(&mut stripped);
    if strip.removed {
        quote!(#errors #stripped #(#stubs)*)
    } else {
        quote!(#errors #original #(#stubs)*)
    }
}

/// A `RegionCall` impl with the header the successful expansion would give: same generics, same
/// argument tuple.
fn region_call_stub(header: RegionCallHeader) -> TokenStream {
    let candle_core = Rt::CandleCore;
    let body = quote!({
        ::core::result::Result::Err(#candle_core::Error::Msg(::std::string::String::from(
            "stand-in for a module whose #[autocast] expansion failed to compile",
        )))
    });
    header.to_impl(false, &body)
}

/// Removes the region markers from an item: a method's `#[keep_fp32]`/`#[autocast(..)]` in an
/// impl, and `#[keep_fp32]` on statements, blocks and closures of the bodies (where the rewrite
/// takes it); and a region's `const`, already reported, whose body would only cascade errors.
struct StripMarkers {
    /// Whether anything was removed (else the item goes out as its original tokens).
    removed: bool,
}

impl StripMarkers {
    fn keep_fp32(&mut self, attrs: &mut Vec<syn::Attribute>) {
        self.removed |= take_marker(attrs, "keep_fp32");
    }
}

impl VisitMut for StripMarkers {
    fn visit_item_mut(&mut self, item: &mut Item) {
        // The item the attribute is on; nested items are not the macro's.
        match item {
            Item::Impl(imp) => {
                for item in &mut imp.items {
                    if let ImplItem::Fn(method) = item {
                        self.removed |= method.sig.constness.take().is_some();
                        let before = method.attrs.len();
                        method.attrs.retain(|attr| !is_marker(attr));
                        self.removed |= method.attrs.len() != before;
                        self.visit_block_mut(&mut method.block);
                    }
                }
            }
            Item::Fn(f) => {
                self.removed |= f.sig.constness.take().is_some();
                self.visit_block_mut(&mut f.block);
            }
            _ => {}
        }
    }

    fn visit_stmt_mut(&mut self, stmt: &mut syn::Stmt) {
        match stmt {
            syn::Stmt::Local(local) => self.keep_fp32(&mut local.attrs),
            syn::Stmt::Macro(m) => self.keep_fp32(&mut m.attrs),
            syn::Stmt::Expr(e, _) => {
                if let Some(attrs) = expr_attrs(e) {
                    self.keep_fp32(attrs);
                }
            }
            // Nested items are not part of the region.
            syn::Stmt::Item(_) => return,
        }
        visit_mut::visit_stmt_mut(self, stmt);
    }

    fn visit_expr_block_mut(&mut self, block: &mut syn::ExprBlock) {
        self.keep_fp32(&mut block.attrs);
        visit_mut::visit_expr_block_mut(self, block);
    }

    fn visit_expr_closure_mut(&mut self, closure: &mut syn::ExprClosure) {
        self.keep_fp32(&mut closure.attrs);
        visit_mut::visit_expr_closure_mut(self, closure);
    }
}
