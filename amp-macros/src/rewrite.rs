//! The body rewrite: routes op calls, module calls and free ops through the region's policy.
//!
//! Input:  `let h = self.fc.forward(&x)?.relu()?; Ok(ops::softmax(&h, 1)?)`
//! Output: `let h = Routed::<Pol, _>::new(&(Routed::<Pol, _>::new(&(self.fc))
//!              .__call::<calls::forward, _>((&x,))?)).relu()?;
//!          Ok(ops::__region::softmax::<Pol>(&h, 1)?)`
//! (paths abbreviated; every inserted path is `::candle_amp::__private::NAME`, see `runtime.rs`).
//!
//! Nested items are left alone. Closures are rewritten (they run in the region), but a `return`
//! inside one returns from the closure and is not treated as the region's exit. Inside macro
//! calls whose arguments are plain expressions (`vec!`, `println!`, `format!`, `assert*!`,
//! `write*!`, `dbg!`) the arguments are rewritten too; other macros are left as written.
//!
//! The rewrite cannot fail: what could make a body unfit for it (`.backward()` in a region) is
//! rejected by validation first, and rewritten expressions are spliced in as tokens
//! (`Expr::Verbatim`) instead of being parsed back. Every rewritten expression is a method call
//! or a call, a postfix expression, so splicing it where the original stood keeps precedence.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned, ToTokens};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};
use syn::{Attribute, Block, Expr, ExprMacro, Item, Macro, Stmt, Token};

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

/// The arguments of an expression macro (`vec![..]`, `println!(..)`, ...), if `mac` is one and
/// its arguments parse as expressions; the rewrite and validation visit the same ones.
pub(crate) fn expr_macro_args(mac: &Macro) -> Option<Punctuated<Expr, Token![,]>> {
    let name = mac.path.segments.last()?.ident.to_string();
    if !EXPR_MACROS.contains(&name.as_str()) {
        return None;
    }
    let parser = Punctuated::<Expr, Token![,]>::parse_terminated;
    syn::parse::Parser::parse2(parser, mac.tokens.clone()).ok()
}

/// Input:  a region body `{ stmts; tail }`, the policy it runs under, how a returned value leaves
/// Output: the body with its op calls, module calls, free ops and `return`s routed
pub(crate) fn body(block: &Block, policy: TokenStream, exit: Option<Rt>) -> Block {
    let mut body = block.clone();
    Rewriter {
        policy,
        kept_fp32: 0,
        exit,
        closures: 0,
    }
    .visit_block_mut(&mut body);
    body
}

struct Rewriter {
    /// The policy of the region part being rewritten.
    policy: TokenStream,
    /// How many `#[keep_fp32]` statements or blocks enclose the current expression: inside
    /// one, ops run under the f32 policy.
    kept_fp32: usize,
    /// The function wrapping a returned value (`exit` or `exit_to_region`).
    exit: Option<Rt>,
    closures: usize,
}

impl Rewriter {
    fn policy(&self) -> TokenStream {
        if self.kept_fp32 > 0 {
            Rt::Fp32Policy.into_token_stream()
        } else {
            self.policy.clone()
        }
    }

    /// Visits `f` under f32 when `attrs` holds `#[keep_fp32]` (which is removed).
    fn with_keep_fp32(&mut self, attrs: &mut Vec<Attribute>, f: impl FnOnce(&mut Self)) {
        let keep = take_marker(attrs, "keep_fp32");
        self.kept_fp32 += usize::from(keep);
        f(self);
        self.kept_fp32 -= usize::from(keep);
    }

