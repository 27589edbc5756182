//! The body rewrite: routes op calls, module calls and free ops through the region's policy.
//!
//! Input:  `let h = self.fc.forward(&x)?.relu()?; Ok(ops::softmax(&h, 1)?)`
//! Output: `let h = Routed::<Pol, _>::new(&(Routed::<Pol, _>::new(&(self.fc))
//!              .__call::<calls::forward, _>((&x,))?)).relu()?;
//!          Ok(region::softmax::<Pol>(&h, 1)?)`
//! (paths abbreviated; every inserted path is `::candle_amp::__private::NAME`, see `runtime.rs`).
//!
//! Nested items are left alone. Closures are rewritten (they run in the region), but a `return`
//! inside one returns from the closure and is not treated as the region's exit. Inside macro
//! calls whose arguments are plain expressions (`vec!`, `println!`, `format!`, `assert*!`,
//! `write*!`, `dbg!`) the arguments are rewritten too; other macros are left as written.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};
use syn::{Attribute, Expr, ExprMacro, Item, Macro, Stmt, Token};

use crate::args::fp32_policy;
use crate::optable;
use crate::runtime::Rt;

/// Macros whose arguments are comma-separated expressions.
const EXPR_MACROS: &[&str] = &[
    "vec",
    "println",
    "print",
    "eprintln",
    "eprint",
    "format",
    "assert",
    "assert_eq",
    "assert_ne",
    "debug_assert",
    "debug_assert_eq",
    "debug_assert_ne",
    "dbg",
    "write",
    "writeln",
    "panic",
];

pub(crate) struct Rewriter {
    /// The policy of the innermost region part being rewritten (`#[keep_fp32]` pushes f32).
    policy: Vec<TokenStream>,
    /// The function wrapping a returned value (`exit` or `exit_to_region`).
    exit: Option<TokenStream>,
    closures: usize,
    pub(crate) errors: Vec<syn::Error>,
}

impl Rewriter {
    pub(crate) fn new(policy: TokenStream, exit: Option<TokenStream>) -> Self {
        Self {
            policy: vec![policy],
            exit,
            closures: 0,
            errors: Vec::new(),
        }
    }

    fn policy(&self) -> &TokenStream {
        self.policy
            .last()
            .expect("the region's own policy is never popped")
    }

    /// Visits `f` under f32 when `attrs` holds `#[keep_fp32]` (which is removed).
    fn with_keep_fp32(&mut self, attrs: &mut Vec<Attribute>, f: impl FnOnce(&mut Self)) {
        let keep = take_marker(attrs, "keep_fp32");
        if keep {
            self.policy.push(fp32_policy());
        }
        f(self);
        if keep {
            self.policy.pop();
        }
    }

    fn rewrite_macro(&mut self, mac: &mut Macro) {
        let Some(name) = mac.path.segments.last().map(|s| s.ident.to_string()) else {
            return;
        };
        if !EXPR_MACROS.contains(&name.as_str()) {
            return;
        }
        let parser = Punctuated::<Expr, Token![,]>::parse_terminated;
        if let Ok(mut exprs) = syn::parse::Parser::parse2(parser, mac.tokens.clone()) {
            for e in &mut exprs {
                self.visit_expr_mut(e);
            }
            mac.tokens = quote!(#exprs);
        }
    }
}

/// Removes a marker attribute (`#[keep_fp32]`) by name; whether it was there.
pub(crate) fn take_marker(attrs: &mut Vec<Attribute>, name: &str) -> bool {
    let before = attrs.len();
    attrs.retain(|a| !a.path().is_ident(name));
    attrs.len() != before
}

impl VisitMut for Rewriter {
    fn visit_item_mut(&mut self, _: &mut Item) {
        // Nested items are not part of the region.
    }

    fn visit_stmt_mut(&mut self, stmt: &mut Stmt) {
        let attrs = match stmt {
            Stmt::Local(local) => &mut local.attrs,
            Stmt::Macro(m) => &mut m.attrs,
            Stmt::Expr(e, _) => match expr_attrs(e) {
                Some(attrs) => attrs,
                None => return visit_mut::visit_stmt_mut(self, stmt),
            },
            Stmt::Item(_) => return,
        };
        let mut taken = std::mem::take(attrs);
        self.with_keep_fp32(&mut taken, |this| {
            visit_mut::visit_stmt_mut(this, stmt);
            if let Stmt::Macro(m) = stmt {
                this.rewrite_macro(&mut m.mac);
            }
        });
        match stmt {
            Stmt::Local(local) => local.attrs = taken,
            Stmt::Macro(m) => m.attrs = taken,
            Stmt::Expr(e, _) => {
                if let Some(attrs) = expr_attrs(e) {
                    *attrs = taken;
                }
            }
            Stmt::Item(_) => {}
        }
    }

