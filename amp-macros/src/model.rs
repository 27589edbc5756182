//! The intermediate form of an item under `#[autocast]`, `#[keep_fp32]` or `#[custom_fwd]`.
//!
//! Built once from syn, it records what the later phases ask about: which parts become regions,
//! how each runs (its mode, its arguments), which parameters enter as tensors, what leaves, and
//! which methods get a `RegionCall` impl. It borrows the original syn nodes instead of copying
//! what it needs out of them, so that validation can point at the user's tokens and code
//! generation can emit them unchanged.
//!
//! Building it fails only on syntax (arguments that do not parse); every other rule is checked
//! by `validate.rs`.

use proc_macro2::TokenStream;
use syn::{
    Attribute, Block, FnArg, ImplItem, Item, ItemFn, ItemImpl, Pat, ReturnType, Signature, Type,
};

use crate::args::{AutocastArgs, CustomFwdArgs};
use crate::errors::Errors;
use crate::optable::MODULE_CALLS;

/// Which of the region attributes was invoked.
#[derive(Clone, Copy)]
pub(crate) enum AttrKind {
    Autocast,
    KeepFp32,
    CustomFwd,
}

/// Which attribute macro the item is under, with the arguments specific to it.
pub(crate) enum Attr {
    Autocast,
    /// `#[keep_fp32]`, with any arguments it was given (it takes none: a validation error).
    KeepFp32 {
        stray: Option<TokenStream>,
    },
    /// `#[custom_fwd]`, optionally `cast_inputs = <precision as written>`.
    CustomFwd {
        cast_inputs: Option<syn::Ident>,
    },
}

impl Attr {
    /// How the parts of the item run, unless a method's marker says otherwise.
    fn mode(&self) -> Mode {
        match self {
            Self::Autocast | Self::CustomFwd { cast_inputs: None } => Mode::Autocast,
            Self::KeepFp32 { .. } => Mode::KeepFp32,
            Self::CustomFwd {
                cast_inputs: Some(precision),
            } => Mode::CastInputs(precision.clone()),
        }
    }
}

/// How a part runs: under the region's policy, kept in f32 (inputs upcast on entry), or as a
/// `#[custom_fwd(cast_inputs = ..)]` op (inputs cast to the named precision, body left as
/// written, autocast off).
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Mode {
    Autocast,
    KeepFp32,
    /// The precision as the user wrote it (`f32`, `f16`, `bf16`).
    CastInputs(syn::Ident),
}

/// An item under one of the region attributes.
pub(crate) struct Region<'a> {
    pub(crate) attr: Attr,
    /// `#[autocast(..)]`'s arguments; none for the other attributes.
    pub(crate) args: AutocastArgs,
    pub(crate) target: Target<'a>,
}

/// What the attribute was put on.
pub(crate) enum Target<'a> {
    Fn {
        item: &'a ItemFn,
        part: Part<'a>,
    },
    Impl(Impl<'a>),
    /// Anything else, which none of the attributes applies to (a validation error).
    Other(&'a Item),
}

/// An impl block: every method is a part.
pub(crate) struct Impl<'a> {
    pub(crate) item: &'a ItemImpl,
    /// One per `fn` item of the impl, in order.
    pub(crate) methods: Vec<Method<'a>>,
}

pub(crate) struct Method<'a> {
    /// The method's own `#[keep_fp32]`/`#[autocast(..)]` attributes, in order.
    pub(crate) markers: Vec<Marker<'a>>,
    pub(crate) part: Part<'a>,
    /// Set for the module calls a region routes (`forward`, `forward_t`, `forward_train`): the
    /// method gets a `RegionCall` impl (`RegionCallMut` for a `&mut self` receiver).
    pub(crate) region_call: Option<RegionCallSig<'a>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum MarkerKind {
    KeepFp32,
    Autocast,
}

/// A method-level attribute the impl's macro consumes.
pub(crate) struct Marker<'a> {
    pub(crate) attr: &'a Attribute,
    pub(crate) kind: MarkerKind,
}

