//! Code generation for `#[autocast]`, `#[keep_fp32]` and `#[custom_fwd]` on fns, methods and
//! impl blocks.
//!
//! It runs on a model that passed validation and cannot fail: every check lives in
//! `validate.rs`, and generated code is assembled as tokens, never parsed back.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};
use syn::{
    Block, FnArg, GenericParam, ImplItem, ItemFn, ItemImpl, Type, TypeParam, TypeParamBound,
};

use crate::args::{AutocastArgs, PolicyArg};
use crate::custom;
use crate::model::{is_marker, Impl, Mode, ParamKind, Part, Region, RegionCallSig, Target};
use crate::rewrite::{self, Exit};
use crate::runtime::Rt;
use crate::syntax::verbatim_block;

pub(crate) fn region(region: &Region) -> TokenStream {
    match &region.target {
        Target::Fn { item, part } => match &part.mode {
            Mode::CastInputs(precision) => {
                custom::cast_inputs_fn(item, precision).into_token_stream()
            }
            Mode::Autocast | Mode::KeepFp32 => {
                region_fn(item, part, &region.args).into_token_stream()
            }
        },
        Target::Impl(imp) => region_impl(imp, &region.args),
        // Rejected by validation, so never reached; emitted as written.
        Target::Other(item) => item.to_token_stream(),
    }
}

/// Input:  `fn f(x: &Tensor<F32>) -> Result<Tensor<F32>> { body }`
/// Output: the same fn with `body` run as a region (see `region_body`)
fn region_fn(item: &ItemFn, part: &Part, region_args: &AutocastArgs) -> ItemFn {
    let mut f = item.clone();
    *f.block = region_block(part, region_args);
    strip_tensor_param_mut(&mut f.sig);
    accept_region_values(&mut f.sig);
    f
}

