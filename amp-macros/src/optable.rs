//! The op table: every op of the typed API, written once, with its class and how it is called.
//!
//! Everything else that lists ops is generated from this table or checked against it:
//! - the rewrite routes a method call when its name and argument count match a `method` row,
//!   and a free call `path::name(..)` when `name` is a `free` row;
//! - the runtime generates its op markers (`candle_amp::op::*`), and the routed methods of the
//!   common shapes, through the hidden `__op_table!` macro;
//! - a runtime test checks its hand-written routed methods and free ops against the rows.
//!
//! A method call is routed only when both its name and its argument count match, so that
//! `iter.max()`, `iter.sum()` or `a.max(b)` on numbers keep their own meaning (and a routed
//! receiver that is not a tensor falls back to its own method anyway).

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

/// PyTorch's autocast classes (the runtime's `OpClass`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    LowerPrecision,
    Fp32,
    Promote,
    Preserve,
}

/// How an op is called as a method of a tensor, and so how its routed method is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Method {
    /// `x.op()`.
    Unary,
    /// `x.op(dim)`.
    Dim,
    /// `x.op(dims)`.
    Dims,
    /// `x.op(&rhs)`, a tensor operand.
    Binary,
    /// `x.op(f)`, a candle function run as an op of the row's class (a foreign op).
    Closure,
    /// `x.op(&rhs)`, a comparison: a tensor operand, a u8 candle mask as the result.
    Compare,
    /// Any other signature, with its argument count: the routed method is written by hand.
    Custom(usize),
}

impl Method {
    fn arity(self) -> usize {
        match self {
            Self::Unary => 0,
            Self::Dim | Self::Dims | Self::Binary | Self::Closure | Self::Compare => 1,
            Self::Custom(n) => n,
        }
    }

    fn shape(self) -> &'static str {
        match self {
            Self::Unary => "unary",
            Self::Dim => "dim",
            Self::Dims => "dims",
            Self::Binary => "binary",
            Self::Closure => "closure",
            Self::Compare => "compare",
            Self::Custom(_) => "custom",
        }
    }
}

/// Where an op is called as a free function: `ops::softmax`, `loss::mse`, `Tensor::cat`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Free {
    Ops,
    Loss,
    Tensor,
}

/// One op.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Row {
    pub(crate) name: &'static str,
    /// The marker the op is routed by: its own name, or the op it spells differently
    /// (candle-nn's `binary_cross_entropy_with_logit`).
    pub(crate) marker: &'static str,
    pub(crate) class: Class,
    pub(crate) method: Option<Method>,
    pub(crate) free: Option<Free>,
}

macro_rules! rows {
    ($($name:ident $(= $marker:ident)?: $class:ident $(, method $shape:ident $(($n:literal))?)? $(, free $free:ident)?;)*) => {
        &[$(Row {
            name: stringify!($name),
            marker: rows!(@marker $name $($marker)?),
            class: Class::$class,
            method: rows!(@method $($shape $(($n))?)?),
            free: rows!(@free $($free)?),
        }),*]
    };
    (@marker $name:ident) => { stringify!($name) };
    (@marker $name:ident $marker:ident) => { stringify!($marker) };
    (@method) => { None };
    (@method Custom($n:literal)) => { Some(Method::Custom($n)) };
    (@method $shape:ident) => { Some(Method::$shape) };
    (@free) => { None };
    (@free $free:ident) => { Some(Free::$free) };
}