/// One fn that becomes a region (or, in `CastInputs` mode, an op whose inputs are cast).
pub(crate) struct Part<'a> {
    pub(crate) sig: &'a Signature,
    pub(crate) block: &'a Block,
    pub(crate) mode: Mode,
    /// The arguments of a method's own `#[autocast(..)]`, which replace the impl's.
    pub(crate) own_args: Option<AutocastArgs>,
    /// Parameters typed `Tensor<P>`/`&Tensor<P>` (or a candle `Tensor`), which enter the region.
    pub(crate) tensor_params: Vec<TensorParam<'a>>,
    /// `forward`/`forward_t` of an `impl candle_nn::Module`/`ModuleT`: the trait's method, which
    /// gets a `RegionCall` of its own that calls it (`candle_module_call`).
    pub(crate) candle_module: bool,
    /// The name its op sites report: `f` for a fn, `Type::method` for a method (a file's
    /// `Attention::forward` and `Mlp::forward` apart).
    pub(crate) function: String,
}

impl Part<'_> {
    /// The arguments this part runs with: its own, else those of the item's attribute.
    pub(crate) fn args<'s>(&'s self, region: &'s AutocastArgs) -> &'s AutocastArgs {
        self.own_args.as_ref().unwrap_or(region)
    }

    /// Whether the body is rewritten (in `CastInputs` mode it runs as written).
    pub(crate) fn is_rewritten(&self) -> bool {
        !matches!(self.mode, Mode::CastInputs(_))
    }
}

/// The signature of a module method as its `RegionCall` impl sees it.
pub(crate) struct RegionCallSig<'a> {
    /// `forward`, `forward_t` or `forward_train`: the `calls::NAME` marker.
    pub(crate) name: &'a syn::Ident,
    /// The receiver is `&mut self` (a module holding a KV cache).
    pub(crate) mutable: bool,
    /// The method's own generics (`fn forward<S: Into<f64>>`), which the impl takes on.
    pub(crate) generics: &'a syn::Generics,
    /// The declared return type.
    pub(crate) output: &'a ReturnType,
    /// The parameters after `&self`.
    pub(crate) inputs: Vec<Input<'a>>,
}

pub(crate) struct Input<'a> {
    /// Position among the parameters after `&self` (names the generic `__AmpA{index}`).
    pub(crate) index: usize,
    pub(crate) pat: &'a Pat,
    pub(crate) ty: &'a Type,
    /// The parameter's name when it is a tensor (it enters the region).
    pub(crate) tensor: Option<TensorParam<'a>>,
}

impl<'a> Region<'a> {
    /// Reads `item` under the attribute `kind` given `args`; fails only when attribute arguments
    /// do not parse, with all such errors together.
    pub(crate) fn from_syn(kind: AttrKind, args: TokenStream, item: &'a Item) -> syn::Result<Self> {
        let mut errors = Errors::default();
        let mut autocast_args = AutocastArgs::default();
        let attr = match kind {
            AttrKind::Autocast => {
                match syn::parse2(args) {
                    Ok(parsed) => autocast_args = parsed,
                    Err(e) => errors.push(e),
                }
                Attr::Autocast
            }
            AttrKind::KeepFp32 => Attr::KeepFp32 {
                stray: (!args.is_empty()).then_some(args),
            },
            AttrKind::CustomFwd => {
                let parsed = syn::parse2::<CustomFwdArgs>(args).unwrap_or_else(|e| {
                    errors.push(e);
                    CustomFwdArgs::default()
                });
                Attr::CustomFwd {
                    cast_inputs: parsed.cast_inputs,
                }
            }
        };
        let mode = attr.mode();
        let target = match item {
            Item::Fn(f) => Target::Fn {
                item: f,
                part: Part::new(&f.sig, &f.block, mode, None, None),
            },
            Item::Impl(imp) => Target::Impl(Impl::from_syn(imp, &mode, &mut errors)),
            other => Target::Other(other),
        };
        errors.finish()?;
        Ok(Self {
            attr,
            args: autocast_args,
            target,
        })
    }
}