/// Input:  `fn f(x: &Tensor<F16>, y: Tensor<P>, ids: &candle_core::Tensor)`
/// Output: `fn f(x: &(impl TensorArg<F16> + ?Sized), y: impl TensorArg<P>, ids: &candle_core::
///         Tensor)`: a typed parameter also takes the values of a calling region (candle
///         tensors), as a PyTorch function takes whatever tensor its caller computed; a typed
///         tensor of another precision is still refused. Parameters without a written precision
///         (`&Tensor`, which may be candle's) keep their type, and with it deref coercion.
fn accept_region_values(sig: &mut syn::Signature) {
    for input in &mut sig.inputs {
        let FnArg::Typed(typed) = input else { continue };
        let by_ref = matches!(&*typed.ty, Type::Reference(_));
        let declared: &mut Type = match &mut *typed.ty {
            Type::Reference(r) => &mut r.elem,
            other => other,
        };
        let Some(precision) = written_precision(declared).cloned() else {
            continue;
        };
        let tensor_arg = Rt::TensorArg.at(declared.span());
        let bound = quote_spanned!(declared.span()=> impl #tensor_arg<#precision>);
        *declared = Type::Verbatim(if by_ref {
            quote_spanned!(declared.span()=> (#bound + ?::core::marker::Sized))
        } else {
            bound
        });
    }
}

/// `Tensor<X>` (any path ending in `Tensor` with one type argument): `X`.
fn written_precision(ty: &Type) -> Option<&Type> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match (last.ident == "Tensor", args.args.first(), args.args.len()) {
        (true, Some(syn::GenericArgument::Type(precision)), 1) => Some(precision),
        _ => None,
    }
}

/// Input:  `fn f(mut x: Tensor<F32>)`
/// Output: `fn f(x: Tensor<F32>)`: the body rebinds `x` as `let mut x = enter(..)`, so the
///         parameter's own `mut` would be unused.
fn strip_tensor_param_mut(sig: &mut syn::Signature) {
    for input in &mut sig.inputs {
        if !crate::model::enters_region(input) {
            continue;
        }
        if let FnArg::Typed(t) = input {
            *t.pat = without_mut(&t.pat);
        }
    }
}

/// A tensor parameter's pattern without `mut`: the body rebinds it (`let mut x = enter(..)`).
fn without_mut(pat: &syn::Pat) -> syn::Pat {
    let mut pat = pat.clone();
    if let syn::Pat::Ident(p) = &mut pat {
        p.mutability = None;
    }
    pat
}

/// A part's body as a region, for the fn or method itself (called with typed tensors).
fn region_block(part: &Part, region_args: &AutocastArgs) -> Block {
    let args = part.args(region_args);
    // Called as a plain fn or method, a part that inherits its policy runs under the innermost
    // region running on this thread (f32 outside any): a helper method keeps its caller's.
    let policy = policy(args, &part.mode, Rt::CallerPolicy);
    verbatim_block(region_body(part, &policy, args, leave_as_declared(part)))
}

/// How a fn or method's results leave it: as the declared return type, by the probe of
/// `region/exit.rs`; none for a fn returning `()` or an `impl Trait` (which no expression can
/// name), whose values leave as they are.
fn leave_as_declared(part: &Part) -> Option<Exit> {
    let syn::ReturnType::Type(_, ty) = &part.sig.output else {
        return None;
    };
    let mut finder = ImplTraitFinder(false);
    syn::visit::Visit::visit_type(&mut finder, ty);
    (!finder.0).then(|| Exit::Leave(ty.clone()))
}

/// Whether a type holds an `impl Trait`.
struct ImplTraitFinder(bool);

impl<'a> syn::visit::Visit<'a> for ImplTraitFinder {
    fn visit_type_impl_trait(&mut self, _: &'a syn::TypeImplTrait) {
        self.0 = true;
    }
}

/// Input:  tensor parameters `x`, `ids`, `output = bf16` (or none)
/// Output: `let __amp_leave = Leave::at_entry(&[floating_dtype(&x), floating_dtype(&ids)],
///         Some(DType::BF16));`: how the part's results leave, decided before it pushes its own
///         policy (see `Leave::at_entry`)
fn leave_at_entry(part: &Part, args: &AutocastArgs) -> TokenStream {
    let (leave, floating, candle) = (Rt::Leave, Rt::FloatingDtype, Rt::CandleCore);
    let inputs: Vec<_> = part
        .tensor_params
        .iter()
        .filter(|p| p.kind == ParamKind::Tensor)
        .map(|p| {
            let name = p.name;
            quote!(#floating(&#name))
        })
        .collect();
    let declared = match args.output().map(ToString::to_string).as_deref() {
        Some("input") => quote!([#(#inputs),*].into_iter().flatten().next()),
        Some(p @ ("f32" | "f16" | "bf16")) => {
            let variant = format_ident!("{}", p.to_uppercase());
            quote!(::core::option::Option::Some(#candle::DType::#variant))
        }
        _ => quote!(::core::option::Option::None),
    };
    let binding = Exit::leave_binding();
    quote!(let #binding = #leave::at_entry(&[#(#inputs),*], #declared);)
}

/// The policy a part runs under; `inherited` where it takes its caller's.
fn policy(args: &AutocastArgs, mode: &Mode, inherited: impl ToTokens) -> TokenStream {
    match (mode, args.policy()) {
        (Mode::KeepFp32 | Mode::CastInputs(_), _) => Rt::Fp32Policy.into_token_stream(),
        (Mode::Autocast, PolicyArg::Inherit) => inherited.into_token_stream(),
        (Mode::Autocast, PolicyArg::Fp16(span)) => Rt::Fp16Policy.at(span).into_token_stream(),
        (Mode::Autocast, PolicyArg::Bf16(span)) => Rt::Bf16Policy.at(span).into_token_stream(),
        (Mode::Autocast, PolicyArg::Named(path)) => path.to_token_stream(),
    }
}

/// The statements of one region part:
/// Input:  `{ stmts; tail }` with tensor params `x`
/// Output: `let _g = RegionGuard::enter(); let x = enter(&x);
///          { let _p = PolicyScope::enter::<Pol>(); exit({ stmts'; tail' }) }`, and with
///         `enabled = cond`: `... if cond { ..under the policy.. } else { ..under f32.. }`
fn region_body(
    part: &Part,
    policy: &TokenStream,
    args: &AutocastArgs,
    exit: Option<Exit>,
) -> TokenStream {
    let enabled = args.enabled();
    // Mixed-site: the guard must not shadow or be reachable from the user's names.
    let guard = syn::Ident::new("__amp_region", Span::mixed_site());
    let (region_guard, enter, enter_fp32) = (Rt::RegionGuard, Rt::Enter, Rt::EnterFp32);
    // `cache = <bool>`: the weight-cast cache on or off for this part and what it calls.
    let region_entry = if let Some(cache) = args.cache() {
        quote_spanned!(cache.span()=> #region_guard::enter_cache(#cache))
    } else {
        quote!(#region_guard::enter())
    };
    let upcast = part.mode == Mode::KeepFp32;
    // Input:  `x: &Tensor<F32>`, `ids: &candle_core::Tensor`, `y: Tensor<F16>`
    // Output: `let x = &enter::<Tensor<F32>, _>(&x);` (a region value), `let ids = &enter::<
    //         candle_core::Tensor, _>(&ids);` (passed through), `let y = enter::<..>(&y);`
    let leave = match &exit {
        Some(Exit::Leave(_)) => leave_at_entry(part, args),
        _ => TokenStream::new(),
    };
    let enter = part.tensor_params.iter().map(|p| {
        let (name, declared) = (p.name, p.declared);
        let mutability = p.mutable.then(|| quote!(mut));
        // Input:  `bias: Option<&Tensor<F32>>`, `xs: &[Tensor<F32>]`
        // Output: `let bias = bias.map(|t| enter::<Tensor<F32>, _>(t)); let bias = bias.as_ref();`,
        //         `let xs: Vec<_> = xs.iter().map(..).collect(); let xs = xs.as_slice();`
        match (p.kind, upcast) {
            (ParamKind::Optional, false) => {
                return quote_spanned!(name.span()=>
                    let #name = #name.map(|t| #enter::<#declared, _>(t));
                    let #mutability #name = #name.as_ref();
                );
            }
            (ParamKind::Optional, true) => {
                return quote_spanned!(name.span()=>
                    let #name = #name.map(|t| #enter_fp32::<#declared, _>(t)).transpose()?;
                    let #mutability #name = #name.as_ref();
                );
            }
            (ParamKind::Slice, false) => {
                return quote_spanned!(name.span()=>
                    let #name = #name.iter().map(|t| #enter::<#declared, _>(t))
                        .collect::<::std::vec::Vec<_>>();
                    let #mutability #name = #name.as_slice();
                );
            }
            (ParamKind::Slice, true) => {
                return quote_spanned!(name.span()=>
                    let #name = #name.iter().map(|t| #enter_fp32::<#declared, _>(t))
                        .collect::<::core::result::Result<::std::vec::Vec<_>, _>>()?;
                    let #mutability #name = #name.as_slice();
                );
            }
            (ParamKind::Tensor, _) => {}
        }
        let value = if upcast {
            quote_spanned!(name.span()=> #enter_fp32::<#declared, _>(&#name)?)
        } else {
            quote_spanned!(name.span()=> #enter::<#declared, _>(&#name))
        };
        if p.by_ref {
            quote_spanned!(name.span()=> let #mutability #name = &#value;)
        } else {
            quote_spanned!(name.span()=> let #mutability #name = #value;)
        }
    });
    // Each branch runs its body with its policy pushed for the code it calls (`CallerPolicy`).
    let scope = syn::Ident::new("__amp_policy", Span::mixed_site());
    let policy_scope = Rt::PolicyScope;
    let rewrite = |policy: TokenStream| -> TokenStream {
        let body = rewrite::body(part.block, policy.clone(), exit.clone(), &part.function);
        let run = match &exit {
            Some(exit) if !ends_diverging(part.block) => exit.wrap(Span::call_site(), &body),
            _ => body.into_token_stream(),
        };
        quote!({
            let #scope = #policy_scope::enter::<#policy>();
            #run
        })
    };
    let run = match enabled {
        None => rewrite(policy.clone()),
        Some(cond) => {
            let on = rewrite(policy.clone());
            let off = rewrite(Rt::Fp32Policy.into_token_stream());
            quote_spanned!(cond.span()=> if #cond { #on } else { #off })
        }
    };
    quote! {
        let #guard = #region_entry;
        #leave
        #(#enter)*
        #run
    }
}

/// Every method of the impl becomes a region; `forward`, `forward_t` and `forward_train` also
/// get a `RegionCall` impl, so that a calling region passes its policy on (or the module keeps
/// its own when it names one).
fn region_impl(imp: &Impl, region_args: &AutocastArgs) -> TokenStream {
    let mut item = imp.item.clone();
    let fns = item.items.iter_mut().filter_map(|item| match item {
        ImplItem::Fn(f) => Some(f),
        _ => None,
    });
    let mut region_calls = Vec::new();
    // The model has one method per `fn` item, in order.
    for (f, method) in fns.zip(&imp.methods) {
        f.attrs.retain(|attr| !is_marker(attr));
        if let Some(sig) = &method.region_call {
            region_calls.push(region_call_impl(imp.item, &method.part, sig, region_args));
        }
        if method.part.candle_module {
            region_calls.extend(candle_module_region_call(imp.item, &method.part));
        }
        // A cast_inputs op's module call, called with typed tensors outside a region, runs
        // exactly as written (a region reaches it through its `RegionCall`); its other methods
        // take any tensor and cast it, as the fn form does.
        if let Mode::CastInputs(precision) = &method.part.mode {
            if imp.item.trait_.is_none() && method.region_call.is_none() {
                custom::cast_inputs_in_place(
                    &mut f.sig,
                    &mut f.block,
                    precision,
                    &method.part.function,
                );
            }
        } else {
            f.block = region_block(&method.part, region_args);
            strip_tensor_param_mut(&mut f.sig);
            // A trait's method keeps the trait's signature.
            if imp.item.trait_.is_none() {
                accept_region_values(&mut f.sig);
            }
        }
    }
    quote!(#item #(#region_calls)*)
}

/// An `#[autocast] impl candle_nn::Module` (or `ModuleT`) called from a region: the trait's
/// method runs on the region value's tensor under the caller's policy, and its result stays the
/// candle tensor the body made.
/// Input:  `impl candle_nn::Module for M { fn forward(&self, xs: &Tensor) -> Result<Tensor> }`
/// Output: `impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for M {
///              type Output = candle_core::Tensor;
///              fn region_call(&self, (x,): (A,)) -> Result<candle_core::Tensor> {
///                  candle_module_call::<Pol, A>(x, |xs| <M as candle_nn::Module>::forward(self, xs))
///              } }`
///         (`forward_t`: the arguments `(A, bool)`, and `train` passed on)
fn candle_module_region_call(imp: &ItemImpl, part: &Part) -> Option<TokenStream> {
    let (_, trait_path, _) = imp.trait_.as_ref()?;
    let method = &part.sig.ident;
    let train = (method == "forward_t").then(|| syn::Ident::new("__amp_train", Span::mixed_site()));
    let (pol, a, x) = (
        syn::Ident::new("__AmpPol", Span::mixed_site()),
        syn::Ident::new("__AmpA", Span::mixed_site()),
        syn::Ident::new("__amp_x", Span::mixed_site()),
    );
    let mut generics = imp.generics.clone();
    generics.params.push(bounded(&pol, Rt::Policy));
    generics.params.push(bounded(&a, Rt::AsAmp));
    let (impl_generics, _, where_clause) = generics.split_for_impl();
    let self_ty = &imp.self_ty;
    let (region_call, calls, call) = (Rt::RegionCall, Rt::Calls, Rt::CandleModuleCall);
    let candle_core = Rt::CandleCore;
    let (types, pats) = match &train {
        Some(t) => (quote!((#a, bool)), quote!((#x, #t))),
        None => (quote!((#a,)), quote!((#x,))),
    };
    let extra = train.as_ref().map(|t| quote!(, #t));
    Some(quote! {
        impl #impl_generics #region_call<#pol, #calls::#method, #types> for #self_ty #where_clause {
            type Output = #candle_core::Tensor;
            fn region_call(&self, #pats: #types) -> #candle_core::Result<Self::Output> {
                #call::<#pol, #a>(#x, |xs| <#self_ty as #trait_path>::#method(self, xs #extra))
            }
        }
    })
}

/// The header of a module method's `RegionCall` impl: generic over the caller's policy and over
/// each tensor argument's type, with the other parameters' types as written.
pub(crate) struct RegionCallHeader {
    pub(crate) generics: syn::Generics,
    pub(crate) self_ty: Type,
    /// The caller's policy parameter.
    pol: syn::Ident,
    /// `forward`, `forward_t` or `forward_train`.
    name: syn::Ident,
    /// `RegionCallMut` (`&mut self`) rather than `RegionCall`.
    mutable: bool,
    /// The argument tuple's element types.
    pub(crate) types: Vec<Type>,
    /// The parameters' patterns, which bind the tuple's elements.
    pats: Vec<syn::Pat>,
    /// The method's declared return type (`Result<Tensor<F32>>`), whose region form is the
    /// impl's `Output`.
    pub(crate) ret: Type,
}

impl RegionCallHeader {
    pub(crate) fn new(imp: &ItemImpl, sig: &RegionCallSig) -> Self {
        let pol = syn::Ident::new("__AmpPol", Span::mixed_site());
        let mut generics = imp.generics.clone();
        // The method's own generics become the impl's: lifetimes first, as Rust requires.
        for param in &sig.generics.params {
            match param {
                GenericParam::Lifetime(_) => generics.params.insert(0, param.clone()),
                _ => generics.params.push(param.clone()),
            }
        }
        if let Some(clause) = &sig.generics.where_clause {
            let predicates = &mut generics.make_where_clause().predicates;
            predicates.extend(clause.predicates.iter().cloned());
        }
        generics.params.push(bounded(&pol, Rt::Policy));
        let (mut types, mut pats) = (Vec::new(), Vec::new());
        for input in &sig.inputs {
            // Input:  `bias: Option<&Tensor<F32>>`, `xs: &[Tensor<F32>]`
            // Output: `Option<&<Tensor<F32> as RegionParam>::Value>` (`Option<&AmpTensor>`, so
            //         that `None` needs no annotation), `&[<Tensor<F32> as ..>::Value]`
            if let Some(param) = input
                .tensor
                .as_ref()
                .filter(|p| p.kind != ParamKind::Tensor)
            {
                let (region_param, declared) = (Rt::RegionParam, param.declared);
                let value = quote!(<#declared as #region_param>::Value);
                types.push(if param.kind == ParamKind::Optional {
                    syn::parse_quote!(::core::option::Option<&#value>)
                } else {
                    syn::parse_quote!(&[#value])
                });
                pats.push(without_mut(input.pat));
            } else if let Some(param) = &input.tensor {
                let a = format_ident!("__AmpA{}", input.index, span = Span::mixed_site());
                let (enter_as, declared) = (Rt::EnterAs, param.declared);
                generics
                    .params
                    .push(bounded(&a, quote!(#enter_as<#declared>)));
                types.push(Type::Verbatim(a.into_token_stream()));
                pats.push(without_mut(input.pat));
            } else {
                types.push(input.ty.clone());
                pats.push(input.pat.clone());
            }
        }
        // A reference among the other parameters (`mask: Option<&Tensor>`, `&[usize]`) gets a
        // lifetime of the impl, one for all: a call's arguments shrink to it.
        let mut ret = match sig.output {
            syn::ReturnType::Type(_, ty) => (**ty).clone(),
            syn::ReturnType::Default => syn::parse_quote!(()),
        };
        let mut lifetimes = NameElidedLifetimes {
            lifetime: syn::Lifetime::new("'__amp_ref", Span::call_site()),
            used: false,
        };
        for ty in types.iter_mut().chain([&mut ret]) {
            lifetimes.visit_type_mut(ty);
        }
        if lifetimes.used {
            // Lifetime parameters come before type parameters.
            let param = syn::LifetimeParam::new(lifetimes.lifetime);
            generics.params.insert(0, param.into());
        }
        Self {
            generics,
            self_ty: (*imp.self_ty).clone(),
            pol,
            name: sig.name.clone(),
            mutable: sig.mutable,
            types,
            pats,
            ret,
        }
    }

    /// The impl, with `body` as `region_call`'s body; `bind`: whether the parameters' patterns
    /// bind the arguments (a stub's body ignores them).
    pub(crate) fn to_impl(&self, bind: bool, body: &TokenStream) -> TokenStream {
        let Self {
            generics,
            self_ty,
            pol,
            name,
            mutable,
            types,
            pats,
            ret,
        } = self;
        let (calls, region_output, candle_core) = (Rt::Calls, Rt::RegionOutput, Rt::CandleCore);
        let (region_call, method, receiver) = if *mutable {
            (
                Rt::RegionCallMut,
                quote!(region_call_mut),
                quote!(&mut self),
            )
        } else {
            (Rt::RegionCall, quote!(region_call), quote!(&self))
        };
        let (impl_generics, _, where_clause) = generics.split_for_impl();
        let params = if bind {
            quote!((#(#pats,)*))
        } else {
            quote!(_)
        };
        quote! {
            impl #impl_generics #region_call<#pol, #calls::#name, (#(#types,)*)>
                for #self_ty #where_clause
            {
                type Output = #region_output<#ret>;
                fn #method(
                    #receiver,
                    #params: (#(#types,)*),
                ) -> #candle_core::Result<Self::Output> #body
            }
        }
    }
}

/// Names the elided lifetimes of reference types with one lifetime.
struct NameElidedLifetimes {
    lifetime: syn::Lifetime,
    used: bool,
}

impl VisitMut for NameElidedLifetimes {
    fn visit_type_reference_mut(&mut self, r: &mut syn::TypeReference) {
        if r.lifetime.as_ref().is_none_or(|l| l.ident == "_") {
            r.lifetime = Some(self.lifetime.clone());
            self.used = true;
        }
        visit_mut::visit_type_reference_mut(self, r);
    }
}

/// `name: bound`, as a generic parameter.
fn bounded(name: &syn::Ident, bound: impl ToTokens) -> GenericParam {
    let mut param = TypeParam::from(name.clone());
    param.colon_token = Some(syn::token::Colon::default());
    param.bounds = Punctuated::from_iter([TypeParamBound::Verbatim(bound.into_token_stream())]);
    GenericParam::Type(param)
}

/// Input:  `fn forward(&self, x: &Tensor<F32>, train: bool) -> Result<Tensor<F32>> { body }`
/// Output: `impl<Pol: Policy, A0: EnterAs<Tensor<F32>>> RegionCall<Pol, calls::forward, (A0, bool)> for
///         Module { type Output = RegionOutput<Result<Tensor<F32>>>; (a candle tensor)
///         fn region_call(&self, (x, train): (A0, bool)) -> Result<Self::Output> { .. } }`
///         whose body runs `body` as a region under the caller's policy (or the module's own),
///         or, for a cast_inputs op, casts the tensors and calls the method itself
fn region_call_impl(
    imp: &ItemImpl,
    part: &Part,
    sig: &RegionCallSig,
    region_args: &AutocastArgs,
) -> TokenStream {
    let header = RegionCallHeader::new(imp, sig);
    let args = part.args(region_args);
    let (exit_to_region, ret) = (Rt::ExitToRegion, &header.ret);
    let exit_to_region = quote!(#exit_to_region::<#ret, _, _>);
    let body = if let Mode::CastInputs(precision) = &part.mode {
        // Autocast is off inside: cast the tensor inputs and call the op's own method.
        // Invariant established by validation, which rejects any other precision.
        let marker = Rt::precision(&precision.to_string())
            .expect("validated: cast_inputs is f32, f16 or bf16");
        let enter_cast = Rt::EnterCast;
        // Input:  `x: &Tensor<F32>`, `bias: Option<&Tensor<F32>>`, `xs: &[Tensor<F32>]`
        // Output: `let (x, bias, xs) = { site; (enter_cast::<F32, _>(&x)?, bias.map(|t|
        //         enter_cast::<F32, _>(t)).transpose()?, xs.iter().map(..).collect::<Result<Vec<_>
        //         >>()?) };`, passed as `x`, `bias.as_ref()`, `&xs`; a candle tensor parameter is
        //         not cast: it is passed as the value it entered as
        let (names, casts): (Vec<_>, Vec<_>) = part
            .tensor_params
            .iter()
            .filter(|p| !crate::model::is_candle_tensor(p.declared))
            .map(|p| {
                let name = p.name;
                let cast = match p.kind {
                    ParamKind::Tensor => quote!(#enter_cast::<#marker, _>(&#name)?),
                    ParamKind::Optional => {
                        quote!(#name.map(|t| #enter_cast::<#marker, _>(t)).transpose()?)
                    }
                    ParamKind::Slice => quote!(
                        #name.iter().map(|t| #enter_cast::<#marker, _>(t))
                            .collect::<::core::result::Result<::std::vec::Vec<_>, _>>()?
                    ),
                };
                (name, cast)
            })
            .unzip();
        // The casts are reported at the method's name, as `cast_inputs`.
        let cast = crate::rewrite::at_site(sig.name.span(), &part.function, quote!((#(#casts,)*)));
        let enter_as = Rt::EnterAs;
        let call_args = sig.inputs.iter().map(|input| {
            let Some(p) = &input.tensor else {
                return input.pat.to_token_stream();
            };
            let (name, declared) = (p.name, p.declared);
            let candle = crate::model::is_candle_tensor(declared);
            match p.kind {
                // A candle tensor parameter: the value it entered as, as itself.
                ParamKind::Tensor if candle => {
                    let value = quote!(#enter_as::<#declared>::enter_as(&#name));
                    if p.by_ref {
                        quote!(&#value)
                    } else {
                        value
                    }
                }
                ParamKind::Tensor if p.by_ref => quote!(&#name),
                ParamKind::Tensor => quote!(#name),
                ParamKind::Optional | ParamKind::Slice if candle => quote!(#name),
                ParamKind::Optional => quote!(#name.as_ref()),
                ParamKind::Slice => quote!(&#name),
            }
        });
        let name = sig.name;
        let (policy_scope, fp32) = (Rt::PolicyScope, Rt::Fp32Policy);
        quote!({
            let (#(#names,)*) = #cast;
            let __amp_policy = #policy_scope::enter::<#fp32>();
            #exit_to_region(Self::#name(self, #(#call_args),*))
        })
    } else {
        let policy = policy(args, &part.mode, &header.pol);
        // A declared `output = f32|f16|bf16` holds for the calling region too.
        let declared = args.output().and_then(|p| Rt::precision(&p.to_string()));
        let exit = Some(Exit::Call(match declared {
            Some(marker) => {
                let exit_as = Rt::ExitToRegionAs;
                quote!(#exit_as::<#ret, #marker, _, _>)
            }
            None => exit_to_region.into_token_stream(),
        }));
        let stmts = region_body(part, &policy, args, exit);
        quote!({ #stmts })
    };
    header.to_impl(true, &body)
}

/// Whether a body ends in a macro that never returns (`todo!()`, `unimplemented!()`,
/// `panic!(..)`, `unreachable!(..)`), a stub while the op is written: its value has no type for
/// the way out to infer (a module's `exit_to_region` failed on it with "type annotations
/// needed"), and needs none, so it is not wrapped.
fn ends_diverging(block: &syn::Block) -> bool {
    let mac = match block.stmts.last() {
        Some(syn::Stmt::Macro(m)) => &m.mac,
        Some(syn::Stmt::Expr(syn::Expr::Macro(m), _)) => &m.mac,
        _ => return false,
    };
    mac.path.segments.last().is_some_and(|s| {
        ["todo", "unimplemented", "panic", "unreachable"].contains(&s.ident.to_string().as_str())
    })
}