/// The ops, by class. A row without a method or free form is reached through a layer
/// (`Linear` is `linear`, `LinearAct` is `linear_act`, `BatchNorm2d` is `batch_norm`,
/// `ConvBn2d` is `conv_bn2d`, `ConvBnReLU2d` is `conv_bn_relu2d`, `Embedding` is `embedding`,
/// `Upsample` is `upsample`).
pub(crate) const OPS: &[Row] = rows! {
    // Lower precision: PyTorch's `lower_precision_fp` list.
    matmul: LowerPrecision, method Custom(1);
    broadcast_matmul: LowerPrecision, method Custom(1);
    conv1d: LowerPrecision, method Custom(5);
    conv2d: LowerPrecision, method Custom(5);
    conv_transpose1d: LowerPrecision, method Custom(6);
    conv_transpose2d: LowerPrecision, method Custom(5);
    linear: LowerPrecision;
    linear_act: LowerPrecision;
    conv_bn2d: LowerPrecision;
    conv_bn_relu2d: LowerPrecision;
    lower_op: LowerPrecision, method Closure;
    scaled_dot_product_attention: LowerPrecision, free Ops;
    scaled_dot_product_attention_with = scaled_dot_product_attention: LowerPrecision, free Ops;
    scaled_dot_product_attention_packed = scaled_dot_product_attention: LowerPrecision, free Ops;

    // fp32: reductions, exp/log/pow, softmax, norms, every loss.
    sum: Fp32, method Dims;
    sum_keepdim: Fp32, method Dims;
    sum_all: Fp32, method Unary;
    mean: Fp32, method Dims;
    mean_keepdim: Fp32, method Dims;
    mean_all: Fp32, method Unary;
    exp: Fp32, method Unary;
    log: Fp32, method Unary;
    powf: Fp32, method Custom(1);
    pow: Fp32, method Binary;
    broadcast_pow: Fp32, method Binary;
    recip: Fp32, method Unary;
    // PyTorch's `square` is `pow(x, 2)` (no autocast kernel of its own), on the CUDA fp32 list.
    sqr: Fp32, method Unary;
    log_sum_exp: Fp32, method Dims;
    cumsum: Fp32, method Dim;
    fp32_op: Fp32, method Closure;
    softmax: Fp32, free Ops;
    softmax_last_dim = softmax: Fp32, free Ops;
    log_softmax: Fp32, free Ops;
    layer_norm: Fp32, free Ops;
    rms_norm: Fp32, free Ops;
    group_norm: Fp32;
    mse: Fp32, free Loss;
    l1: Fp32, free Loss;
    smooth_l1: Fp32, free Loss;
    huber: Fp32, free Loss;
    nll: Fp32, free Loss;
    cross_entropy: Fp32, free Loss;
    cross_entropy_with = cross_entropy: Fp32, free Loss;
    binary_cross_entropy_with_logits: Fp32, free Loss;
    binary_cross_entropy_with_logit = binary_cross_entropy_with_logits: Fp32, free Loss;

    // Promote: the widest input wins.
    add: Promote, method Binary;
    sub: Promote, method Binary;
    mul: Promote, method Binary;
    div: Promote, method Binary;
    broadcast_add: Promote, method Binary;
    broadcast_sub: Promote, method Binary;
    broadcast_mul: Promote, method Binary;
    broadcast_div: Promote, method Binary;
    maximum: Promote, method Binary;
    minimum: Promote, method Binary;
    broadcast_maximum: Promote, method Binary;
    broadcast_minimum: Promote, method Binary;
    // Comparisons (PyTorch: in the inputs' promoted dtype); the result is a u8 candle mask.
    eq: Promote, method Compare;
    ne: Promote, method Compare;
    lt: Promote, method Compare;
    le: Promote, method Compare;
    gt: Promote, method Compare;
    ge: Promote, method Compare;
    broadcast_eq: Promote, method Compare;
    broadcast_ne: Promote, method Compare;
    broadcast_lt: Promote, method Compare;
    broadcast_le: Promote, method Compare;
    broadcast_gt: Promote, method Compare;
    broadcast_ge: Promote, method Compare;
    cat: Promote, free Tensor;
    stack: Promote, free Tensor;
    where_cond: Promote, method Custom(2);

    // Preserve: exact or safe in any precision.
    relu: Preserve, method Custom(0);
    gelu: Preserve, method Custom(0);
    gelu_erf: Preserve, method Custom(0);
    silu: Preserve, method Custom(0), free Ops;
    tanh: Preserve, method Unary;
    sigmoid: Preserve, method Custom(0), free Ops;
    neg: Preserve, method Unary;
    sqrt: Preserve, method Unary;
    abs: Preserve, method Unary;
    affine: Preserve, method Custom(2);
    reshape: Preserve, method Custom(1);
    transpose: Preserve, method Custom(2);
    t: Preserve, method Unary;
    narrow: Preserve, method Custom(3);
    flatten: Preserve, method Custom(2);
    flatten_all: Preserve, method Unary;
    flatten_from: Preserve, method Dim;
    flatten_to: Preserve, method Dim;
    squeeze: Preserve, method Dim;
    unsqueeze: Preserve, method Dim;
    contiguous: Preserve, method Unary;
    permute: Preserve, method Dims;
    chunk: Preserve, method Custom(2);
    broadcast_as: Preserve, method Custom(1);
    broadcast_left: Preserve, method Custom(1);
    pad_with_zeros: Preserve, method Custom(3);
    index_select: Preserve, method Custom(2);
    max: Preserve, method Dim;
    max_keepdim: Preserve, method Dim;
    min: Preserve, method Dim;
    min_keepdim: Preserve, method Dim;
    max_all: Preserve, method Unary;
    min_all: Preserve, method Unary;
    argmax: Preserve, method Custom(1);
    clamp: Preserve, method Custom(2);
    preserve_op: Preserve, method Closure;
    max_pool2d: Preserve, method Custom(1);
    max_pool2d_with_stride: Preserve, method Custom(2);
    avg_pool2d: Preserve, method Custom(1);
    avg_pool2d_with_stride: Preserve, method Custom(2);
    adaptive_avg_pool2d: Preserve;
    upsample: Preserve;
    rope: Preserve, free Ops;
    rope_i = rope: Preserve, free Ops;
    rope_thd = rope: Preserve, free Ops;
    batch_norm: Preserve;
    dropout: Preserve;
    embedding: Preserve;
};

