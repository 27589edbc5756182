//! The body rewrite: routes op calls, module calls and free ops through the region's policy.
//!
//! Input:  `let h = self.fc.forward(&x)?.relu()?; Ok(ops::softmax(&h, 1)?)`
//! Output: `let h = Routed::<Pol, _>::new(&({ use module_call::{..};
//!              (self.fc).__amp_forward(PhantomData::<Pol>, (&x,)) }?)).relu()?;
//!          Ok(match (&h, 1) { .. __amp_routed::softmax(..).__amp_policy::<Pol>() }?)`
//! (paths abbreviated; every inserted path is `::candle_amp::__private::NAME`, see `runtime.rs`).
//!
//! Nested items are left alone. Closures are rewritten (they run in the region), but a `return`
//! inside one returns from the closure and is not treated as the region's exit. Inside macro
//! calls whose arguments are plain expressions (`vec!`, `println!`, `format!`, `assert*!`,
//! `write*!`, `dbg!`) the arguments are rewritten too, and so is the expression `matches!`
//! tests (its pattern is left as written); other macros are left as written.
//!
//! The rewrite cannot fail: what could make a body unfit for it (`.backward()` in a region) is
//! rejected by validation first, and rewritten expressions are spliced in as tokens
//! (`Expr::Verbatim`) instead of being parsed back. Every rewritten expression is a method call
//! or a call, a postfix expression, or (a free op) a `match` in an invisible group, so splicing
//! it where the original stood keeps precedence.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned, ToTokens};
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

/// The expressions among a macro call's arguments that a region sees into, and what follows
/// them as written.
pub(crate) struct MacroArgs {
    pub exprs: Punctuated<Expr, Token![,]>,
    /// `matches!`'s pattern (and guard); empty for the expression macros.
    pub tail: TokenStream,
}

/// The arguments of an expression macro (`vec![..]`, `println!(..)`, ...), if `mac` is one and
/// its arguments parse as expressions, or the tested expression of `matches!(expr, pattern)`;
/// the rewrite and validation visit the same ones.
pub(crate) fn expr_macro_args(mac: &Macro) -> Option<MacroArgs> {
    let name = mac.path.segments.last()?.ident.to_string();
    if name == "matches" {
        let parser = |input: syn::parse::ParseStream| -> syn::Result<MacroArgs> {
            let mut exprs = Punctuated::new();
            exprs.push_value(input.parse::<Expr>()?);
            exprs.push_punct(input.parse::<Token![,]>()?);
            let tail = input.parse::<TokenStream>()?;
            Ok(MacroArgs { exprs, tail })
        };
        return syn::parse::Parser::parse2(parser, mac.tokens.clone()).ok();
    }
    if !EXPR_MACROS.contains(&name.as_str()) {
        return None;
    }
    let parser = Punctuated::<Expr, Token![,]>::parse_terminated;
    let exprs = syn::parse::Parser::parse2(parser, mac.tokens.clone()).ok()?;
    Some(MacroArgs {
        exprs,
        tail: TokenStream::new(),
    })
}

/// How a region part's returned values (its tail and each `return`) leave it.
#[derive(Clone)]
pub(crate) enum Exit {
    /// Passed to a function: a module's `exit_to_region::<R, _, _>`.
    Call(TokenStream),
    /// Through the leaving probe (`region/exit.rs`), as the declared type.
    Leave(Box<syn::Type>),
}

impl Exit {
    /// The binding of the part's `Leave`, decided at its entry.
    pub(crate) fn leave_binding() -> syn::Ident {
        syn::Ident::new("__amp_leave", proc_macro2::Span::mixed_site())
    }