impl<'a> Impl<'a> {
    fn from_syn(item: &'a ItemImpl, mode: &Mode, errors: &mut Errors) -> Self {
        // `impl candle_nn::Module for M` (or `ModuleT`), by the trait's last path segment.
        let candle_module = item.trait_.as_ref().is_some_and(|(_, path, _)| {
            path.segments
                .last()
                .is_some_and(|s| s.ident == "Module" || s.ident == "ModuleT")
        });
        let methods = item
            .items
            .iter()
            .filter_map(|item| match item {
                ImplItem::Fn(method) => Some(method),
                _ => None,
            })
            .map(|method| {
                let markers = markers(&method.attrs);
                // The first `#[autocast(..)]` is the one used; a second is a validation error.
                let own_args = markers
                    .iter()
                    .find(|m| m.kind == MarkerKind::Autocast)
                    .map(|m| match &m.attr.meta {
                        syn::Meta::Path(_) => AutocastArgs::default(),
                        _ => m.attr.parse_args().unwrap_or_else(|e| {
                            errors.push(e);
                            AutocastArgs::default()
                        }),
                    });
                let mode = if markers.iter().any(|m| m.kind == MarkerKind::KeepFp32) {
                    Mode::KeepFp32
                } else {
                    mode.clone()
                };
                let mut part = Part::new(
                    &method.sig,
                    &method.block,
                    mode,
                    own_args,
                    Some(&item.self_ty),
                );
                // A candle module is called through its trait (`xs.apply(&m)`), not routed.
                part.candle_module = candle_module
                    && ["forward", "forward_t"].contains(&method.sig.ident.to_string().as_str());
                Method {
                    markers,
                    region_call: (!part.candle_module)
                        .then(|| region_call_sig(&method.sig))
                        .flatten(),
                    part,
                }
            })
            .collect();
        Self { item, methods }
    }
}

/// Whether `attr` is `#[name]` or a path ending in it (`#[candle_amp::keep_fp32]`): the markers
/// are the same written either way.
pub(crate) fn named(attr: &Attribute, name: &str) -> bool {
    attr.path().segments.last().is_some_and(|s| s.ident == name)
}

/// A method's `#[keep_fp32]` and `#[autocast(..)]` attributes.
fn markers(attrs: &[Attribute]) -> Vec<Marker<'_>> {
    attrs
        .iter()
        .filter_map(|attr| {
            let kind = if named(attr, "keep_fp32") {
                MarkerKind::KeepFp32
            } else if named(attr, "autocast") {
                MarkerKind::Autocast
            } else {
                return None;
            };
            Some(Marker { attr, kind })
        })
        .collect()
}

/// Whether an attribute is one of the markers the region macros consume.
pub(crate) fn is_marker(attr: &Attribute) -> bool {
    named(attr, "keep_fp32") || named(attr, "autocast")
}

impl<'a> Part<'a> {
    /// A part for `sig`, a method of `owner` (the impl's self type) when there is one.
    fn new(
        sig: &'a Signature,
        block: &'a Block,
        mode: Mode,
        own_args: Option<AutocastArgs>,
        owner: Option<&Type>,
    ) -> Self {
        let owner = match owner {
            Some(Type::Path(p)) => p.path.segments.last().map(|s| format!("{}::", s.ident)),
            _ => None,
        };
        Self {
            sig,
            block,
            mode,
            own_args,
            tensor_params: sig.inputs.iter().filter_map(TensorParam::new).collect(),
            candle_module: false,
            function: format!("{}{}", owner.unwrap_or_default(), sig.ident),
        }
    }
}

/// The `RegionCall` shape of a module method: `forward`, `forward_t` or `forward_train` taking
/// `&self` or `&mut self`. Other methods get no `RegionCall` impl.
pub(crate) fn region_call_sig(sig: &Signature) -> Option<RegionCallSig<'_>> {
    if !MODULE_CALLS.contains(&sig.ident.to_string().as_str()) {
        return None;
    }
    let mut inputs = sig.inputs.iter();
    let mutable = match inputs.next() {
        Some(FnArg::Receiver(r)) if r.reference.is_some() => r.mutability.is_some(),
        _ => return None,
    };
    let inputs = inputs
        .enumerate()
        .filter_map(|(index, input)| match input {
            FnArg::Typed(typed) => Some(Input {
                index,
                pat: &typed.pat,
                ty: &typed.ty,
                tensor: TensorParam::new(input),
            }),
            FnArg::Receiver(_) => None,
        })
        .collect();
    Some(RegionCallSig {
        name: &sig.ident,
        mutable,
        generics: &sig.generics,
        output: &sig.output,
        inputs,
    })
}

/// A tensor parameter as declared: `x: Tensor<P>`, `x: &Tensor<P>`, `ids: &candle_core::Tensor`,
/// `bias: Option<&Tensor<P>>`, `xs: &[Tensor<P>]`.
pub(crate) struct TensorParam<'a> {
    pub(crate) name: &'a syn::Ident,
    /// The declared tensor type, without the reference, `Option` or slice around it: which one
    /// it is, the compiler decides.
    pub(crate) declared: &'a Type,
    /// Declared by reference: the body sees a reference too, usable any number of times.
    pub(crate) by_ref: bool,
    /// Declared `mut x`: the region value it enters as is a `mut` binding.
    pub(crate) mutable: bool,
    /// The tensor itself, an optional one or a slice of them.
    pub(crate) kind: ParamKind,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum ParamKind {
    /// `x: Tensor<P>` or `x: &Tensor<P>`.
    Tensor,
    /// `x: Option<&Tensor<P>>`: enters as `Option<&AmpTensor>`.
    Optional,
    /// `xs: &[Tensor<P>]`: enters as `&[AmpTensor]`.
    Slice,
}