/// Module calls that pass the region's policy on.
pub(crate) const MODULE_CALLS: &[&str] = &["forward", "forward_t", "forward_train"];

/// Whether `name` is a method row that runs a user's candle function under the row's class
/// (`x.lower_op(|t| ..)`, `fp32_op`, `preserve_op`): its closure is plain candle code.
pub(crate) fn is_closure_method(name: &str) -> bool {
    OPS.iter()
        .any(|r| r.name == name && r.method == Some(Method::Closure))
}

/// The arguments of the op table's method `name` (its receiver not counted), if it is one that
/// takes no closure.
pub(crate) fn routed_method_arity(name: &str) -> Option<usize> {
    OPS.iter()
        .filter(|r| r.name == name && !is_closure_method(name))
        .find_map(|r| r.method.map(Method::arity))
}

/// How many of method `name`'s arguments, after the receiver, are tensor references (`&Tensor`)
/// rather than values (dims, scalars, sizes): the method's leading arguments.
pub(crate) fn method_tensor_args(name: &str) -> usize {
    let shape = OPS.iter().find(|r| r.name == name).and_then(|r| r.method);
    match (shape, name) {
        // `maximum`/`minimum` take a tensor or a scalar by value.
        (Some(Method::Binary), "maximum" | "minimum") => 0,
        (Some(Method::Custom(_)), "where_cond") => 2,
        (Some(Method::Binary | Method::Compare), _)
        | (
            Some(Method::Custom(_)),
            "matmul" | "broadcast_matmul" | "conv1d" | "conv2d" | "conv_transpose1d"
            | "conv_transpose2d" | "index_select",
        ) => 1,
        _ => 0,
    }
}

/// How many of candle-nn function `name`'s arguments are tensor references: its leading ones.
pub(crate) fn candle_nn_tensor_args(name: &str) -> usize {
    match name {
        "layer_norm" | "rope" | "rope_i" | "rope_thd" => 3,
        "rms_norm"
        | "nll"
        | "cross_entropy"
        | "mse"
        | "huber"
        | "binary_cross_entropy_with_logit" => 2,
        _ => 1,
    }
}

pub(crate) fn is_routed_method(name: &str, args: usize) -> bool {
    OPS.iter()
        .any(|r| r.name == name && r.method.is_some_and(|m| m.arity() == args))
}

/// candle-nn's functions of the free ops, routed where a region calls them (`region/foreign.rs`
/// has the routed side): the name, candle-nn's module, its number of arguments (a call with
/// another count is another function, such as `nn::layer_norm(size, eps, vb)`), and whether it
/// is generic over the dimension (then compared as instantiated for candle's `D`).
pub(crate) const CANDLE_NN_FNS: &[(&str, &str, usize, bool)] = &[
    ("softmax", "ops", 2, true),
    ("log_softmax", "ops", 2, true),
    ("softmax_last_dim", "ops", 1, false),
    ("sigmoid", "ops", 1, false),
    ("silu", "ops", 1, false),
    ("layer_norm", "ops", 4, false),
    ("rms_norm", "ops", 3, false),
    ("rope", "rotary_emb", 3, false),
    ("rope_i", "rotary_emb", 3, false),
    ("rope_thd", "rotary_emb", 3, false),
    ("nll", "loss", 2, false),
    ("cross_entropy", "loss", 2, false),
    ("mse", "loss", 2, false),
    ("huber", "loss", 3, false),
    ("binary_cross_entropy_with_logit", "loss", 2, false),
];