    /// Input:  `vec![x.relu()?, y]`
    /// Output: `vec![Routed::<Pol, _>::new(&(x)).relu()?, y]`
    fn rewrite_macro(&mut self, mac: &mut Macro) {
        if let Some(mut exprs) = expr_macro_args(mac) {
            for e in &mut exprs {
                self.visit_expr_mut(e);
            }
            mac.tokens = quote!(#exprs);
        }
    }

    /// Input:  `x.matmul(&w)`, `m.forward(&x, train)`
    /// Output: `Routed::<Pol, _>::new(&(x)).matmul(&w)`,
    ///         `Routed::<Pol, _>::new(&(m)).__call::<calls::forward, _>((&x, train,))`;
    ///         `None` for a method that is neither an op nor a module call
    fn method_call(call: &syn::ExprMethodCall, policy: &TokenStream) -> Option<TokenStream> {
        let name = call.method.to_string();
        let (receiver, method, args) = (&call.receiver, &call.method, &call.args);
        // The inserted tokens carry the method's span, so that rustc's errors about the routed
        // call point at the method the user wrote.
        let span = method.span();
        let routed = Rt::Routed.at(span);
        let routed = quote_spanned!(span=> #routed::<#policy, _>::new(&(#receiver)));
        if optable::MODULE_CALLS.contains(&name.as_str()) {
            let calls = Rt::Calls.at(span);
            let args = args.iter();
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
        // Taken out while visiting, so that `#[keep_fp32]` scopes the whole statement; the
        // other attributes go back afterwards.
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
            Stmt::Expr(e, _) => restore_attrs(e, taken),
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
        // Innermost first: a routed call's receiver and arguments are already rewritten.
        visit_mut::visit_expr_mut(self, expr);
        let policy = self.policy();
        let rewritten = match expr {
            Expr::MethodCall(call) => Self::method_call(call, &policy),
            Expr::Call(call) => free_op_call(call, &policy),
            Expr::Return(ret) if self.closures == 0 => {
                if let (Some(exit), Some(value)) = (self.exit, &mut ret.expr) {
                    // Input: `return v`  Output: `return exit(v)`, the `return` kept as written.
                    let span = value.span();
                    let wrapped = quote_spanned!(span=> #exit(#value));
                    **value = Expr::Verbatim(wrapped);
                }
                None
            }
            Expr::Macro(ExprMacro { mac, .. }) => {
                self.rewrite_macro(mac);
                None
            }
            _ => None,
        };
        if let Some(tokens) = rewritten {
            *expr = Expr::Verbatim(tokens);
        }
    }
}

/// Input:  `ops::softmax(&h, 1)`, `loss::mse(&p, &t)`, `Tensor::cat(&[&a, &b], 1)`
/// Output: `ops::__region::softmax::<Pol>(&h, 1)`, `loss::__region::mse::<Pol>(&p, &t)`,
///         `Tensor::__region_cat::<Pol, _>(&[&a, &b], 1)`; `None` for any other call
fn free_op_call(call: &syn::ExprCall, policy: &TokenStream) -> Option<TokenStream> {
    let Expr::Path(path) = &*call.func else {
        return None;
    };
    let segments: Vec<_> = path.path.segments.iter().collect();
    let [.., module, name] = segments.as_slice() else {
        return None;
    };
    // candle's own functions of the same names are not the typed API's.
    if let Some(first) = path.path.segments.first() {
        if first.ident == "candle_nn" || first.ident == "candle_core" {
            return None;
        }
    }
    if !optable::is_free_op(&module.ident.to_string(), &name.ident.to_string()) {
        return None;
    }
    // Keep the user's path up to the module, so that their imports stay used.
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
pub(crate) fn expr_attrs(e: &mut Expr) -> Option<&mut Vec<Attribute>> {
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

/// Puts a statement's remaining attributes back on its expression. A statement rewritten into
/// tokens has no attribute slot any more, so they go in front of the tokens, which is where
/// they stood in the source.
fn restore_attrs(e: &mut Expr, attrs: Vec<Attribute>) {
    if let Some(slot) = expr_attrs(e) {
        *slot = attrs;
    } else if let Expr::Verbatim(tokens) = e {
        if !attrs.is_empty() {
            *tokens = quote!(#(#attrs)* #tokens);
        }
    }
}