    /// Input:  `v` (at `span`)
    /// Output: `exit_to_region::<R, _, _>(v)`, or `{ let value = v; use ..; (&&&Leaving::<D,
    ///         _>::new(value, __amp_leave)).__amp_leave() }`: Rust's method probe picks the way
    ///         out by the value's and the declared type's types
    pub(crate) fn wrap(&self, span: proc_macro2::Span, value: impl ToTokens) -> TokenStream {
        match self {
            Self::Call(f) => quote_spanned!(span=> #f(#value)),
            Self::Leave(declared) => {
                let (leaving, leave) = (Rt::Leaving.at(span), Self::leave_binding());
                let ways = [
                    Rt::LeaveConverted,
                    Rt::LeaveAsIs,
                    Rt::LeaveAsDeclared,
                    Rt::LeaveUnsupported,
                ]
                .map(|w| w.at(span));
                let v = syn::Ident::new("__amp_value", proc_macro2::Span::mixed_site());
                // The value is computed before the traits come into scope, in a block of its
                // own (items after a statement would trip `items_after_statements`).
                quote_spanned!(span=> {
                    let #v = #value;
                    {
                        #(
                            #[allow(unused_imports)]
                            use #ways as _;
                        )*
                        (&&&#leaving::<#declared, _>::new(#v, #leave)).__amp_leave()
                    }
                })
            }
        }
    }
}

/// Input:  a region body `{ stmts; tail }`, the policy it runs under, how a returned value leaves
/// Output: the body with its op calls, module calls, free ops and `return`s routed
pub(crate) fn body(
    block: &Block,
    policy: TokenStream,
    exit: Option<Exit>,
    function: &str,
) -> Block {
    let mut body = block.clone();
    // Input:  `{ ..; return e; }`  Output: `{ ..; e }`: the same at the end of a body, and the
    // region's exit can take the value's type from it (a block ending in `return` has none).
    if let Some(Stmt::Expr(Expr::Return(ret), Some(_))) = body.stmts.last() {
        if let Some(value) = &ret.expr {
            let mut value = (**value).clone();
            if let Some(attrs) = own_attrs(&mut value) {
                attrs.splice(0..0, ret.attrs.iter().cloned());
            } else if !ret.attrs.is_empty() {
                value = Expr::Block(syn::ExprBlock {
                    attrs: ret.attrs.clone(),
                    label: None,
                    block: syn::parse_quote!({ #value }),
                });
            }
            if let Some(last) = body.stmts.last_mut() {
                *last = Stmt::Expr(value, None);
            }
        }
    }
    Rewriter {
        policy,
        kept_fp32: 0,
        exit,
        closures: 0,
        function: function.to_string(),
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
    /// How a returned value leaves.
    exit: Option<Exit>,
    closures: usize,
    /// The region part's name, for the sites of its op calls.
    function: String,
}

impl Rewriter {
    /// Inside a closure, the policy of the region part running where the closure is called, as
    /// for a helper fn: a closure written in an fp16 region and called from a `#[keep_fp32]`
    /// statement runs in f32, as the statement says, and one written in a `#[keep_fp32]` block
    /// and called after it runs in fp16 (a closure marked `#[keep_fp32]` itself pushes f32 in
    /// its own body).
    fn policy(&self) -> TokenStream {
        if self.closures > 0 {
            // Also a closure written in a `#[keep_fp32]` part: that part pushes f32 while it
            // runs, so a call there runs in f32, and a call after it in the region's policy.
            Rt::CallerPolicy.into_token_stream()
        } else if self.kept_fp32 > 0 {
            Rt::Fp32Policy.into_token_stream()
        } else {
            self.policy.clone()
        }
    }

    /// Visits `f` under f32 when `attrs` holds `#[keep_fp32]` (which is removed); whether it did.
    fn with_keep_fp32(&mut self, attrs: &mut Vec<Attribute>, f: impl FnOnce(&mut Self)) -> bool {
        let keep = take_marker(attrs, "keep_fp32");
        self.kept_fp32 += usize::from(keep);
        f(self);
        self.kept_fp32 -= usize::from(keep);
        keep
    }

    /// A routed call written at `span`, marked with its site (`at_site`).
    fn at_site(&self, span: proc_macro2::Span, call: TokenStream) -> TokenStream {
        at_site(span, &self.function, call)
    }

    /// Input:  `vec![x.relu()?, y]`, `matches!(x.relu()?.dims(), [_, 2])`
    /// Output: `vec![Routed::<Pol, _>::new(&(x)).relu()?, y]`,
    ///         `matches!(Routed::<Pol, _>::new(&(x)).relu()?.dims(), [_, 2])`
    fn rewrite_macro(&mut self, mac: &mut Macro) {
        if let Some(MacroArgs { mut exprs, tail }) = expr_macro_args(mac) {
            for e in &mut exprs {
                self.visit_expr_mut(e);
            }
            mac.tokens = quote!(#exprs #tail);
        }
    }

    /// Input:  `x.matmul(&w)`, `m.forward(&x, train)`
    /// Output: `Routed::<Pol, _>::new(&(x)).matmul(&w)`,
    ///         `{ use module_call::{__AmpForward as _, __AmpForwardMut as _};
    ///          (m).__amp_forward(PhantomData::<Pol>, (&x, train,)) }`
    ///         (a method call on `m` as written: Rust borrows it as the module's method needs,
    ///         `&self` or `&mut self`); `None` for a method that is neither an op nor a module
    ///         call
    fn method_call(call: &syn::ExprMethodCall, policy: &TokenStream) -> Option<TokenStream> {
        let name = call.method.to_string();
        let (receiver, method, args) = (&call.receiver, &call.method, &call.args);
        // The inserted tokens carry the method's span, so that rustc's errors about the routed
        // call point at the method the user wrote.
        let span = method.span();
        if optable::MODULE_CALLS.contains(&name.as_str()) {
            let args = args.iter().map(ToTokens::to_token_stream);
            return Some(module_call(&name, span, receiver, args, policy));
        }
        // Input:  `h.apply(&layer)`, `h.apply_t(&layer, train)` (candle's way to call a module)
        // Output: `{ use ApplyRegionCall as _; use ApplyAmpModule as _;
        //         let x = AsAmp::to_amp(&(h));
        //         (&&Applied::<Pol, _>::new(&layer)).__amp_apply(&x) }`: a module call, or an
        //         `AmpModule`'s under the region running, by the module's type
        //         (`region/module.rs`)
        let applied = match (name.as_str(), args.len()) {
            ("apply", 1) => Some(("__amp_apply", Rt::ApplyRegionCall)),
            ("apply_t", 2) => Some(("__amp_apply_t", Rt::ApplyTRegionCall)),
            _ => None,
        };
        if let Some((apply, way)) = applied {
            let mut args = args.iter();
            let module = args.next()?;
            let train = args.next().map(|t| quote!(, #t));
            let apply = syn::Ident::new(apply, span);
            let ways = [way, Rt::ApplyAmpModule].map(|w| w.at(span));
            let (applied, as_amp) = (Rt::Applied.at(span), Rt::AsAmp.at(span));
            let x = syn::Ident::new("__amp_x", proc_macro2::Span::mixed_site());
            return Some(quote_spanned!(span=> {
                #(
                    #[allow(unused_imports)]
                    use #ways as _;
                )*
                let #x = #as_amp::to_amp(&(#receiver));
                (&&#applied::<#policy, _>::new(#module)).#apply(&#x #train)
            }));
        }
        let routed = Rt::Routed.at(span);
        let routed = quote_spanned!(span=> #routed::<#policy, _>::new(&(#receiver)));
        if optable::is_routed_method(&name, args.len()) {
            let turbofish = &call.turbofish;
            return Some(quote_spanned!(span=> #routed.#method #turbofish (#args)));
        }
        None
    }
}

/// Input:  module `m`, method `forward` (or `forward_t`, `forward_train`), arguments `args`
/// Output: `{ use module_call::{__AmpForward as _, __AmpForwardMut as _};
///         (m).__amp_forward(PhantomData::<Pol>, (args,)) }`: a method call on `m` as written,
///         so that Rust borrows it as the module's method needs (`&self` or `&mut self`)
fn module_call(
    name: &str,
    span: proc_macro2::Span,
    module: &dyn ToTokens,
    args: impl Iterator<Item = TokenStream>,
    policy: &TokenStream,
) -> TokenStream {
    let module_call = Rt::ModuleCall.at(span);
    let call = format_ident!("__amp_{}", name, span = span);
    // `forward_t` -> `__AmpForwardT`, `__AmpForwardTMut`: the method's two traits.
    let camel: String = name.split('_').map(capitalized).collect();
    let by_ref = format_ident!("__Amp{}", camel, span = span);
    let by_mut = format_ident!("__Amp{}Mut", camel, span = span);
    // One of the two is used, which one the probe decides.
    quote_spanned!(span=> {
        #[allow(unused_imports)]
        use #module_call::{#by_ref as _, #by_mut as _};
        (#module).#call(::core::marker::PhantomData::<#policy>, (#(#args,)*))
    })
}

/// An arithmetic operator, routed when its operands are tensors: `+`, `-`, `*`, `/` (not their
/// `+=` forms, nor comparisons), at its own site, so that the precision report puts it on its
/// line, not on the enclosing call's.
/// Input:  `a + b`
/// Output: `{ use TensorOperators as _; use ScalarRight as _; use ScalarLeft as _;
///         use PlainAdd as _; (&&&Operands::<Pol, _, _>::new(a, b)).__amp_add() }`: the method
///         probe picks the way by the operands' types (`region/operators.rs`): a routed op for
///         two tensors, an affine map for a tensor and an `f64`, the operator as written for
///         anything else
fn operator(binary: &syn::ExprBinary, policy: &TokenStream) -> Option<TokenStream> {
    let (method, plain) = match binary.op {
        syn::BinOp::Add(_) => ("__amp_add", Rt::PlainAdd),
        syn::BinOp::Sub(_) => ("__amp_sub", Rt::PlainSub),
        syn::BinOp::Mul(_) => ("__amp_mul", Rt::PlainMul),
        syn::BinOp::Div(_) => ("__amp_div", Rt::PlainDiv),
        _ => return None,
    };
    let span = binary.op.span();
    let method = syn::Ident::new(method, span);
    let operands = Rt::Operands.at(span);
    let ways = [Rt::TensorOperators, Rt::ScalarRight, Rt::ScalarLeft, plain].map(|w| w.at(span));
    // Parentheses around an operand are the call's now (they would trip `unused_parens`).
    let unparen = |e: &Expr| match e {
        Expr::Paren(p) if p.attrs.is_empty() => p.expr.to_token_stream(),
        other => other.to_token_stream(),
    };
    let (left, right) = (unparen(&binary.left), unparen(&binary.right));
    Some(quote_spanned!(span=> {
        #(
            #[allow(unused_imports)]
            use #ways as _;
        )*
        (&&&#operands::<#policy, _, _>::new(#left, #right)).#method()
    }))
}

/// `forward` -> `Forward`.
fn capitalized(word: &str) -> String {
    let mut chars = word.chars();
    chars
        .next()
        .map(|c| c.to_ascii_uppercase().to_string() + chars.as_str())
        .unwrap_or_default()
}

/// `let _p = PolicyScope::enter::<Fp32Policy>();`: while it lives, code called from here (helpers
/// that take their caller's policy) runs in f32 too.
fn fp32_scope() -> TokenStream {
    let scope = syn::Ident::new("__amp_kept", proc_macro2::Span::mixed_site());
    let (policy_scope, fp32) = (Rt::PolicyScope, Rt::Fp32Policy);
    quote!(let #scope = #policy_scope::enter::<#fp32>();)
}

/// A `#[keep_fp32]` statement's ops are routed under f32 already; this also pushes f32 for the
/// functions it calls, for the statement's extent.
/// Input:  `let s = h.sum(1)?;`, `let Ok(s) = f(&h) else { .. };`, `h = f(&h)?;`,
///         `assert!(f(&h)?.dtype() == ..);`
/// Output: `let s = { let _p = ..; h.sum(1)? };`, `let Ok(s) = ({ let _p = ..; f(&h) }) else
///         { .. };` (a `let .. else` takes no block-like expression), `{ let _p = ..; h = f(&h)? };`,
///         `{ let _p = ..; assert!(..); }`
fn keep_fp32_for_callees(stmt: &mut Stmt) {
    let scope = fp32_scope();
    match stmt {
        Stmt::Local(local) => {
            if let Some(init) = &mut local.init {
                let expr = &init.expr;
                *init.expr = if init.diverge.is_some() {
                    Expr::Verbatim(quote!(({ #scope #expr })))
                } else {
                    Expr::Verbatim(quote!({ #scope #expr }))
                };
            }
        }
        // A `return` keeps its place (its value's type comes from the signature); the value is
        // computed in the scope.
        Stmt::Expr(Expr::Return(ret), _) => {
            if let Some(value) = &mut ret.expr {
                **value = Expr::Verbatim(quote!({ #scope #value }));
            }
        }
        Stmt::Expr(e, _) => *e = Expr::Verbatim(quote!({ #scope #e })),
        Stmt::Macro(m) => {
            let (attrs, mac, semi) = (&m.attrs, &m.mac, &m.semi_token);
            *stmt = Stmt::Expr(
                Expr::Verbatim(quote!(#(#attrs)* { #scope #mac #semi })),
                None,
            );
        }
        Stmt::Item(_) => {}
    }
}

/// Removes a marker attribute (`#[keep_fp32]`) by name; whether it was there.
pub(crate) fn take_marker(attrs: &mut Vec<Attribute>, name: &str) -> bool {
    let before = attrs.len();
    attrs.retain(|a| !crate::model::named(a, name));
    attrs.len() != before
}

impl Rewriter {
    /// An op of the table taken as a value, not called: `Tensor::NAME` (also
    /// `candle_core::Tensor::NAME`) of a method row, not `Tensor::<P>::NAME`, which follows the
    /// thread's policy already; or `candle_nn::MODULE::NAME` of a candle-nn function the region
    /// routes. Only these spellings: a user's own `ops::softmax` or `mine::Tensor::exp` is
    /// another function, as written. The function as written fixes the closure's types, its
    /// tensor references at any lifetime, as the function takes them (`apply(Tensor::exp, x)`
    /// with `F: Fn(&Tensor) -> ..`).
    fn taken_op(&mut self, path: &syn::ExprPath) -> Option<TokenStream> {
        let segments = &path.path.segments;
        if path.qself.is_some() || segments.iter().any(|s| !s.arguments.is_none()) {
            return None;
        }
        let written: Vec<String> = segments.iter().map(|s| s.ident.to_string()).collect();
        let (method, name) = match written.iter().map(String::as_str).collect::<Vec<_>>()[..] {
            ["Tensor", name] | ["candle_core" | "candle", "Tensor", name] => (true, name),
            ["candle_nn", _, name] => (false, name),
            _ => return None,
        };
        let (arity, references) = if method {
            let arity = optable::routed_method_arity(name)?;
            (arity + 1, 1 + optable::method_tensor_args(name))
        } else {
            let module = &written[1];
            let &(_, _, arity, _) = optable::CANDLE_NN_FNS
                .iter()
                .find(|&&(n, m, _, _)| n == name && m == module)?;
            (arity, optable::candle_nn_tensor_args(name))
        };
        let ident = &segments.last()?.ident;
        let span = ident.span();
        let args: Vec<syn::Ident> = (0..arity)
            .map(|i| {
                let at = proc_macro2::Span::mixed_site().located_at(span);
                format_ident!("__amp_v{}", i, span = at)
            })
            .collect();
        let call: Expr = if method {
            let (receiver, rest) = args.split_first()?;
            syn::parse_quote_spanned!(span=> (#receiver).#ident(#(#rest),*))
        } else {
            syn::parse_quote_spanned!(span=> #path(#(#args),*))
        };
        let taken = Rt::Taken.at(span);
        let mut closure: Expr =
            syn::parse_quote_spanned!(span=> |#(#args),*| #taken::returned(#call));
        self.visit_expr_mut(&mut closure);
        let of = format_ident!("of{}_{}", arity, references, span = span);
        Some(quote_spanned!(span=> #taken::#of(#path, #closure)))
    }
}

impl VisitMut for Rewriter {
    fn visit_type_mut(&mut self, _: &mut syn::Type) {
        // Types hold no ops, and their array lengths are constant expressions, where a site
        // guard could not run.
    }

    fn visit_expr_repeat_mut(&mut self, repeat: &mut syn::ExprRepeat) {
        // `[x; N]`: the element is code, the length a constant expression (as in types).
        self.visit_expr_mut(&mut repeat.expr);
    }

    fn visit_generic_argument_mut(&mut self, _: &mut syn::GenericArgument) {
        // Types and constant expressions (`f::<{ N * 2 }>()`), as above.
    }

    fn visit_expr_const_mut(&mut self, _: &mut syn::ExprConst) {
        // `const { .. }`: evaluated at compile time.
    }

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
        let kept = self.with_keep_fp32(&mut taken, |this| {
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
        if kept {
            keep_fp32_for_callees(stmt);
        }
    }

    fn visit_expr_closure_mut(&mut self, closure: &mut syn::ExprClosure) {
        self.closures += 1;
        visit_mut::visit_expr_closure_mut(self, closure);
        self.closures -= 1;
    }

    /// A call's function, where it is a path, is not an op taken as a value (`Tensor::new(..)`,
    /// and the routed calls' own paths): only the arguments are visited.
    fn visit_expr_call_mut(&mut self, call: &mut syn::ExprCall) {
        if !matches!(&*call.func, Expr::Path(_)) {
            self.visit_expr_mut(&mut call.func);
        }
        for arg in &mut call.args {
            self.visit_expr_mut(arg);
        }
    }

    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        // Input:  `#[keep_fp32] |h| h.matmul(&w)`
        // Output: `|h| { let _p = PolicyScope::enter::<Fp32Policy>(); h.matmul(&w) }`, its ops
        //         routed under f32 as well
        if let Expr::Closure(closure) = expr {
            let mut attrs = std::mem::take(&mut closure.attrs);
            let kept = self.with_keep_fp32(&mut attrs, |this| {
                this.visit_expr_closure_mut(closure);
            });
            if kept {
                let (scope, body) = (fp32_scope(), &closure.body);
                *closure.body = Expr::Verbatim(quote!({ #scope #body }));
            }
            closure.attrs = attrs;
            return;
        }
        if let Expr::Block(block) = expr {
            let mut attrs = std::mem::take(&mut block.attrs);
            let kept = self.with_keep_fp32(&mut attrs, |this| {
                visit_mut::visit_expr_block_mut(this, block);
            });
            if kept {
                block
                    .block
                    .stmts
                    .insert(0, Stmt::Expr(Expr::Verbatim(fp32_scope()), None));
            }
            block.attrs = attrs;
            return;
        }
        // Input:  `let s = #[keep_fp32] h.exp()?;` (an expression, not a statement, marked)
        // Output: `let s = { let _p = PolicyScope::enter::<Fp32Policy>(); h.exp()? };`, its
        //         ops routed under f32 as well
        if !matches!(expr, Expr::Closure(_) | Expr::Block(_)) {
            if let Some(attrs) = own_attrs(expr) {
                if attrs.iter().any(|a| crate::model::named(a, "keep_fp32")) {
                    let mut taken = std::mem::take(attrs);
                    let kept = self.with_keep_fp32(&mut taken, |this| this.visit_expr_mut(expr));
                    restore_attrs(expr, taken);
                    if kept {
                        let scope = fp32_scope();
                        *expr = Expr::Verbatim(quote!({ #scope #expr }));
                    }
                    return;
                }
            }
        }
        // Input:  `Tensor::matmul` as a value (`let mm = Tensor::matmul;`, `.map(Tensor::exp)`)
        // Output: `taken::of2(Tensor::matmul, |a, b| taken::returned(a.matmul(b)))`, the
        //         closure's call routed (see `region/taken.rs`)
        if let Expr::Path(path) = expr {
            if let Some(taken) = self.taken_op(path) {
                *expr = Expr::Verbatim(taken);
            }
            return;
        }
        // Input:  `Tensor::matmul(&a, &b)` (a method of the op table called by its path)
        // Output: `(&a).matmul(&b)`, routed as the method call it stands for.
        if let Some((method, used)) = ufcs_as_method(expr) {
            *expr = match used {
                // The trait's path stays in use: the user's `use candle_nn::Module;` is not
                // left unused by the rewrite.
                Some(path) => Expr::Block(syn::parse_quote!({
                    #[allow(unused_imports)]
                    use #path as _;
                    #method
                })),
                None => Expr::MethodCall(method),
            };
        }
        // Input:  `x.lower_op(|t| layer.forward(t))` (also `fp32_op`, `preserve_op`)
        // Output: the call routed, its closure as written: the closure is the user's candle
        //         code, run on the value cast to the op's class (a module call or an op in it
        //         is candle's, not routed again under the region's policy).
        if let Expr::MethodCall(call) = expr {
            if call.args.len() == 1 && optable::is_closure_method(&call.method.to_string()) {
                self.visit_expr_mut(&mut call.receiver);
                let policy = self.policy();
                if let Some(routed) = Self::method_call(call, &policy) {
                    let routed = self.at_site(call.method.span(), routed);
                    *expr = Expr::Verbatim(routed);
                }
                return;
            }
        }
        // Innermost first: a routed call's receiver and arguments are already rewritten.
        visit_mut::visit_expr_mut(self, expr);
        let policy = self.policy();
        let rewritten = match expr {
            Expr::MethodCall(call) => Self::method_call(call, &policy)
                .map(|routed| self.at_site(call.method.span(), routed)),
            Expr::Binary(binary) => {
                operator(binary, &policy).map(|routed| self.at_site(binary.op.span(), routed))
            }
            Expr::Call(call) => {
                let span = call.func.span();
                free_op_call(call, &policy).map(|routed| self.at_site(span, routed))
            }
            Expr::Return(ret) if self.closures == 0 => {
                // `return Err(e)` has the signature's type already, and `exit` could not infer
                // the value type of an `Err` alone.
                let is_err = matches!(ret.expr.as_deref(), Some(Expr::Call(c))
                    if matches!(&*c.func, Expr::Path(p) if p.path.is_ident("Err")));
                if let (Some(exit), Some(value), false) = (&self.exit, &mut ret.expr, is_err) {
                    // Input: `return v`  Output: `return exit(v)`, the `return` kept as written.
                    let wrapped = exit.wrap(value.span(), &value);
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

/// `Tensor::NAME(recv, args..)` (also `Tensor::<P>::NAME`, `<Tensor<P>>::NAME`) for a method
/// row of the op table taking `args`, and a module call by its trait's path
/// (`Module::forward(&m, x)`, `candle_nn::Module::forward(..)`, `<Linear as Module>::forward(..)`,
/// `ModuleT::forward_t(..)`), as the method call `(recv).NAME(args..)`, routed as that call is;
/// `None` for any other expression; with a module call, the trait's path as written. The owner
/// is recognised by its name: an alias of `Tensor` or `Module` is not.
fn ufcs_as_method(expr: &Expr) -> Option<(syn::ExprMethodCall, Option<syn::Path>)> {
    let Expr::Call(call) = expr else {
        return None;
    };
    let Expr::Path(path) = &*call.func else {
        return None;
    };
    let segments = &path.path.segments;
    let name = segments.last()?;
    let owner = match &path.qself {
        // `<Tensor<P>>::NAME`: the owner is the qualified self type.
        Some(qself) if qself.position == 0 && segments.len() == 1 => match &*qself.ty {
            syn::Type::Path(ty) if ty.qself.is_none() => &ty.path.segments.last()?.ident,
            _ => return None,
        },
        // `<M as Module>::forward`: the owner is the trait.
        Some(qself) if qself.position >= 1 => &segments.iter().nth(qself.position - 1)?.ident,
        Some(_) => return None,
        None => &segments.iter().rev().nth(1)?.ident,
    };
    let args = call.args.len().checked_sub(1)?;
    let method = name.ident.to_string();
    let routed = if owner == "Tensor" {
        optable::is_routed_method(&method, args)
    } else {
        (owner == "Module" || owner == "ModuleT")
            && optable::MODULE_CALLS.contains(&method.as_str())
    };
    if !routed || !name.arguments.is_none() {
        return None;
    }
    let trait_path = (owner != "Tensor").then(|| {
        let len = path
            .qself
            .as_ref()
            .map_or(segments.len() - 1, |q| q.position);
        syn::Path {
            leading_colon: path.path.leading_colon,
            segments: segments.iter().take(len).cloned().collect(),
        }
    });
    let mut rest = call.args.iter().cloned();
    let receiver = rest.next()?;
    Some((
        syn::ExprMethodCall {
            attrs: call.attrs.clone(),
            receiver: Box::new(Expr::Paren(syn::ExprParen {
                attrs: Vec::new(),
                paren_token: syn::token::Paren::default(),
                expr: Box::new(receiver),
            })),
            dot_token: syn::token::Dot::default(),
            method: name.ident.clone(),
            turbofish: None,
            paren_token: call.paren_token,
            args: rest.collect(),
        },
        trait_path,
    ))
}

/// A call of a free op, routed by what its path resolves to, not by how it is spelt: the
/// macro sees `ops::softmax`, not which `ops` that is.
///
/// Module paths (the segment before the name is lowercase), any spelling of candle-amp's
/// `ops`/`loss` included:
/// Input:  `ops::softmax(&h, 1)`
/// Output: `match (&h, 1,) { (a0, a1,) => {
///              use ops as __amp_routed; use ::candle_amp::__private::foreign_arg as __amp_arg;
///              { use ops::*; use ::candle_amp::__private::Unrouted as _;
///                __amp_routed::softmax(__amp_arg(a0), a1).__amp_policy::<Pol>() } } }`
/// candle-amp's `ops` carries a hidden `__amp_routed` module, which the inner glob brings in and
/// which shadows the outer alias: the routed op runs, deferred until `__amp_policy` applies the
/// region's policy. Any other `ops` (candle-nn's, the user's) has none: `__amp_routed` is that
/// module itself, its function is called as written, and `__amp_policy` is the identity. The
/// same shadowing picks the first argument's pass: `__amp_arg` is candle-amp's identity for its
/// own modules and `foreign_arg` for any other, which passes the argument on when it has the
/// type the function takes and otherwise fails naming candle-amp's op (a region value given to
/// candle-nn's `softmax`). The
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
    let module = optable::free_module(&name.ident.to_string())?;
    let Some(owner) = prefix.segments.last() else {
        // A single name (`softmax_last_dim(&h)`, imported): routed only if it is candle-nn's.
        return candle_nn_call(call, None, &name.ident, policy);
    };
    let (args, binds) = bound_args(call);
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
    let (unrouted, foreign) = (Rt::Unrouted.at(span), Rt::ForeignJoin.at(span));
    let routed = if module == optable::Free::Tensor {
        if owner.ident != "Tensor" {
            return None;
        }
        let joined = quote::format_ident!("__amp_routed_{}", ident, span = span);
        quote_spanned!(span=> {
            #[allow(unused_imports)]
            use #foreign as _;
            #[allow(unused_imports)]
            use #unrouted as _;
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
        if let Some(call) = candle_nn_call(call, Some(&prefix), ident, policy) {
            return Some(call);
        }
        let (alias, arg) = (
            syn::Ident::new("__amp_routed", span),
            syn::Ident::new("__amp_arg", span),
        );
        let foreign_arg = Rt::ForeignArg.at(span);
        let (first, rest) = binds.split_first()?;
        // Located at the user's argument: a mismatch is reported there.
        let first = quote_spanned!(args[0].span()=> #arg(#first));
        quote_spanned!(span=> {
            #[allow(unused_imports)]
            use #prefix as #alias;
            #[allow(unused_imports)]
            use #foreign_arg as #arg;
            {
                #[allow(unused_imports, clippy::wildcard_imports)]
                use #prefix::*;
                #[allow(unused_imports)]
                use #unrouted as _;
                #alias::#ident(#first #(, #rest)*).__amp_policy::<#policy>()
            }
        })
    };
    Some(with_bound_args(span, &args, &binds, &routed))
}

/// A call's arguments, and a hygienic name for each located at it, so that a type error about
/// one points at the user's argument, not at the attribute.
fn bound_args(call: &syn::ExprCall) -> (Vec<&Expr>, Vec<syn::Ident>) {
    let args: Vec<_> = call.args.iter().collect();
    let binds = args
        .iter()
        .enumerate()
        .map(|(i, arg)| {
            let span = proc_macro2::Span::mixed_site().located_at(arg.span());
            format_ident!("__amp_a{}", i, span = span)
        })
        .collect();
    (args, binds)
}

/// Input:  the arguments `a, b`, their names, and the routed call over the names
/// Output: `match (a, b,) { (a0, a1,) => routed }` in an invisible group: the arguments are
///         evaluated first, outside any import the routed call brings, and since a `match` is
///         not a postfix expression, the group keeps `ops::softmax(..)?` a valid `?` operand
///         wherever it stood, a statement's start included
fn with_bound_args(
    span: proc_macro2::Span,
    args: &[&Expr],
    binds: &[syn::Ident],
    routed: &TokenStream,
) -> TokenStream {
    let call = quote_spanned!(span=> match (#(#args,)*) { (#(#binds,)*) => #routed });
    proc_macro2::Group::new(proc_macro2::Delimiter::None, call).into_token_stream()
}

/// A call of a function named like one of candle-nn's ops (`optable::CANDLE_NN_FNS`), routed
/// when it is candle-nn's function, by the function's type (`region/foreign.rs`).
/// Input:  `m::softmax(&h, D::Minus1)` (`prefix` `m`), or `softmax_last_dim(&h)` (no prefix)
/// Output: `match (&h, D::Minus1,) { (a0, a1,) => { use m as __amp_routed; { use m::*;
///              use Unrouted as _; use CandleNnRouted as _; use AsWritten as _;
///              (&&CandleNnFn::new(__amp_routed::softmax,
///                  candle_nn::ops::softmax::<candle_core::D>)).__amp_softmax(a0, a1)
///                  .__amp_policy::<Pol>() } } }`: candle-amp's own `ops` shadow
///         `__amp_routed` with their routed module, as for any free op; a single name is the
///         function it names
fn candle_nn_call(
    call: &syn::ExprCall,
    prefix: Option<&syn::Path>,
    name: &syn::Ident,
    policy: &TokenStream,
) -> Option<TokenStream> {
    let written = name.to_string();
    let &(_, candle_module, _, generic) = optable::CANDLE_NN_FNS
        .iter()
        .find(|&&(n, _, arity, _)| n == written && arity == call.args.len())?;
    let span = name.span();
    let (args, binds) = bound_args(call);
    let (candle_nn, candle_core) = (Rt::CandleNn.at(span), Rt::CandleCore.at(span));
    let candle_module = syn::Ident::new(candle_module, span);
    let dim = generic.then(|| quote!(::<#candle_core::D>));
    let candle = quote!(#candle_nn::#candle_module::#name #dim);
    let method = format_ident!("__amp_{}", name, span = span);
    let ways = [Rt::Unrouted, Rt::CandleNnRouted, Rt::AsWritten].map(|w| w.at(span));
    let probe = Rt::CandleNnFn.at(span);
    let alias = syn::Ident::new("__amp_routed", span);
    let function = if prefix.is_some() {
        quote!(#alias::#name)
    } else {
        quote!(#name)
    };
    let routed = quote_spanned!(span=> {
        #(
            #[allow(unused_imports)]
            use #ways as _;
        )*
        (&&#probe::new(#function, #candle)).#method(#(#binds),*).__amp_policy::<#policy>()
    });
    let routed = match prefix {
        // The module's glob in an inner block, so that candle-amp's `ops`/`loss` shadow the
        // alias with their routed module.
        Some(prefix) => quote_spanned!(span=> {
            #[allow(unused_imports)]
            use #prefix as #alias;
            {
                #[allow(unused_imports, clippy::wildcard_imports)]
                use #prefix::*;
                #routed
            }
        }),
        None => routed,
    };
    Some(with_bound_args(span, &args, &binds, &routed))
}

/// The attributes of an expression statement. syn puts a statement's outer attributes on its
/// leftmost operand (`#[a] h = x` on `h`, `#[a] x.f()?` on `x`), so a marker is looked for down
/// that chain; without one, the expression's own attributes.
pub(crate) fn expr_attrs(e: &mut Expr) -> Option<&mut Vec<Attribute>> {
    own_attrs(marker_holder(e))
}

/// The expression on `e`'s left chain that holds a marker attribute, or `e`.
fn marker_holder(e: &mut Expr) -> &mut Expr {
    if !holds_marker(e) && left_operand(e).is_some_and(chain_holds_marker) {
        // Invariant: `left_operand` found an operand, so its mutable twin does.
        marker_holder(left_operand_mut(e).expect("checked by left_operand"))
    } else {
        e
    }
}

fn holds_marker(e: &Expr) -> bool {
    own_attrs_ref(e).is_some_and(|attrs| attrs.iter().any(crate::model::is_marker))
}

fn chain_holds_marker(e: &Expr) -> bool {
    holds_marker(e) || left_operand(e).is_some_and(chain_holds_marker)
}

/// The operand syn hangs a statement's attributes on, one level down, and the attributes of
/// the expression kinds that can carry `#[keep_fp32]` as (the start of) a statement; each in a
/// shared and a mutable form.
macro_rules! expr_accessors {
    ($left:ident, $attrs:ident, $($mut_:tt)?) => {
        fn $left(e: &$($mut_)? Expr) -> Option<&$($mut_)? Expr> {
            Some(match e {
                Expr::Assign(a) => &$($mut_)? *a.left,
                Expr::Binary(b) => &$($mut_)? *b.left,
                Expr::Cast(c) => &$($mut_)? *c.expr,
                Expr::MethodCall(m) => &$($mut_)? *m.receiver,
                Expr::Try(t) => &$($mut_)? *t.expr,
                Expr::Field(f) => &$($mut_)? *f.base,
                Expr::Index(i) => &$($mut_)? *i.expr,
                Expr::Call(c) => &$($mut_)? *c.func,
                _ => return None,
            })
        }

        fn $attrs(e: &$($mut_)? Expr) -> Option<&$($mut_)? Vec<Attribute>> {
            match e {
                Expr::Block(x) => Some(&$($mut_)? x.attrs),
                Expr::Assign(x) => Some(&$($mut_)? x.attrs),
                Expr::If(x) => Some(&$($mut_)? x.attrs),
                Expr::ForLoop(x) => Some(&$($mut_)? x.attrs),
                Expr::Call(x) => Some(&$($mut_)? x.attrs),
                Expr::MethodCall(x) => Some(&$($mut_)? x.attrs),
                Expr::Try(x) => Some(&$($mut_)? x.attrs),
                Expr::Path(x) => Some(&$($mut_)? x.attrs),
                Expr::Closure(x) => Some(&$($mut_)? x.attrs),
                Expr::Paren(x) => Some(&$($mut_)? x.attrs),
                Expr::Match(x) => Some(&$($mut_)? x.attrs),
                Expr::While(x) => Some(&$($mut_)? x.attrs),
                Expr::Loop(x) => Some(&$($mut_)? x.attrs),
                Expr::Return(x) => Some(&$($mut_)? x.attrs),
                Expr::Unary(x) => Some(&$($mut_)? x.attrs),
                Expr::Reference(x) => Some(&$($mut_)? x.attrs),
                Expr::Tuple(x) => Some(&$($mut_)? x.attrs),
                _ => None,
            }
        }
    };
}
expr_accessors!(left_operand, own_attrs_ref,);
expr_accessors!(left_operand_mut, own_attrs, mut);

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

/// Input:  a call written at `span` in `function`
/// Output: `{ static SITE: Site = Site { file: file!(), line, column, function };
///          let _s = SiteGuard::enter(&SITE); call }`: while the call runs, the precision
///         report and the overflow locator know where it is written (its arguments' own
///         calls, evaluated inside, mark their own sites and restore this one)
pub(crate) fn at_site(span: proc_macro2::Span, function: &str, call: TokenStream) -> TokenStream {
    let (site, guard) = (Rt::Site, Rt::SiteGuard);
    let start = span.start();
    let (line, column) = (
        u32::try_from(start.line).unwrap_or(0),
        u32::try_from(start.column + 1).unwrap_or(0),
    );
    let (stat, local) = (
        syn::Ident::new("__AMP_SITE", proc_macro2::Span::mixed_site()),
        syn::Ident::new("__amp_site", proc_macro2::Span::mixed_site()),
    );
    quote_spanned!(span=> {
        static #stat: #site = #site {
            file: ::core::file!(),
            line: #line,
            column: #column,
            function: #function,
            module: ::core::module_path!(),
        };
        let #local = #guard::enter(&#stat);
        #call
    })
}