impl<'a> TensorParam<'a> {
    fn new(arg: &'a FnArg) -> Option<Self> {
        let FnArg::Typed(typed) = arg else {
            return None;
        };
        let Pat::Ident(pat) = &*typed.pat else {
            return None;
        };
        let (declared, by_ref, kind) = match &*typed.ty {
            ty if is_tensor_type(ty) => match ty {
                Type::Reference(r) => (&*r.elem, true, ParamKind::Tensor),
                other => (other, false, ParamKind::Tensor),
            },
            ty => {
                if let Some(inner) = optional_tensor(ty) {
                    (inner, true, ParamKind::Optional)
                } else if let Some(inner) = tensor_slice(ty) {
                    (inner, true, ParamKind::Slice)
                } else {
                    return None;
                }
            }
        };
        Some(Self {
            name: &pat.ident,
            declared,
            by_ref,
            mutable: pat.mutability.is_some(),
            kind,
        })
    }
}

/// Whether a parameter enters the region (a tensor, an optional one, a slice of them).
pub(crate) fn enters_region(arg: &FnArg) -> bool {
    TensorParam::new(arg).is_some()
}

/// `Option<&T>` with `T` a tensor type: `T`.
fn optional_tensor(ty: &Type) -> Option<&Type> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match (last.ident == "Option", args.args.first()) {
        (true, Some(syn::GenericArgument::Type(Type::Reference(r)))) if is_tensor_type(&r.elem) => {
            Some(&r.elem)
        }
        _ => None,
    }
}

/// `&[T]` with `T` a tensor type: `T`.
fn tensor_slice(ty: &Type) -> Option<&Type> {
    match ty {
        Type::Reference(r) => match &*r.elem {
            Type::Slice(s) if is_tensor_type(&s.elem) => Some(&s.elem),
            _ => None,
        },
        _ => None,
    }
}

/// Whether `ty` is candle's tensor by its path (`candle_core::Tensor`, `candle::Tensor`, by
/// reference or not): a parameter `cast_inputs` leaves alone (token ids, masks), as PyTorch's
/// `custom_fwd` casts floating tensors only. A bare `Tensor` may be either crate's; the
/// compiler decides, and `cast_inputs` takes it for candle-amp's.
pub(crate) fn is_candle_tensor(ty: &Type) -> bool {
    match ty {
        Type::Reference(r) => is_candle_tensor(&r.elem),
        Type::Paren(p) => is_candle_tensor(&p.elem),
        Type::Path(p) => {
            let mut names = p.path.segments.iter().map(|s| s.ident.to_string());
            let (krate, name, more) = (names.next(), names.next(), names.next());
            matches!(
                (krate.as_deref(), name.as_deref(), more),
                (Some("candle_core" | "candle"), Some("Tensor"), None)
            )
        }
        _ => false,
    }
}

pub(crate) fn is_tensor_type(ty: &Type) -> bool {
    match ty {
        Type::Reference(r) => is_tensor_type(&r.elem),
        Type::Path(p) => p.path.segments.last().is_some_and(|s| s.ident == "Tensor"),
        Type::Paren(p) => is_tensor_type(&p.elem),
        _ => false,
    }
}

/// The precision marker a `Tensor<X>`, `&Tensor<X>` or `Result<Tensor<X>, ..>` type names, if
/// any (a bare `Tensor` is `Tensor<F32>`), with its span.
pub(crate) fn named_precision(ty: &Type) -> Option<syn::Ident> {
    let ty = match ty {
        Type::Reference(r) => &*r.elem,
        other => other,
    };
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return (last.ident == "Tensor").then(|| syn::Ident::new("F32", last.ident.span()));
    };
    match args.args.first()? {
        syn::GenericArgument::Type(inner) if last.ident == "Result" => named_precision(inner),
        syn::GenericArgument::Type(Type::Path(p)) => p.path.get_ident().cloned(),
        _ => None,
    }
}
