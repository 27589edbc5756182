//! The op tables the rewrite matches: names and arities exactly as in the runtime's typed API.
//!
//! A method call is routed only when both its name and its argument count match, so that
//! `iter.max()`, `iter.sum()` or `a.max(b)` on numbers keep their own meaning (and a routed
//! receiver that is not a tensor falls back to its own method anyway, see `Routed`).

/// Tensor methods and their argument counts.
const METHODS: &[(&str, usize)] = &[
    ("relu", 0),
    ("gelu", 0),
    ("gelu_erf", 0),
    ("silu", 0),
    ("tanh", 0),
    ("neg", 0),
    ("sqr", 0),
    ("sqrt", 0),
    ("abs", 0),
    ("contiguous", 0),
    ("t", 0),
    ("flatten_all", 0),
    ("exp", 0),
    ("log", 0),
    ("recip", 0),
    ("sum_all", 0),
    ("mean_all", 0),
    ("max_all", 0),
    ("min_all", 0),
    ("sigmoid", 0),
    ("squeeze", 1),
    ("unsqueeze", 1),
    ("max", 1),
    ("max_keepdim", 1),
    ("min", 1),
    ("min_keepdim", 1),
    ("cumsum", 1),
    ("flatten_from", 1),
    ("flatten_to", 1),
    ("sum", 1),
    ("sum_keepdim", 1),
    ("mean", 1),
    ("mean_keepdim", 1),
    ("log_sum_exp", 1),
    ("permute", 1),
    ("add", 1),
    ("sub", 1),
    ("mul", 1),
    ("div", 1),
    ("broadcast_add", 1),
    ("broadcast_sub", 1),
    ("broadcast_mul", 1),
    ("broadcast_div", 1),
    ("maximum", 1),
    ("minimum", 1),
    ("matmul", 1),
    ("broadcast_matmul", 1),
    ("pow", 1),
    ("powf", 1),
    ("reshape", 1),
    ("broadcast_as", 1),
    ("broadcast_left", 1),
    ("max_pool2d", 1),
    ("avg_pool2d", 1),
    ("argmax", 1),
    ("affine", 2),
    ("transpose", 2),
    ("flatten", 2),
    ("chunk", 2),
    ("index_select", 2),
    ("narrow", 3),
    ("pad_with_zeros", 3),
    ("conv1d", 5),
    ("conv2d", 5),
    ("conv_transpose2d", 5),
    ("conv_transpose1d", 6),
];

/// Module calls that pass the region's policy on.
pub(crate) const MODULE_CALLS: &[&str] = &["forward", "forward_t", "forward_train"];

/// Free functions, by the module they are called through (`ops::softmax`, `loss::mse`,
/// `Tensor::cat`).
const FREE: &[(&str, &[&str])] = &[
    (
        "ops",
        &[
            "softmax",
            "log_softmax",
            "layer_norm",
            "rms_norm",
            "sigmoid",
        ],
    ),
    (
        "loss",
        &[
            "mse",
            "l1",
            "smooth_l1",
            "nll",
            "cross_entropy",
            "binary_cross_entropy_with_logits",
            "binary_cross_entropy_with_logit",
        ],
    ),
    ("Tensor", &["cat", "stack"]),
];

pub(crate) fn is_routed_method(name: &str, args: usize) -> bool {
    METHODS.iter().any(|&(n, a)| n == name && a == args)
}

/// Whether `module::name(..)` is a free op of the typed API.
pub(crate) fn is_free_op(module: &str, name: &str) -> bool {
    FREE.iter()
        .any(|&(m, names)| m == module && names.contains(&name))
}
