//! The body rewrite: routes op calls, module calls and free ops through the region's policy.
//!
//! Input:  `let h = self.fc.forward(&x)?.relu()?; Ok(ops::softmax(&h, 1)?)`
//! Output: `let h = Routed::<Pol, _>::new(&(Routed::<Pol, _>::new(&(self.fc))
//!              .__call::<calls::forward, _>((&x,))?)).relu()?;
//!          Ok(region::softmax::<Pol>(&h, 1)?)`
//! (paths abbreviated; every inserted path is `::candle_amp::__private::autocast::...`).
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
        let routed = quote_spanned!(span=>
            ::candle_amp::__private::autocast::Routed::<#policy, _>::new(&(#receiver))
        );
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
            return Some(quote_spanned!(span=>
                #routed.__call::<::candle_amp::__private::autocast::calls::#method, _>((#(#args,)*))
            ));
        }
        if optable::is_routed_method(&name, args.len()) {
            let turbofish = &call.turbofish;
            return Some(quote_spanned!(span=> #routed.#method #turbofish (#args)));
        }
        None
    }
}

/// A call of a free op, routed by what its path resolves to, not by how it is spelt: the
/// macro sees `ops::softmax`, not which `ops` that is.
///
/// Module paths (the segment before the name is lowercase), any spelling of candle-amp's
/// `ops`/`loss` included:
/// Input:  `ops::softmax(&h, 1)`
/// Output: `match (&h, 1,) { (a0, a1,) => {
///              use ops as __amp_routed;
///              { use ops::*; use ::candle_amp::__private::Unrouted as _;
///                __amp_routed::softmax(a0, a1).__amp_policy::<Pol>() } } }`
/// candle-amp's `ops` carries a hidden `__amp_routed` module, which the inner glob brings in and
/// which shadows the outer alias: the routed op runs, deferred until `__amp_policy` applies the
/// region's policy. Any other `ops` (candle-nn's, the user's) has none: `__amp_routed` is that
/// module itself, its function is called as written, and `__amp_policy` is the identity. The
/// arguments are evaluated outside the glob's block, so the glob never shadows a name in them,
/// and are passed to the real function, so coercions (`&vec` to a slice) still apply.
///
/// `Tensor::cat`/`stack` (a type path, which cannot be glob-imported): candle-amp's `Tensor` has
/// the inherent `__amp_routed_cat`, which takes precedence over the trait `ForeignJoin` that
/// gives `candle_core::Tensor` the same name for its own `cat`.
fn free_op_call(call: &syn::ExprCall, policy: &TokenStream) -> Option<TokenStream> {
    let Expr::Path(path) = &*call.func else {
        return None;
    };
    if path.qself.is_some() {
        return None;
    }
    let mut prefix = path.path.clone();
    let name = prefix.segments.pop()?.into_value();
    let owner = prefix.segments.last()?;
    let module = optable::free_module(&name.ident.to_string())?;
    let rt = quote!(::candle_amp::__private);
    let args: Vec<_> = call.args.iter().collect();
    let binds: Vec<_> = (0..args.len())
        .map(|i| quote::format_ident!("__amp_a{}", i, span = proc_macro2::Span::mixed_site()))
        .collect();
    let span = name.ident.span();
    let ident = &name.ident;
    let prefix = {
        // `a::b::` without the trailing separator.
        let mut p = prefix.clone();
        if let Some(last) = p.segments.pop() {
            p.segments.push_value(last.into_value());
        }
        p
    };
    let routed = if module == optable::Free::Tensor {
        if owner.ident != "Tensor" {
            return None;
        }
        let joined = quote::format_ident!("__amp_routed_{}", ident, span = span);
        quote_spanned!(span=> {
            #[allow(unused_imports)]
            use #rt::{ForeignJoin as _, Unrouted as _};
            #prefix::#joined(#(#binds),*).__amp_policy::<#policy>()
        })
    } else {
        // A module: lowercase, not a path keyword (`self::f` is the user's own function).
        let owner_name = owner.ident.to_string();
        let module_like = owner_name.starts_with(|c: char| c.is_lowercase())
            && !["self", "super", "crate"].contains(&owner_name.as_str());
        if !module_like || !owner.arguments.is_none() {
            return None;
        }
        let alias = syn::Ident::new("__amp_routed", span);
        quote_spanned!(span=> {
            #[allow(unused_imports)]
            use #prefix as #alias;
            {
                #[allow(unused_imports, clippy::wildcard_imports)]
                use #prefix::*;
                #[allow(unused_imports)]
                use #rt::Unrouted as _;
                #alias::#ident(#(#binds),*).__amp_policy::<#policy>()
            }
        })
    };
    Some(quote_spanned!(span=> match (#(#args,)*) { (#(#binds,)*) => #routed }))
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