/// The module or type a free op is reached through (`ops`, `loss`, `Tensor`), if `name` is one.
pub(crate) fn free_module(name: &str) -> Option<Free> {
    OPS.iter().find(|r| r.name == name).and_then(|r| r.free)
}

/// `__op_table!(view => callback)`: the table for the runtime, as a call of the runtime's own
/// `macro_rules!` callback.
///
/// Input:  `markers => op_markers`
/// Output: `op_markers! { LowerPrecision matmul; ...; Preserve relu; }` (aliases left out)
/// Input:  `methods => routed`
/// Output: `routed! { binary 1 matmul; ...; custom 5 conv2d; }`
/// Input:  `free => f`
/// Output: `f! { Ops softmax; ...; Tensor cat; }` (the module or type it is called through)
pub(crate) fn expand(input: TokenStream) -> syn::Result<TokenStream> {
    let parser = |input: syn::parse::ParseStream| {
        let view: syn::Ident = input.parse()?;
        input.parse::<syn::Token![=>]>()?;
        let callback: syn::Path = input.parse()?;
        Ok((view, callback))
    };
    let (view, callback) = syn::parse::Parser::parse2(parser, input)?;
    let view_name = view.to_string();
    let row: fn(&Row) -> Option<TokenStream> = match view_name.as_str() {
        "markers" => |r| {
            let class = format_ident!("{}", format!("{:?}", r.class));
            (r.marker == r.name).then(|| quote!(#class))
        },
        "methods" => |r| {
            let m = r.method?;
            let (shape, arity) = (format_ident!("{}", m.shape()), m.arity());
            let arity = proc_macro2::Literal::usize_unsuffixed(arity);
            Some(quote!(#shape #arity))
        },
        "free" => |r| {
            let free = format_ident!("{}", format!("{:?}", r.free?));
            Some(quote!(#free))
        },
        _ => {
            return Err(syn::Error::new(
                view.span(),
                "views: `markers`, `methods`, `free`",
            ))
        }
    };
    // Each row: the view's columns, then the op's name (`Fp32 softmax;`, `custom 5 conv2d;`).
    let rows = OPS.iter().filter_map(|r| {
        let columns = row(r)?;
        let name = format_ident!("{}", r.name);
        Some(quote!(#columns #name;))
    });
    Ok(quote!(#callback! { #(#rows)* }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_aliases_name_a_row_of_their_class() {
        for (i, r) in OPS.iter().enumerate() {
            assert!(
                OPS[i + 1..].iter().all(|o| o.name != r.name),
                "`{}` is in the table twice",
                r.name
            );
            let target = OPS.iter().find(|o| o.name == r.marker);
            assert!(
                target.is_some_and(|t| t.marker == t.name && t.class == r.class),
                "`{}` is routed as `{}`, which is not an op of its class",
                r.name,
                r.marker
            );
        }
    }

    #[test]
    fn routing_matches_name_and_arity() {
        assert!(is_routed_method("matmul", 1));
        assert!(!is_routed_method("matmul", 0));
        assert!(is_routed_method("max", 1));
        assert!(
            !is_routed_method("max", 0),
            "Iterator::max keeps its meaning"
        );
        assert!(is_routed_method("conv_transpose1d", 6));
        assert_eq!(free_module("softmax"), Some(Free::Ops));
        assert_eq!(free_module("cat"), Some(Free::Tensor));
        assert_eq!(free_module("relu"), None);
        assert!(!MODULE_CALLS
            .iter()
            .any(|m| OPS.iter().any(|r| r.name == *m)));
    }

    #[test]
    fn views_generate_callback_calls() {
        let out = expand(quote!(markers => op_markers)).unwrap().to_string();
        assert!(out.starts_with("op_markers ! {"), "{out}");
        assert!(out.contains("Fp32 softmax ;"), "{out}");
        assert!(
            !out.contains("binary_cross_entropy_with_logit Fp32"),
            "aliases have no marker"
        );
        let out = expand(quote!(methods => routed)).unwrap().to_string();
        assert!(
            out.contains("custom 5 conv2d ;") && out.contains("unary 0 tanh ;"),
            "{out}"
        );
        assert!(expand(quote!(colours => f)).is_err());
    }
}
