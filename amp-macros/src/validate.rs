//! Validation: every rule the model must satisfy before code is generated.
//!
//! Each check reports on the offending tokens and carries on, and the errors are combined
//! (`syn::Error::combine`), so that one compile shows every mistake in the item. Code generation
//! runs only on a model that passed, which is what lets it be infallible.

use proc_macro2::Span;
use quote::ToTokens;
use syn::spanned::Spanned;
use syn::visit::{self, Visit};
use syn::{Item, ItemFn, ReturnType};

use crate::args::{AutocastArg, AutocastArgs};
use crate::errors::{once, Errors};
use crate::model::{
    is_tensor_type, named_precision, Attr, MarkerKind, Method, Part, Region, Target,
};
use crate::rewrite::expr_macro_args;
use crate::runtime::Rt;

pub(crate) fn region(region: &Region) -> syn::Result<()> {
    let mut errors = Errors::default();
    autocast_args(&region.args, &mut errors);
    match &region.attr {
        Attr::KeepFp32 { stray: Some(args) } => {
            errors.spanned(args, "#[keep_fp32] takes no arguments");
        }
        Attr::CustomFwd {
            cast_inputs: Some(precision),
        } if Rt::precision(&precision.to_string()).is_none() => {
            errors.at(precision.span(), "cast_inputs is `f32`, `f16` or `bf16`");
        }
        _ => {}
    }
    stacked_attributes(&region.target, &mut errors);
    match &region.target {
        Target::Fn { item, part } => region_fn(region, item, part, &mut errors),
        Target::Impl(imp) => {
            module_for_a_reference(imp, &mut errors);
            for method in &imp.methods {
                self::method(region, method, &mut errors);
            }
        }
        Target::Other(item) => not_applicable(&region.attr, item, &mut errors),
    }
    errors.finish()
}

/// A module impl for a reference (`impl Module for &Layer`): the region call it would get
/// overlaps the one every reference has through its referent (rustc's E0119, inside the macro).
fn module_for_a_reference(imp: &crate::model::Impl, errors: &mut Errors) {
    let syn::Type::Reference(r) = &*imp.item.self_ty else {
        return;
    };
    if imp
        .methods
        .iter()
        .any(|m| m.region_call.is_some() || m.part.candle_module)
    {
        let referent = &r.elem;
        errors.spanned(
            &imp.item.self_ty,
            format!(
                "#[autocast] on a module impl for a reference: write it for `{}` itself; a \
                 region's call through a reference reaches the referent's",
                quote::quote!(#referent)
            ),
        );
    }
}

/// `#[autocast(..)]` arguments: each kind once, and a known `output`.
fn autocast_args(args: &AutocastArgs, errors: &mut Errors) {
    let (mut policy, mut enabled, mut cache, mut output) = (None, None, None, None);
    for arg in &args.list {
        let (slot, what) = match arg {
            AutocastArg::Fp16(_) | AutocastArg::Bf16(_) | AutocastArg::Policy { .. } => {
                (&mut policy, "policy")
            }
            AutocastArg::Enabled { .. } => (&mut enabled, "`enabled`"),
            AutocastArg::Cache { .. } => (&mut cache, "`cache`"),
            AutocastArg::Output { value, .. } => {
                if output_precision(value).is_none() {
                    errors.at(value.span(), "output is `f32`, `f16`, `bf16` or `input`");
                }
                (&mut output, "`output`")
            }
        };
        once(slot, (), arg.keyword(), errors, |(), ()| {
            format!("duplicate {what} argument")
        });
    }
}

/// `output = ..`'s value, if it is one of the accepted ones.
fn output_precision(value: &syn::Ident) -> Option<&'static str> {
    ["f32", "f16", "bf16", "input"]
        .into_iter()
        .find(|accepted| value == accepted)
}

fn item_span(item: &impl ToTokens) -> Span {
    item.to_token_stream()
        .into_iter()
        .next()
        .map_or_else(Span::call_site, |t| t.span())
}

fn not_applicable(attr: &Attr, item: &Item, errors: &mut Errors) {
    match attr {
        Attr::Autocast => errors.at(
            item_span(item),
            "#[autocast] applies to a fn, a method or an impl block",
        ),
        Attr::KeepFp32 { .. } => keep_fp32_outside_autocast(item_span(item), errors),
        Attr::CustomFwd { .. } => errors.at(
            item.span(),
            "#[custom_fwd] applies to a user op's impl block or fn",
        ),
    }
}

fn keep_fp32_outside_autocast(span: Span, errors: &mut Errors) {
    errors.at(
        span,
        "#[keep_fp32] only has meaning inside an #[autocast] region: put it on a statement, \
         a block or a method there, or on a module's impl block to keep that module in f32",
    );
}