    fn visit_expr_closure_mut(&mut self, closure: &mut syn::ExprClosure) {
        self.closures += 1;
        visit_mut::visit_expr_closure_mut(self, closure);
        self.closures -= 1;
    }

    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        if let Expr::Block(block) = expr {
            let mut attrs = std::mem::take(&mut block.attrs);
            self.with_keep_fp32(&mut attrs, |this| {
                visit_mut::visit_expr_block_mut(this, block);
            });
            block.attrs = attrs;
            return;
        }
        visit_mut::visit_expr_mut(self, expr);
        let policy = self.policy().clone();
        let rewritten = match expr {
            Expr::MethodCall(call) => self.method_call(call, &policy),
            Expr::Call(call) => free_op_call(call, &policy),
            Expr::Return(ret) if self.closures == 0 => match (&self.exit, &ret.expr) {
                (Some(exit), Some(value)) => {
                    let span = value.span();
                    Some(quote_spanned!(span=> return #exit(#value)))
                }
                _ => None,
            },
            Expr::Macro(ExprMacro { mac, .. }) => {
                self.rewrite_macro(mac);
                None
            }
            _ => None,
        };
        if let Some(tokens) = rewritten {
            match syn::parse2(tokens) {
                Ok(new) => *expr = new,
                Err(e) => self.errors.push(e),
            }
        }
    }
}

impl Rewriter {
    fn method_call(
        &mut self,
        call: &syn::ExprMethodCall,
        policy: &TokenStream,
    ) -> Option<TokenStream> {
        let name = call.method.to_string();
        let (receiver, method, args) = (&call.receiver, &call.method, &call.args);
        let span = method.span();
        let routed_ty = Rt::Routed.at(span);
        let routed = quote_spanned!(span=> #routed_ty::<#policy, _>::new(&(#receiver)));
        if name == "backward" && args.is_empty() {
            self.errors.push(syn::Error::new(
                span,
                "`.backward()` inside an #[autocast] region: return the loss from the region \
                 and call `.backward()` outside it (PyTorch recommends the same; here it is \
                 enforced)",
            ));
            return None;
        }
        if optable::MODULE_CALLS.contains(&name.as_str()) {
            let args = args.iter();
            let calls = Rt::Calls.at(span);
            return Some(quote_spanned!(span=>
                #routed.__call::<#calls::#method, _>((#(#args,)*))
            ));
        }
        if optable::is_routed_method(&name, args.len()) {
            let turbofish = &call.turbofish;
            return Some(quote_spanned!(span=> #routed.#method #turbofish (#args)));
        }
        None
    }
}

/// `ops::softmax(..)`, `loss::mse(..)`, `Tensor::cat(..)` become the routed region versions.
fn free_op_call(call: &syn::ExprCall, policy: &TokenStream) -> Option<TokenStream> {
    let Expr::Path(path) = &*call.func else {
        return None;
    };
    let segments: Vec<_> = path.path.segments.iter().collect();
    let [.., module, name] = segments.as_slice() else {
        return None;
    };
    let first = segments[0].ident.to_string();
    if first == "candle_nn" || first == "candle_core" {
        return None;
    }
    if !optable::is_free_op(&module.ident.to_string(), &name.ident.to_string()) {
        return None;
    }
    // Keep the user's path up to the module, so that their imports stay used:
    // `ops::softmax(..)` -> `ops::__region::softmax::<Pol>(..)`,
    // `Tensor::cat(..)` -> `Tensor::__region_cat::<Pol, _>(..)`.
    let (ident, args) = (&name.ident, &call.args);
    let mut prefix = path.path.clone();
    prefix.segments.pop();
    let prefix = prefix.segments.iter();
    let leading = path.path.leading_colon;
    Some(if module.ident == "Tensor" {
        let routed = quote::format_ident!("__region_{}", ident, span = ident.span());
        quote_spanned!(ident.span()=> #leading #(#prefix)::* :: #routed::<#policy, _>(#args))
    } else {
        quote_spanned!(ident.span()=> #leading #(#prefix)::* :: __region::#ident::<#policy>(#args))
    })
}

/// The attributes of expression kinds that can carry `#[keep_fp32]` as a statement.
fn expr_attrs(e: &mut Expr) -> Option<&mut Vec<Attribute>> {
    match e {
        Expr::Block(b) => Some(&mut b.attrs),
        Expr::Assign(a) => Some(&mut a.attrs),
        Expr::If(i) => Some(&mut i.attrs),
        Expr::ForLoop(f) => Some(&mut f.attrs),
        Expr::Call(c) => Some(&mut c.attrs),
        Expr::MethodCall(m) => Some(&mut m.attrs),
        Expr::Try(t) => Some(&mut t.attrs),
        _ => None,
    }
}