fn region_fn(region: &Region, item: &ItemFn, part: &Part, errors: &mut Errors) {
    match &region.attr {
        Attr::Autocast => region_part(part, &region.args, errors),
        Attr::KeepFp32 { .. } => keep_fp32_outside_autocast(item_span(item), errors),
        Attr::CustomFwd { cast_inputs: None } => errors.at(
            item.sig.ident.span(),
            "#[custom_fwd] without cast_inputs runs under the caller's policy, which reaches \
             ops called as modules: put it on the op's impl (`impl MyOp { fn forward(..) }`, \
             called as `my_op.forward(&x)`), or give this fn `cast_inputs = f32`",
        ),
        Attr::CustomFwd {
            cast_inputs: Some(precision),
        } => cast_inputs_params(&item.sig, precision, errors),
    }
}

/// `#[custom_fwd(cast_inputs = P)]` on a fn or an impl's method: a tensor parameter declared in
/// another precision contradicts the cast (the body would see a `Tensor<P>` typed as something
/// else).
fn cast_inputs_params(sig: &syn::Signature, precision: &syn::Ident, errors: &mut Errors) {
    // An unknown precision is reported on its own; there is nothing to compare with.
    let Some(marker) = Rt::precision(&precision.to_string()).map(Rt::name) else {
        return;
    };
    for input in &sig.inputs {
        let syn::FnArg::Typed(typed) = input else {
            continue;
        };
        if !matches!(&*typed.pat, syn::Pat::Ident(_)) || !is_tensor_type(&typed.ty) {
            continue;
        }
        let Some(declared) = named_precision(&typed.ty) else {
            continue;
        };
        if declared != marker && ["F32", "F16", "BF16"].iter().any(|p| declared == p) {
            errors.at(
                declared.span(),
                format!("cast_inputs casts to {marker}, but this parameter is declared {declared}"),
            );
        }
    }
}

fn method(region: &Region, method: &Method, errors: &mut Errors) {
    markers(method, errors);
    if let Attr::CustomFwd {
        cast_inputs: Some(precision),
    } = &region.attr
    {
        cast_inputs_params(method.part.sig, precision, errors);
    }
    if let Some(own) = &method.part.own_args {
        autocast_args(own, errors);
    }
    region_part(&method.part, &region.args, errors);
}

/// A method is `#[keep_fp32]` or has its own `#[autocast(..)]`, once.
fn markers(method: &Method, errors: &mut Errors) {
    let mut first = None;
    for marker in &method.markers {
        // A repeated `#[keep_fp32]` says the same thing twice and has always been accepted.
        if marker.kind == MarkerKind::KeepFp32 && first == Some(MarkerKind::KeepFp32) {
            continue;
        }
        once(
            &mut first,
            marker.kind,
            marker.attr,
            errors,
            |first, this| {
                if first == this {
                    "duplicate #[autocast] on this method".to_string()
                } else {
                    "a method is either #[keep_fp32] or #[autocast(..)], not both".to_string()
                }
            },
        );
    }
}

/// Input:  `#[autocast(fp16)] #[autocast(bf16)] fn f(..)`: the first attribute's macro sees the
///         second among the item's attributes
/// Output: an error on the second: one item, one region attribute
fn stacked_attributes(target: &Target, errors: &mut Errors) {
    let attrs = match target {
        Target::Fn { item, .. } => &item.attrs,
        Target::Impl(imp) => &imp.item.attrs,
        Target::Other(_) => return,
    };
    let region_attr = |a: &&syn::Attribute| {
        a.path().segments.last().is_some_and(|s| {
            ["autocast", "keep_fp32", "custom_fwd"].contains(&s.ident.to_string().as_str())
        })
    };
    if let Some(second) = attrs.iter().find(region_attr) {
        errors.spanned(
            second,
            "a second region attribute on this item: one item takes one of #[autocast(..)], \
             #[keep_fp32], #[custom_fwd(..)]; keep the one you mean (the first one would apply)",
        );
    }
}

/// A part whose body is rewritten: not a `const fn` nor an `async fn`, its `output` assertion
/// holds, and its body calls no `.backward()` and builds no `async` block or closure.
fn region_part(part: &Part, region_args: &AutocastArgs, errors: &mut Errors) {
    if !part.is_rewritten() {
        return;
    }
    if let Some(constness) = &part.sig.constness {
        errors.at(
            constness.span,
            "a region cannot be a `const fn`: it casts and routes tensors at run time; \
             remove `const`",
        );
    }
    if let Some(asyncness) = &part.sig.asyncness {
        errors.at(
            asyncness.span,
            "a region cannot be an `async fn`: the autocast policy belongs to the thread while \
             the region runs, and an `.await` would leave it in force for whatever else the \
             thread polls (or lose it when the future resumes elsewhere); keep the `async fn` \
             plain and call a synchronous #[autocast] fn or method from it for the tensor work",
        );
    }
    check_output(part.args(region_args), part, errors);
    RegionBody { errors }.visit_block(part.block);
}

/// `output = ..` asserts what the signature already decides: the precision of the returned
/// `Tensor<X>` (`input`: the first tensor parameter's). A contradiction is a compile error on
/// the argument, so the signature stays the one source of truth. A candle tensor result names no
/// precision: `output` chooses its dtype. Where the signature spells none the macro can read (a
/// bare `Tensor`, which may be candle's, or an alias), the exit checks the same at run time.
fn check_output(args: &AutocastArgs, part: &Part, errors: &mut Errors) {
    let Some(output) = args.output() else {
        return;
    };
    let Some(wanted) = output_precision(output) else {
        return; // reported by `autocast_args`
    };
    let ret = match &part.sig.output {
        ReturnType::Type(_, ret) => ret,
        ReturnType::Default => {
            errors.at(
                output.span(),
                format!(
                    "output = {output} on a function that returns nothing: `output` sets the \
                     precision of a returned tensor"
                ),
            );
            return;
        }
    };
    let Some(returned) = spelt_precision(ret).map(|p| p.to_string()) else {
        return;
    };
    let wanted = match wanted {
        "input" => part.sig.inputs.iter().find_map(|a| match a {
            syn::FnArg::Typed(t) if is_tensor_type(&t.ty) => match &*t.ty {
                syn::Type::Reference(r) => spelt_precision(&r.elem),
                ty => spelt_precision(ty),
            }
            .map(|p| p.to_string()),
            _ => None,
        }),
        other => Some(other.to_uppercase()),
    };
    if wanted.is_none() || wanted.as_ref() == Some(&returned) {
        return;
    }
    errors.at(
        output.span(),
        format!(
            "output = {output} contradicts the signature, which returns `Tensor<{returned}>`: a \
             region's result leaves in the precision its signature declares"
        ),
    );
}

/// The precision a `Result<Tensor<X>, ..>` or `Tensor<X>` return type spells; `None` for a
/// bare `Tensor` (candle's, or candle-amp's `Tensor<F32>`: the exit tells them apart) and any
/// other type.
fn spelt_precision(ty: &syn::Type) -> Option<syn::Ident> {
    let syn::Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.first()? {
        syn::GenericArgument::Type(inner) if last.ident == "Result" => spelt_precision(inner),
        syn::GenericArgument::Type(syn::Type::Path(p)) if last.ident == "Tensor" => {
            p.path.get_ident().cloned()
        }
        _ => None,
    }
}

/// Finds what a region body must not hold, over exactly the code the rewrite visits (not nested
/// items, but closures and the arguments of expression macros: `vec!`, `println!`, ...):
/// `.backward()` calls, and `async` blocks and closures, whose code would run after the region,
/// under whatever policy the thread has then.
struct RegionBody<'e> {
    errors: &'e mut Errors,
}

impl RegionBody<'_> {
    fn async_code(&mut self, span: proc_macro2::Span) {
        self.errors.at(
            span,
            "`async` code inside an #[autocast] region: it runs when polled, after the region \
             has ended, under whatever policy the thread has then; compute the tensors in the \
             region and move the results into the `async` block",
        );
    }

    fn macro_args(&mut self, mac: &syn::Macro) {
        for arg in expr_macro_args(mac).iter().flat_map(|a| a.exprs.iter()) {
            self.visit_expr(arg);
        }
    }
}

impl<'ast> Visit<'ast> for RegionBody<'_> {
    fn visit_expr_async(&mut self, block: &'ast syn::ExprAsync) {
        self.async_code(block.async_token.span);
    }

    fn visit_expr_closure(&mut self, closure: &'ast syn::ExprClosure) {
        if let Some(asyncness) = &closure.asyncness {
            self.async_code(asyncness.span);
        }
        visit::visit_expr_closure(self, closure);
    }

    fn visit_item(&mut self, _: &'ast Item) {
        // Nested items are not part of the region.
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        if call.method == "backward" && call.args.is_empty() {
            self.errors.at(
                call.method.span(),
                "`.backward()` inside an #[autocast] region: return the loss from the region \
                 and call `.backward()` outside it (PyTorch recommends the same; here it is \
                 enforced)",
            );
        }
        visit::visit_expr_method_call(self, call);
    }

    fn visit_expr_macro(&mut self, mac: &'ast syn::ExprMacro) {
        self.macro_args(&mac.mac);
    }

    fn visit_stmt_macro(&mut self, mac: &'ast syn::StmtMacro) {
        self.macro_args(&mac.mac);
    }
}
