//! `#[autocast]` regions: each op class runs where PyTorch's autocast runs it, nested modules
//! inherit or keep their policy, master-weight casts happen once per region, `enabled = false`
//! is the plain f32 program, and the cases that are hard for a macro that sees syntax, not types,
//! compile and run: a loop over layers reassigning one binding that starts as f32, a residual add
//! of an f32 and a half branch, a module generic over the caller's policy, a weight used twice
//! (cast once), an iterator chain with a closure, early returns, `if`/`match` arms of different
//! precisions, and macro calls in the body.

use std::cell::RefCell;

use candle_amp::nn::{self, loss};
use candle_amp::{
    autocast, cast_count, keep_fp32, ops, AmpTensor, Bf16Policy, Fp16Policy, Policy, Precision,
    RegionValue, Tensor, BF16, F16, F32,
};
use candle_core::{DType, Device, IndexOp, Result};
use candle_nn::{VarBuilder, VarMap};

fn dev() -> Device {
    Device::Cpu
}

fn vars() -> (VarMap, VarBuilder<'static>) {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &dev());
    (map, vb)
}

// ---- The class table: output dtype per op class, input precision and policy. ----

/// Dtypes of one op of each class, run in a region of policy `Pol` on `x` (and an f32 `y`):
/// lower: matmul, broadcast_matmul; fp32: sum, exp, sqr (PyTorch's `square`, `pow(x, 2)`),
/// softmax, log_softmax, layer_norm, mse;
/// promote: add with itself, add with f32, cat with itself; preserve: relu, reshape,
/// max_keepdim. The policy is a type parameter, as a library author would write it.
#[autocast(policy = Pol)]
fn classes<Pol: Policy, P: Precision>(
    x: &Tensor<P>,
    y: &Tensor<F32>,
    w: &Tensor<F32>,
) -> Result<Vec<DType>> {
    let ones = Tensor::<F32>::ones(4, &dev())?;
    Ok(vec![
        x.matmul(w)?.dtype(),
        x.broadcast_matmul(w)?.dtype(),
        x.sum_keepdim(1)?.dtype(),
        x.exp()?.dtype(),
        x.sqr()?.dtype(),
        ops::softmax(&x, 1)?.dtype(),
        ops::log_softmax(&x, 1)?.dtype(),
        ops::layer_norm(&x, &ones, &ones, 1e-5)?.dtype(),
        loss::mse(&x, &y)?.dtype(),
        x.add(x)?.dtype(),
        x.add(y)?.dtype(),
        Tensor::cat(&[&x, &x], 0)?.dtype(),
        x.relu()?.dtype(),
        x.reshape((2, 8))?.dtype(),
        x.max_keepdim(1)?.dtype(),
    ])
}

/// PyTorch's rule for the probe above, given the policy's lower dtype and the input dtype.
fn expected(lower: DType, input: DType) -> Vec<DType> {
    let widest = if input == DType::F32 {
        DType::F32
    } else {
        input
    };
    vec![
        lower,
        lower, // lower-precision ops
        DType::F32,
        DType::F32,
        DType::F32,
        DType::F32,
        DType::F32,
        DType::F32,
        DType::F32, // fp32 ops
        input,
        DType::F32,
        widest, // promote: same, with f32, cat
        input,
        input,
        input, // preserve
    ]
}

fn class_table_for<P: Precision>() -> Result<()> {
    let x = Tensor::<F32>::randn(0.0, 1.0, (4, 4), &dev())?.cast::<P>()?;
    let y = Tensor::<F32>::randn(0.0, 1.0, (4, 4), &dev())?;
    let w = Tensor::<F32>::randn(0.0, 1.0, (4, 4), &dev())?;
    let fp16 = classes::<Fp16Policy, P>(&x, &y, &w)?;
    assert_eq!(
        fp16,
        expected(DType::F16, P::DTYPE),
        "fp16 policy, {} input",
        P::NAME
    );
    let bf16 = classes::<Bf16Policy, P>(&x, &y, &w)?;
    assert_eq!(
        bf16,
        expected(DType::BF16, P::DTYPE),
        "bf16 policy, {} input",
        P::NAME
    );
    Ok(())
}

#[test]
fn class_table_matches_pytorch_for_f32_inputs() -> Result<()> {
    class_table_for::<F32>()
}

#[test]
fn class_table_matches_pytorch_for_f16_inputs() -> Result<()> {
    class_table_for::<F16>()
}

#[test]
fn class_table_matches_pytorch_for_bf16_inputs() -> Result<()> {
    class_table_for::<BF16>()
}

// ---- A 3-layer MLP: numerics, casts, `enabled`, zero cost against hand-written code. ----

struct Mlp {
    layers: Vec<nn::Linear>,
}

impl Mlp {
    fn new(vb: &VarBuilder) -> Result<Self> {
        let layers = (0..3)
            .map(|i| nn::linear(16, 16, vb.pp(format!("l{i}"))))
            .collect::<Result<_>>()?;
        Ok(Self { layers })
    }

    #[autocast(fp16)]
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h)?;
            if i < 2 {
                h = h.relu()?;
            }
        }
        Ok(h)
    }

    #[autocast(fp16, enabled = use_amp)]
    fn forward_switch(&self, x: &Tensor<F32>, use_amp: bool) -> Result<Tensor<F32>> {
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h)?;
            if i < 2 {
                h = h.relu()?;
            }
        }
        Ok(h)
    }

    /// What a careful candle user writes by hand: cast the input once, each weight once,
    /// compute in f16, cast the result back.
    fn forward_by_hand(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        self.layers_in(x.cast::<F16>()?)?.cast::<F32>()
    }

    fn forward_f32(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        self.layers_in(x.clone())
    }

    /// The layers in one precision, without any region.
    fn layers_in<P: Precision>(&self, mut h: Tensor<P>) -> Result<Tensor<P>> {
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h)?;
            if i < 2 {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

fn counted<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, u64)> {
    let before = cast_count();
    let out = f()?;
    Ok((out, cast_count() - before))
}

#[test]
fn mlp_matches_hand_written_mixed_precision_bit_for_bit_with_as_many_casts() -> Result<()> {
    let (_map, vb) = vars();
    let mlp = Mlp::new(&vb)?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (8, 16), &dev())?;
    let (auto, auto_casts) = counted(|| mlp.forward(&x))?;
    let (hand, hand_casts) = counted(|| mlp.forward_by_hand(&x))?;
    assert_eq!(auto.to_flat_vec::<f32>()?, hand.to_flat_vec::<f32>()?);
    // input, 3 weights, 3 biases, output
    assert_eq!((auto_casts, hand_casts), (8, 8));
    // And within f16 tolerance of the f32 model.
    let f32_out = mlp.forward_f32(&x)?.to_flat_vec::<f32>()?;
    let scale = f32_out.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (a, b) in auto.to_flat_vec::<f32>()?.iter().zip(&f32_out) {
        assert!((a - b).abs() <= 1e-2 * scale, "{a} vs {b}");
    }
    Ok(())
}

#[test]
fn enabled_false_is_the_plain_f32_program_and_true_the_mixed_one() -> Result<()> {
    let (_map, vb) = vars();
    let mlp = Mlp::new(&vb)?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (8, 16), &dev())?;
    let (off, off_casts) = counted(|| mlp.forward_switch(&x, false))?;
    assert_eq!(
        off.to_flat_vec::<f32>()?,
        mlp.forward_f32(&x)?.to_flat_vec::<f32>()?
    );
    assert_eq!(off_casts, 0);
    let on = mlp.forward_switch(&x, true)?;
    assert_eq!(
        on.to_flat_vec::<f32>()?,
        mlp.forward_by_hand(&x)?.to_flat_vec::<f32>()?
    );
    Ok(())
}

#[test]
fn gradients_reach_the_f32_masters_through_a_region() -> Result<()> {
    let (map, vb) = vars();
    let mlp = Mlp::new(&vb)?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (8, 16), &dev())?;
    let l = loss::mse(&mlp.forward(&x)?, &Tensor::zeros((8, 16), &dev())?)?;
    let grads = l.as_candle().backward()?;
    for var in map.all_vars() {
        let g = grads
            .get(&var)
            .expect("every master weight gets a gradient");
        assert_eq!(g.dtype(), DType::F32);
    }
    Ok(())
}

// ---- Tied weights: one master used twice in a region is cast once. ----

/// A master weight used twice by routed matmuls, as a tied embedding and LM head are.
struct Tied {
    w: Tensor<F32>,
}

#[autocast(fp16)]
impl Tied {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = x.matmul(&self.w)?.relu()?;
        Ok(h.matmul(&self.w)?)
    }
}

#[test]
fn a_weight_used_twice_in_a_region_is_cast_once() -> Result<()> {
    let w = candle_core::Var::randn(0f32, 0.3, (8, 8), &dev())?;
    let tied = Tied {
        w: Tensor::<F32>::from_candle(w.as_tensor().clone())?,
    };
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 8), &dev())?;
    let (_, casts) = counted(|| tied.forward(&x))?;
    // input, weight (once, although it is used twice), output
    assert_eq!(casts, 3);
    // The cache ends with the region: the next call casts again.
    let (_, again) = counted(|| tied.forward(&x))?;
    assert_eq!(again, 3);
    Ok(())
}

/// The same model with the cache off (PyTorch's `cache_enabled=False`), for itself and what it
/// calls.
struct Uncached {
    tied: Tied,
}

#[autocast(fp16, cache = false)]
impl Uncached {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        assert!(!candle_amp::is_autocast_cache_enabled());
        Ok(self.tied.forward(x)?)
    }
}

#[test]
fn cache_false_casts_a_weight_at_each_use() -> Result<()> {
    let w = candle_core::Var::randn(0f32, 0.3, (8, 8), &dev())?;
    let tied = Tied {
        w: Tensor::<F32>::from_candle(w.as_tensor().clone())?,
    };
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 8), &dev())?;
    let (cached, _) = counted(|| tied.forward(&x))?;
    let uncached = Uncached { tied };
    assert!(candle_amp::is_autocast_cache_enabled());
    let (y, casts) = counted(|| uncached.forward(&x))?;
    // input, weight twice (the called module's parts do not cache either), output
    assert_eq!(casts, 4);
    assert!(
        candle_amp::is_autocast_cache_enabled(),
        "the setting ends with the region"
    );
    assert_eq!(y.to_flat_vec::<f32>()?, cached.to_flat_vec::<f32>()?);
    Ok(())
}

// ---- PyTorch's query API: torch.is_autocast_enabled(), torch.get_autocast_dtype(). ----

type Query = (bool, Option<DType>);

fn query() -> Query {
    (
        candle_amp::is_autocast_enabled(),
        candle_amp::autocast_dtype(),
    )
}

/// A helper of no policy of its own: it answers with its caller's.
#[autocast]
fn helper_query() -> Result<Query> {
    Ok(query())
}

#[autocast(fp16)]
fn fp16_queries(use_amp: bool) -> Result<Vec<Query>> {
    let inside = query();
    #[keep_fp32]
    let kept = query();
    let switched = switchable(use_amp)?;
    Ok(vec![inside, kept, helper_query()?, switched])
}

#[autocast(bf16, enabled = use_amp)]
fn switchable(use_amp: bool) -> Result<Query> {
    Ok(query())
}

#[test]
fn the_query_api_answers_as_pytorchs() -> Result<()> {
    let off = (false, None);
    assert_eq!(query(), off, "outside any region");
    assert_eq!(helper_query()?, off, "a helper called from plain code");
    let (f16, bf16) = ((true, Some(DType::F16)), (true, Some(DType::BF16)));
    assert_eq!(fp16_queries(true)?, [f16, off, f16, bf16]);
    assert_eq!(fp16_queries(false)?, [f16, off, f16, off]);
    Ok(())
}

/// `Linear` in half precision rounds its f32 masters inside one op (no half copy joins the
/// graph): each call counts the two conversions it performs, and its masters get f32
/// gradients.
#[test]
fn a_half_linear_rounds_its_masters_inside_and_counts_them() -> Result<()> {
    let (map, vb) = vars();
    let proj = nn::linear(8, 8, vb)?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 8), &dev())?.cast::<F16>()?;
    let (y, casts) = counted(|| proj.forward(&proj.forward(&x)?.relu()?))?;
    assert_eq!(casts, 4, "weight and bias, per call");
    let grads = y.cast::<F32>()?.as_candle().sum_all()?.backward()?;
    for var in map.all_vars() {
        assert_eq!(
            grads.get(&var).map(candle_core::Tensor::dtype),
            Some(DType::F32)
        );
    }
    Ok(())
}

// ---- Nested modules: inherit the caller's policy, or keep their own. ----

/// Records the dtype its matmul ran in.
struct Inner {
    fc: nn::Linear,
    seen: RefCell<Vec<DType>>,
}

#[autocast]
impl Inner {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = self.fc.forward(&x)?;
        self.seen.borrow_mut().push(h.dtype());
        Ok(h)
    }
}

struct Middle {
    fc: nn::Linear,
    inner: Inner,
    seen: RefCell<Vec<DType>>,
}

#[keep_fp32]
impl Middle {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = self.fc.forward(&x)?;
        self.seen.borrow_mut().push(h.dtype());
        Ok(self.inner.forward(&h)?)
    }
}

struct Outer {
    fc: nn::Linear,
    middle: Middle,
    direct: Inner,
    seen: RefCell<Vec<DType>>,
}

#[autocast(fp16)]
impl Outer {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = self.fc.forward(&x)?;
        self.seen.borrow_mut().push(h.dtype());
        let a = self.middle.forward(&h)?;
        let b = self.direct.forward(&h)?;
        // Residual-style add of the f32 branch and the f16 branch promotes to f32.
        let sum = (&a + &b)?;
        self.seen.borrow_mut().push(sum.dtype());
        Ok(sum)
    }
}

fn inner(vb: VarBuilder) -> Result<Inner> {
    Ok(Inner {
        fc: nn::linear(4, 4, vb)?,
        seen: RefCell::default(),
    })
}

#[test]
fn three_levels_with_a_keep_fp32_middle_run_in_the_expected_dtypes() -> Result<()> {
    let (_map, vb) = vars();
    let outer = Outer {
        fc: nn::linear(4, 4, vb.pp("o"))?,
        middle: Middle {
            fc: nn::linear(4, 4, vb.pp("m"))?,
            inner: inner(vb.pp("mi"))?,
            seen: RefCell::default(),
        },
        direct: inner(vb.pp("d"))?,
        seen: RefCell::default(),
    };
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 4), &dev())?;
    let y = outer.forward(&x)?;
    assert_eq!(y.dtype(), DType::F32);
    // Outer: its linear in f16; the residual sum of f32 and f16 branches in f32.
    assert_eq!(*outer.seen.borrow(), [DType::F16, DType::F32]);
    // Middle keeps f32, and the inner module it calls inherits that.
    assert_eq!(*outer.middle.seen.borrow(), [DType::F32]);
    assert_eq!(*outer.middle.inner.seen.borrow(), [DType::F32]);
    // The same inner module called straight from the fp16 region inherits fp16.
    assert_eq!(*outer.direct.seen.borrow(), [DType::F16]);
    // Called from outside any region, an inheriting module runs in f32.
    let alone = inner(vb.pp("alone"))?;
    alone.forward(&x)?;
    assert_eq!(*alone.seen.borrow(), [DType::F32]);
    Ok(())
}

// ---- A library module generic over nothing but the policy it inherits. ----

struct Block {
    fc1: nn::Linear,
    fc2: nn::Linear,
    norm: nn::LayerNorm,
}

#[autocast]
impl Block {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = self.fc2.forward(&self.fc1.forward(&x)?.gelu()?)?;
        // Residual in the widest precision, then an fp32-class norm.
        Ok(self.norm.forward(&(x + &h)?)?)
    }
}

struct Stack {
    blocks: Vec<Block>,
}

#[autocast(bf16)]
impl Stack {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        // An iterator chain over the layers, with `?` inside the closure.
        let h = self
            .blocks
            .iter()
            .try_fold(x.clone(), |h, block| block.forward(&h))?;
        Ok(h)
    }
}

#[test]
fn a_policy_generic_block_follows_its_caller() -> Result<()> {
    let (_map, vb) = vars();
    let block = |i: usize| -> Result<Block> {
        Ok(Block {
            fc1: nn::linear(8, 8, vb.pp(format!("b{i}.fc1")))?,
            fc2: nn::linear(8, 8, vb.pp(format!("b{i}.fc2")))?,
            norm: nn::layer_norm(8, 1e-5, vb.pp(format!("b{i}.norm")))?,
        })
    };
    let stack = Stack {
        blocks: vec![block(0)?, block(1)?],
    };
    let x = Tensor::<F32>::randn(0.0, 1.0, (3, 8), &dev())?;
    let y = stack.forward(&x)?;
    // bf16 inside, f32 out (the norm is fp32-class); close to the f32 program.
    let y32 = stack
        .blocks
        .iter()
        .try_fold(x.clone(), |h, b| b.forward(&h))?;
    for (a, b) in y
        .to_flat_vec::<f32>()?
        .iter()
        .zip(y32.to_flat_vec::<f32>()?)
    {
        assert!((a - b).abs() < 0.1, "{a} vs {b}");
    }
    Ok(())
}

// ---- Branches, early returns, statements kept in f32, macro calls. ----

#[autocast(fp16)]
fn branchy(x: &Tensor<F32>, w: &Tensor<F32>, mode: u8) -> Result<Tensor<F32>> {
    let h = x.matmul(w)?; // f16
    if mode == 0 {
        return Ok(h); // early return: leaves through the same exit cast
    }
    let y = match mode {
        1 => h.exp()?,  // f32
        _ => h.relu()?, // f16
    };
    // The arms' precisions differ; the value stays a region tensor and the next op decides.
    #[keep_fp32]
    let z = y.sqr()?; // kept in f32
    let parts = vec![z.dtype(), y.dtype()];
    println!("parts: {parts:?}, scaled max {}", z.max_all()?);
    Ok((&z + &y)?)
}

#[test]
fn branches_early_returns_keep_fp32_statements_and_macros() -> Result<()> {
    let x = Tensor::<F32>::new(&[[0.5f32, -1.0]], &dev())?;
    let w = Tensor::<F32>::new(&[[1.0f32, 0.0], [0.0, 1.0]], &dev())?;
    assert_eq!(branchy(&x, &w, 0)?.to_vec2::<f32>()?, vec![vec![0.5, -1.0]]);
    let e = branchy(&x, &w, 1)?.to_vec2::<f32>()?;
    let want = |v: f32| v.exp().powi(2) + v.exp();
    assert!((e[0][0] - want(0.5)).abs() < 1e-3 && (e[0][1] - want(-1.0)).abs() < 1e-3);
    assert_eq!(branchy(&x, &w, 2)?.to_vec2::<f32>()?, vec![vec![0.75, 0.0]]);
    Ok(())
}

#[autocast(fp16)]
fn statistics(x: &Tensor<F32>) -> Result<Tensor<F32>> {
    // Scalars and integers inside a region keep their own methods.
    let n = x.dims()[1];
    let scale = (n as f64).sqrt().max(1.0);
    let h = x.matmul(&x.t()?)?.affine(1.0 / scale, 0.0)?;
    #[keep_fp32]
    {
        let s = h.sum_all()?;
        assert_eq!(s.dtype(), DType::F32);
    }
    Ok(h)
}

#[test]
fn scalars_keep_their_methods_inside_a_region() -> Result<()> {
    let x = Tensor::<F32>::ones((2, 4), &dev())?;
    assert_eq!(statistics(&x)?.to_vec2::<f32>()?, vec![vec![2.0; 2]; 2]);
    Ok(())
}

// ---- policy!: ops moved between classes at compile time. ----

candle_amp::policy! {
    /// Softmax stays in f16 (as a fused attention kernel wants it); gelu is forced to f32.
    pub struct AttentionPolicy: fp16 {
        softmax: lower_precision,
        gelu: fp32,
    }
}

#[autocast(policy = AttentionPolicy)]
fn attention(q: &Tensor<F32>, k: &Tensor<F32>) -> Result<(Vec<DType>, Tensor<F32>)> {
    let scores = q.matmul(&k.t()?)?;
    let probs = ops::softmax(&scores, 1)?;
    let dtypes = vec![
        scores.dtype(),
        probs.dtype(),
        scores.gelu()?.dtype(),
        scores.exp()?.dtype(),
        scores.relu()?.dtype(),
    ];
    Ok((dtypes, probs.cast::<F32>()?))
}

candle_amp::policy! {
    /// The lookup's rows in bf16.
    pub struct HalfRows: bf16 {
        embedding: lower_precision,
    }
}

#[autocast(policy = HalfRows)]
fn rows_under_policy(
    ours: &nn::Embedding,
    theirs: &candle_nn::Embedding,
    ids: &candle_core::Tensor,
) -> Result<(DType, DType, candle_core::Tensor)> {
    let a = ours.forward(ids)?;
    let b = theirs.forward(ids)?;
    Ok((a.dtype(), b.dtype(), a.to_dtype(DType::F32)?))
}

#[autocast(bf16)]
fn rows_by_default(ours: &nn::Embedding, ids: &candle_core::Tensor) -> Result<DType> {
    Ok(ours.forward(ids)?.dtype())
}

/// A `policy!` that moves `embedding` reaches the lookup of candle-amp's `Embedding` and of
/// candle-nn's: their rows in the policy's dtype (they stayed f32, the entry accepted and
/// ignored); the built-in policies keep the table's f32.
#[test]
fn a_policy_moves_the_embedding_lookup() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let ours = nn::embedding(4, 3, vb.pp("ours"))?;
    let theirs = candle_nn::Embedding::new(ours.embeddings().as_tensor().clone(), 3);
    let ids = candle_core::Tensor::new(&[[3u32, 0]], &dev())?;
    let (a, b, rows) = rows_under_policy(&ours, &theirs, &ids)?;
    assert_eq!((a, b), (DType::BF16, DType::BF16));
    let want = ours
        .embeddings()
        .as_tensor()
        .index_select(&ids.flatten_all()?, 0)?
        .to_dtype(DType::BF16)?
        .to_dtype(DType::F32)?;
    assert_eq!(
        rows.flatten_all()?.to_vec1::<f32>()?,
        want.flatten_all()?.to_vec1::<f32>()?
    );
    assert_eq!(rows_by_default(&ours, &ids)?, DType::F32);
    Ok(())
}

#[test]
fn a_declared_policy_moves_ops_between_classes() -> Result<()> {
    let q = Tensor::<F32>::randn(0.0, 1.0, (3, 8), &dev())?;
    let k = Tensor::<F32>::randn(0.0, 1.0, (5, 8), &dev())?;
    let (dtypes, probs) = attention(&q, &k)?;
    // matmul lower; softmax moved to lower; gelu moved to fp32; exp fp32 as declared; relu
    // preserves.
    assert_eq!(
        dtypes,
        [DType::F16, DType::F16, DType::F32, DType::F32, DType::F16]
    );
    let reference = ops::softmax(&q.matmul(&k.t()?)?, 1)?;
    for (a, b) in probs
        .to_flat_vec::<f32>()?
        .iter()
        .zip(reference.to_flat_vec::<f32>()?)
    {
        assert!((a - b).abs() < 5e-3, "{a} vs {b}");
    }
    assert_eq!(<AttentionPolicy as Policy>::NAME, "AttentionPolicy");
    Ok(())
}

// ---- Free ops are routed by what their path resolves to, not by how it is spelt. ----

mod reexported {
    pub use candle_amp::ops as amp_ops;
}

/// A user's own functions named like candle-nn's ops (with their signatures).
#[allow(clippy::unnecessary_wraps)]
mod mine {
    pub fn softmax(x: &candle_core::Tensor, _: usize) -> candle_core::Result<candle_core::Tensor> {
        Ok(x.clone())
    }
    pub fn softmax_last_dim(x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        Ok(x.clone())
    }
}

/// candle-amp's `ops` through three spellings is routed (softmax is fp32-class), and so is
/// candle-nn's, whatever it is called (the functions are told apart by their types, not their
/// spelling); a user's own function of the same name is called as written, in the value's own
/// dtype. `Tensor::cat`, candle-amp's or candle's, promotes: f16 with f32 gives f32, f16 with
/// f16 stays f16.
#[autocast(fp16)]
fn spellings(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<Vec<DType>> {
    let h = x.matmul(w)?;
    let parts = vec![h.clone(), h.clone()];
    // A routed free op at a statement's start, followed by `?` and a method: still one operand.
    ops::softmax(&h, 1)?.dims();
    Ok(vec![
        h.dtype(),
        ops::softmax(&h, 1)?.dtype(),
        candle_amp::ops::softmax(&h, 1)?.dtype(),
        reexported::amp_ops::softmax(&h, 1)?.dtype(),
        {
            use candle_nn::ops;
            ops::softmax(&h, candle_core::D::Minus1)?.dtype()
        },
        candle_nn::ops::softmax_last_dim(&h)?.dtype(),
        {
            use candle_nn::ops::softmax_last_dim;
            softmax_last_dim(&h)?.dtype()
        },
        mine::softmax(&h, 1)?.dtype(),
        {
            use mine::softmax_last_dim;
            softmax_last_dim(&h)?.dtype()
        },
        Tensor::cat(&[&h, x], 0)?.dtype(),
        candle_core::Tensor::cat(&parts, 0)?.dtype(),
        candle_core::Tensor::cat(&[&h, x], 0)?.dtype(),
    ])
}

#[test]
fn free_ops_follow_what_their_path_names() -> Result<()> {
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 4), &dev())?;
    let w = Tensor::<F32>::randn(0.0, 1.0, (4, 4), &dev())?;
    let (f16, f32) = (DType::F16, DType::F32);
    assert_eq!(
        spellings(&x, &w)?,
        [f16, f32, f32, f32, f32, f32, f32, f16, f16, f32, f16, f32]
    );
    Ok(())
}

// ---- Helpers take their caller's policy: never a silent f32. ----

/// Attention split into helpers, as candle-transformers writes it: a helper method and a free
/// helper take and return region values, and run under whatever region calls them.
struct Attention;

#[autocast]
impl Attention {
    fn scores(&self, q: &AmpTensor) -> Result<AmpTensor> {
        q.matmul(&q.t()?)
    }

    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let s = self.scores(x)?;
        assert_eq!(s.dtype(), lower_of_this_test());
        Ok(s)
    }
}

#[autocast]
fn free_scores(q: &AmpTensor) -> Result<AmpTensor> {
    q.matmul(&q.t()?)
}

thread_local! {
    static EXPECTED_LOWER: std::cell::Cell<DType> = const { std::cell::Cell::new(DType::F32) };
}

fn lower_of_this_test() -> DType {
    EXPECTED_LOWER.with(std::cell::Cell::get)
}

/// `[helper method, free helper, helper in a closure, helper through a module call]`.
macro_rules! helper_probe {
    ($name:ident, $($policy:tt)*) => {
        #[autocast($($policy)*)]
        fn $name(m: &Attention, x: &Tensor<F32>) -> Result<Vec<DType>> {
            let via_closure = |q: &AmpTensor| m.scores(q);
            m.forward(&x)?;
            Ok(vec![
                m.scores(&x)?.dtype(),
                free_scores(&x)?.dtype(),
                via_closure(&x)?.dtype(),
            ])
        }
    };
}
helper_probe!(helpers_fp16, fp16);
helper_probe!(helpers_bf16, bf16);
helper_probe!(helpers_disabled, fp16, enabled = false);

#[autocast(fp16)]
fn helpers_kept(m: &Attention, x: &Tensor<F32>) -> Result<Vec<DType>> {
    #[keep_fp32]
    let method = m.scores(x)?.dtype();
    let free;
    #[keep_fp32]
    {
        free = free_scores(x)?.dtype();
    }
    let after = m.scores(x)?.dtype();
    Ok(vec![method, free, after])
}

#[test]
fn helpers_run_under_the_policy_of_the_region_calling_them() -> Result<()> {
    let x = Tensor::<F32>::randn(0.0, 1.0, (3, 4), &dev())?;
    let m = Attention;
    let (f16, bf16, f32) = (DType::F16, DType::BF16, DType::F32);
    for (probe, lower) in [
        (
            helpers_fp16 as fn(&Attention, &Tensor<F32>) -> Result<Vec<DType>>,
            f16,
        ),
        (helpers_bf16, bf16),
        (helpers_disabled, f32),
    ] {
        EXPECTED_LOWER.with(|e| e.set(lower));
        assert_eq!(probe(&m, &x)?, [lower; 3]);
    }
    assert_eq!(helpers_kept(&m, &x)?, [f32, f32, f16]);
    // Outside any region the helpers' region runs in f32, as a plain f32 program.
    EXPECTED_LOWER.with(|e| e.set(f32));
    assert_eq!(m.forward(&x)?.dtype(), f32);
    assert_eq!(candle_amp::current_policy(), "fp32");
    Ok(())
}

/// Typed helpers: a `&Tensor<F32>` or `Tensor<F32>` parameter of an `#[autocast]` fn or inherent
/// method also takes the values a calling region computed, as a PyTorch function takes its
/// caller's tensors, and the helper runs under the caller's policy.
#[autocast]
fn typed_product_dtype(q: &Tensor<F32>, k: Tensor<F32>) -> Result<DType> {
    Ok(q.matmul(&k.t()?)?.dtype())
}

struct Typed;

#[autocast]
impl Typed {
    fn product_dtype(&self, q: &Tensor<F32>) -> Result<DType> {
        Ok(q.matmul(&q.t()?)?.dtype())
    }

    fn relu(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        Ok(x.relu()?)
    }
}

/// `[the region value's dtype, free helper, method, free helper given the typed parameter]`.
#[autocast(fp16)]
fn typed_helper_dtypes(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<Vec<DType>> {
    let h = x.matmul(w)?;
    let by_ref = &h;
    Ok(vec![
        h.dtype(),
        typed_product_dtype(&h, h.clone())?,
        Typed.product_dtype(&by_ref)?,
        typed_product_dtype(x, x.clone())?,
    ])
}

#[autocast(fp16)]
fn typed_helper_relu(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<Tensor<F32>> {
    let h = x.matmul(w)?;
    Ok(Typed.relu(&h)?)
}

#[test]
fn typed_helpers_take_region_values() -> Result<()> {
    let x = Tensor::<F32>::randn(0.0, 1.0, (3, 4), &dev())?;
    let w = Tensor::<F32>::randn(0.0, 1.0, (4, 4), &dev())?;
    let f16 = DType::F16;
    assert_eq!(typed_helper_dtypes(&x, &w)?, [f16; 4]);
    // The helper's ReLU ran on the fp16 product as it was: candle's own f16 ReLU of it.
    let (xh, wh) = (x.as_candle().to_dtype(f16)?, w.as_candle().to_dtype(f16)?);
    let expected = xh.matmul(&wh)?.relu()?.to_dtype(DType::F32)?;
    let got = typed_helper_relu(&x, &w)?;
    assert_eq!(got.to_vec2::<f32>()?, expected.to_vec2::<f32>()?);
    // Plain callers: typed tensors, by reference, through an `Arc` (the deref coercion the
    // declared `&Tensor<F32>` allowed) and by value; the helper runs in f32.
    let shared = std::sync::Arc::new(x.clone());
    assert_eq!(typed_product_dtype(&shared, x.clone())?, DType::F32);
    assert_eq!(Typed.product_dtype(&x)?, DType::F32);
    Ok(())
}

// ---- A region value behaves like a candle Tensor: shapes, indexing, scalars, masks. ----

/// Causal attention scores written as candle-transformers writes them, with a u8 mask.
struct Causal {
    mask: candle_core::Tensor,
}

#[autocast]
impl Causal {
    fn scores(&self, q: &AmpTensor, k: &AmpTensor, dtypes: &mut Vec<DType>) -> Result<AmpTensor> {
        let (_b, _h, t, d) = q.dims4()?;
        assert_eq!((t, q.dim(candle_core::D::Minus1)?), (3, d));
        let att = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?;
        dtypes.push(att.dtype());
        let hidden = (att.zeros_like()? - 1e4)?;
        let mask = self.mask.broadcast_as(att.shape())?;
        let att = mask.where_cond(&att, &hidden)?;
        dtypes.push(att.dtype());
        let att = ops::softmax(&att, candle_core::D::Minus1)?;
        dtypes.push(att.dtype());
        let shifted = ((1.0 - &att)? / 8.0)?;
        dtypes.push(shifted.i((.., .., 0))?.dtype());
        Ok(att)
    }
}

macro_rules! causal_probe {
    ($name:ident, $($policy:tt)*) => {
        #[autocast($($policy)*)]
        fn $name(c: &Causal, x: &Tensor<F32>) -> Result<(Vec<DType>, Tensor<F32>)> {
            let mut dtypes = Vec::new();
            let att = c.scores(&x, &x, &mut dtypes)?;
            Ok((dtypes, att.cast::<F32>()?))
        }
    };
}
causal_probe!(causal_fp16, fp16);
causal_probe!(causal_f32, fp16, enabled = false);

#[test]
fn candle_style_attention_runs_in_each_ops_class() -> Result<()> {
    let mask = candle_core::Tensor::new(&[[1u8, 0, 0], [1, 1, 0], [1, 1, 1]], &dev())?;
    let c = Causal { mask };
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 2, 3, 4), &dev())?;
    let (f16, f32) = (DType::F16, DType::F32);
    let (half, amp) = causal_fp16(&c, &x)?;
    let (full, reference) = causal_f32(&c, &x)?;
    assert_eq!(half, [f16, f16, f32, f32]);
    assert_eq!(full, [f32; 4]);
    // The first query attends to itself only; fp16 scores track the f32 ones.
    let diff = (amp.as_candle() - reference.as_candle())?
        .abs()?
        .max_all()?;
    assert!(diff.to_scalar::<f32>()? < 2e-3, "{diff}");
    assert_eq!(
        amp.as_candle().i((0, 0, 0))?.to_vec1::<f32>()?,
        [1.0, 0.0, 0.0]
    );
    Ok(())
}

/// Candle's tensor methods on region values, each in its class: (name, dtype, values as f32).
#[autocast(fp16)]
fn candle_methods(
    x: &Tensor<F32>,
    y: &Tensor<F32>,
) -> Result<Vec<(&'static str, DType, Vec<f32>)>> {
    fn row(
        name: &'static str,
        t: impl std::borrow::Borrow<candle_core::Tensor>,
    ) -> Result<(&'static str, DType, Vec<f32>)> {
        let t = t.borrow();
        Ok((
            name,
            t.dtype(),
            t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?,
        ))
    }
    // `x` (2, 3) enters as f32; `h` is an f16 region value, `col` an f32 one (3, 1)->(2,1) column.
    let h = x.matmul(&y.t()?)?.narrow(1, 0, 3)?;
    let col = y.narrow(0, 0, 2)?.narrow(1, 0, 1)?;
    assert_eq!((h.rank(), h.elem_count(), h.dims2()?), (2, 6, (2, 3)));
    assert_eq!(
        h.unsqueeze(0)?.unsqueeze(3)?.unsqueeze(4)?.dims5()?,
        (1, 2, 3, 1, 1)
    );
    assert_eq!(h.flatten_all()?.dims1()?, 6);
    let chunks = h.chunk(3, 1)?;
    let stacked = Tensor::stack(&[&chunks[0], &chunks[2]], 0)?;
    let high = h.broadcast_gt(&col)?;
    Ok(vec![
        row("h", &h)?,
        row(
            "permute+squeeze",
            h.unsqueeze(0)?.permute((0, 2, 1))?.squeeze(0)?,
        )?,
        row("stack", stacked)?,
        row("ones_like", h.ones_like()?)?,
        row("maximum", h.maximum(&h.neg()?)?)?,
        row("broadcast_maximum", h.broadcast_maximum(&col)?)?,
        row("broadcast_minimum", h.broadcast_minimum(&col)?)?,
        row("broadcast_gt", &high)?,
        row("broadcast_eq", &h.broadcast_eq(&h)?)?,
        row(
            "where_cond",
            high.where_cond(&h, &col.broadcast_as((2, 3))?)?,
        )?,
        row("clamp", h.clamp(-0.5, 0.5)?)?,
        row("gelu", h.gelu()?)?,
        row("silu", h.silu()?)?,
        row("tanh", h.tanh()?)?,
        row("powf", h.abs()?.powf(1.5)?)?,
        row("broadcast_pow", h.abs()?.broadcast_pow(&col.abs()?)?)?,
    ])
}

#[test]
fn region_values_have_candles_tensor_methods_in_their_classes() -> Result<()> {
    let x = Tensor::<F32>::new(&[[0.5f32, -1.0, 2.0], [1.5, 0.25, -0.75]], &dev())?;
    let y = Tensor::<F32>::new(
        &[[1.0f32, 0.5, -0.5], [-1.0, 2.0, 0.25], [0.75, -0.25, 1.0]],
        &dev(),
    )?;
    let rows = candle_methods(&x, &y)?;
    // The same computation in plain candle f32, op by op: the reference values.
    let (xc, yc) = (x.as_candle(), y.as_candle());
    let h = xc.matmul(&yc.t()?)?;
    let col = yc.narrow(0, 0, 2)?.narrow(1, 0, 1)?;
    let high = h.broadcast_gt(&col)?;
    let expected: Vec<(&str, DType, candle_core::Tensor)> = vec![
        ("h", DType::F16, h.clone()),
        ("permute+squeeze", DType::F16, h.t()?),
        (
            "stack",
            DType::F16,
            candle_core::Tensor::stack(&[h.narrow(1, 0, 1)?, h.narrow(1, 2, 1)?], 0)?,
        ),
        ("ones_like", DType::F16, h.ones_like()?),
        ("maximum", DType::F16, h.abs()?),
        // Promote: an f16 and an f32 operand meet in f32.
        ("broadcast_maximum", DType::F32, h.broadcast_maximum(&col)?),
        ("broadcast_minimum", DType::F32, h.broadcast_minimum(&col)?),
        ("broadcast_gt", DType::U8, high.clone()),
        (
            "broadcast_eq",
            DType::U8,
            h.ones_like()?.to_dtype(DType::U8)?,
        ),
        (
            "where_cond",
            DType::F32,
            high.where_cond(&h, &col.broadcast_as((2, 3))?)?,
        ),
        ("clamp", DType::F16, h.clamp(-0.5, 0.5)?),
        ("gelu", DType::F16, h.gelu()?),
        ("silu", DType::F16, h.silu()?),
        ("tanh", DType::F16, h.tanh()?),
        // fp32-class: pow and its broadcasting form run in f32.
        ("powf", DType::F32, h.abs()?.powf(1.5)?),
        (
            "broadcast_pow",
            DType::F32,
            h.abs()?.broadcast_pow(&col.abs()?)?,
        ),
    ];
    assert_eq!(rows.len(), expected.len());
    for ((name, dtype, got), (want_name, want_dtype, want)) in rows.iter().zip(&expected) {
        assert_eq!((name, dtype), (want_name, want_dtype));
        let want: Vec<f32> = want.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        assert_eq!(got.len(), want.len(), "{name}");
        for (g, w) in got.iter().zip(&want) {
            // The half results carry f16 rounding of the matmul (|h| <= 4: 2e-3) and the op's own.
            assert!(
                (g - w).abs() <= 4e-3 * w.abs().max(1.0),
                "{name}: {got:?} vs {want:?}"
            );
        }
    }
    Ok(())
}

// ---- Boundaries as candle code writes them: candle tensors passed through, references kept. ----

struct Lookup {
    emb: nn::Embedding,
    fc: nn::Linear,
}

#[autocast]
impl Lookup {
    /// Token ids arrive as a plain candle tensor (never cast); `x` is used twice, as the
    /// reference it is declared as.
    fn forward(&self, ids: &candle_core::Tensor, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        assert_eq!(ids.dtype(), DType::U32);
        let e = self.emb.forward(ids)?;
        let h = self.fc.forward(x)?;
        assert_eq!(
            (e.dtype(), h.dtype(), x.dtype()),
            (DType::F32, lower_of_this_test(), DType::F32)
        );
        let twice = self.fc.forward(x)?;
        Ok(((&e + &h)? + &twice)?)
    }
}

#[autocast(bf16)]
fn lookup_bf16(l: &Lookup, ids: &candle_core::Tensor, x: &Tensor<F32>) -> Result<Tensor<F32>> {
    let y = l.forward(ids, x)?;
    assert_eq!(y.dtype(), DType::F32);
    Ok(y)
}

#[test]
fn candle_tensors_pass_through_and_reference_parameters_stay_references() -> Result<()> {
    let (_map, vb) = vars();
    let l = Lookup {
        emb: nn::embedding(5, 4, vb.pp("emb"))?,
        fc: nn::linear(4, 4, vb.pp("fc"))?,
    };
    let ids = candle_core::Tensor::new(&[0u32, 3, 4], &dev())?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (3, 4), &dev())?;
    EXPECTED_LOWER.with(|e| e.set(DType::BF16));
    let mixed = lookup_bf16(&l, &ids, &x)?;
    EXPECTED_LOWER.with(|e| e.set(DType::F32));
    let full = l.forward(&ids, &x)?;
    let diff = (mixed.as_candle() - full.as_candle())?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    let scale = full.as_candle().abs()?.max_all()?.to_scalar::<f32>()?;
    // bf16 keeps 8 bits of mantissa: a relative error of a few 2^-8 through three matmuls.
    assert!(diff < 0.03 * scale, "bf16 against f32: {diff} of {scale}");
    Ok(())
}

// ---- Foreign ops: any candle function, routed by the class the caller states. ----

#[autocast(fp16)]
fn foreign(x: &Tensor<F32>) -> Result<Vec<DType>> {
    let h = x.lower_op(candle_nn::ops::silu)?;
    Ok(vec![
        h.dtype(),
        h.fp32_op(candle_core::Tensor::exp)?.dtype(),
        h.preserve_op(|t| t.elu(1.0))?.dtype(),
        x.preserve_op(|t| t.elu(1.0))?.dtype(),
    ])
}

#[test]
fn foreign_ops_run_in_the_class_their_caller_states() -> Result<()> {
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 3), &dev())?;
    let (f16, f32) = (DType::F16, DType::F32);
    assert_eq!(foreign(&x)?, [f16, f32, f16, f32]);
    // Outside a region: the typed forms, `fp32_op` on `Tensor<F32>` only.
    let s: Tensor<F32> = x.fp32_op(candle_core::Tensor::exp)?;
    assert_eq!(s.dims(), &[2, 3]);
    let h = x.cast::<F16>()?.lower_op(candle_nn::ops::silu)?;
    assert_eq!(h.dtype(), f16);
    // A function whose result has another dtype is an error, never a mistyped tensor.
    assert!(x.lower_op(|t| t.to_dtype(DType::F16)).is_err());
    Ok(())
}

/// A module taking an optional additive mask by reference, as candle-transformers' attention.
struct Masked;

#[autocast]
impl Masked {
    fn forward(&self, x: &Tensor<F32>, mask: Option<&candle_core::Tensor>) -> Result<Tensor<F32>> {
        let scores = x.matmul(&x.t()?)?;
        let scores = match mask {
            Some(m) => scores.broadcast_add(m)?,
            None => scores,
        };
        assert_eq!(
            scores.dtype(),
            if mask.is_some() {
                DType::F32
            } else {
                DType::F16
            }
        );
        Ok(scores)
    }
}

#[autocast(fp16)]
fn masked_fp16(m: &Masked, x: &Tensor<F32>, mask: &candle_core::Tensor) -> Result<Tensor<F32>> {
    let unmasked = m.forward(x, None)?;
    let masked = m.forward(x, Some(mask))?;
    Ok((&masked - &unmasked)?)
}

#[test]
fn modules_take_optional_candle_masks_by_reference() -> Result<()> {
    let x = Tensor::<F32>::ones((2, 3), &dev())?;
    let mask = candle_core::Tensor::new(&[[0f32, -1e4], [0., 0.]], &dev())?;
    let diff = masked_fp16(&Masked, &x, &mask)?;
    assert_eq!(diff.to_vec2::<f32>()?, [[0., -1e4], [0., 0.]]);
    Ok(())
}

// ---- A master written in place by candle inside a region part. ----

/// Uses `w` (the value of `var`), writes `new` into `var` with candle's `Var::set`, clears the
/// weight-cast cache, and uses `w` again: all in one region part.
#[autocast(fp16)]
fn products_around_a_set(
    x: &Tensor<F32>,
    w: &Tensor<F32>,
    var: &candle_core::Var,
    new: &candle_core::Tensor,
) -> Result<(Tensor<F32>, Tensor<F32>)> {
    let before = x.matmul(w)?;
    var.set(new)?;
    candle_amp::clear_autocast_cache();
    let after = x.matmul(w)?;
    Ok((before, after))
}

/// candle's tensors carry no version counter, so no cache sees `Var::set` write a master it has
/// a cast of; `clear_autocast_cache()` (PyTorch's name) after the write makes the next use cast
/// the new value: the second product is the new weight's (f16 products against the f32 ones).
#[test]
fn clearing_the_cast_cache_after_var_set_gives_the_new_weight() -> Result<()> {
    let var = candle_core::Var::randn(0f32, 0.3, (8, 8), &dev())?;
    let new = candle_core::Tensor::randn(0f32, 0.3, (8, 8), &dev())?;
    let old = var.as_tensor().copy()?;
    let w = Tensor::<F32>::from_candle(var.as_tensor().clone())?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 8), &dev())?;
    let (before, after) = products_around_a_set(&x, &w, &var, &new)?;
    let close = |got: &Tensor<F32>, weight: &candle_core::Tensor| -> Result<f32> {
        let want = x.as_candle().matmul(weight)?;
        (got.as_candle() - want)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()
    };
    // f16 operands and products: within a few units of f16's last place of values near 1.
    assert!(
        close(&before, &old)? < 1e-2,
        "the first product is the old weight's"
    );
    assert!(
        close(&after, &new)? < 1e-2,
        "the second product is the new weight's"
    );
    assert!(close(&after, &old)? > 0.1, "and not the old weight's");
    Ok(())
}

// ---- No stale weights: optimizer steps inside a long region see their own updates. ----
//
// The weight is a master used as it is (`x.matmul(w)`), so its cast is cached for the region
// part that makes it; `nn::Linear` would round its masters inside its own op and cache nothing.

struct Net {
    w: Tensor<F32>,
}

#[autocast(fp16)]
impl Net {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        Ok(x.matmul(&self.w)?.relu()?)
    }
}

/// A plain helper: forward, loss, backward and SGD step, as a training loop calls it.
fn train_step(
    net: &Net,
    opt: &mut candle_nn::SGD,
    x: &Tensor<F32>,
    y: &Tensor<F32>,
) -> Result<f32> {
    use candle_nn::Optimizer;
    let l = loss::mse(&net.forward(x)?, y)?;
    opt.backward_step(l.as_candle())?;
    l.as_candle().to_scalar()
}

type Batches = Vec<(Tensor<F32>, Tensor<F32>)>;

/// A whole epoch under one region, the optimizer stepping in the plain helper.
#[autocast(fp16)]
fn epoch_in_a_region(net: &Net, opt: &mut candle_nn::SGD, batches: &Batches) -> Result<Vec<f32>> {
    batches
        .iter()
        .map(|(x, y)| train_step(net, opt, x, y))
        .collect()
}

/// The same epoch with the forward written in the region's own body (the weight's cast is
/// cached for the whole body), stepping through the scaler.
#[autocast(fp16)]
fn inline_epoch(
    w: &Tensor<F32>,
    opt: &mut candle_nn::SGD,
    scaler: &mut candle_amp::GradScaler,
    batches: &Batches,
) -> Result<Vec<f32>> {
    let mut losses = Vec::new();
    for (x, y) in batches {
        let l = loss::mse(&x.matmul(w)?.relu()?, y)?;
        losses.push(scaled_step(scaler, opt, &l)?);
    }
    Ok(losses)
}

/// One batch of `inline_epoch`, as its own region: the reference.
#[autocast(fp16)]
fn inline_batch(
    w: &Tensor<F32>,
    opt: &mut candle_nn::SGD,
    scaler: &mut candle_amp::GradScaler,
    x: &Tensor<F32>,
    y: &Tensor<F32>,
) -> Result<f32> {
    let l = loss::mse(&x.matmul(w)?.relu()?, y)?;
    scaled_step(scaler, opt, &l)
}

fn scaled_step(
    scaler: &mut candle_amp::GradScaler,
    opt: &mut candle_nn::SGD,
    l: &candle_core::Tensor,
) -> Result<f32> {
    let grads = scaler.scale(l)?.backward()?;
    assert!(scaler.step(opt, grads)?.is_stepped());
    scaler.update()?;
    l.to_scalar()
}

/// `n` values in [-1, 1), the same on every run: the test compares runs of the same
/// program, and random data could overflow fp16 at the default scale and skip a step.
fn fixed_values(n: usize, phase: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32) * 0.73 + phase).sin()).collect()
}

/// The master weight (4, 3), its initial value, an SGD on it, and four batches.
fn stale_setup() -> Result<(
    candle_core::Var,
    candle_core::Tensor,
    candle_nn::SGD,
    Batches,
)> {
    let init = (candle_core::Tensor::from_vec(fixed_values(12, 0.3), (4, 3), &dev())? * 0.5)?;
    let master = candle_core::Var::from_tensor(&init)?;
    let opt = <candle_nn::SGD as candle_nn::Optimizer>::new(vec![master.clone()], 0.5)?;
    let batches = (0..4u8)
        .map(|i| {
            let x = candle_core::Tensor::from_vec(fixed_values(32, f32::from(i)), (8, 4), &dev())?;
            let y = Tensor::<F32>::full(0.5 + f64::from(i) * 0.1, (8, 3), &dev())?;
            Ok((Tensor::<F32>::from_candle(x)?, y))
        })
        .collect::<Result<_>>()?;
    Ok((master, init, opt, batches))
}

/// The losses of the epoch with a new variable (a new cache key) for every batch, its value
/// carried over from the previous step: no cast can be reused, stale or not.
fn fresh_variable_losses(init: &candle_core::Tensor, batches: &Batches) -> Result<Vec<f32>> {
    let mut value = init.clone();
    let mut losses = Vec::new();
    for (x, y) in batches {
        let master = candle_core::Var::from_tensor(&value)?;
        let net = Net {
            w: Tensor::<F32>::from_candle(master.as_tensor().clone())?,
        };
        let mut opt = <candle_nn::SGD as candle_nn::Optimizer>::new(vec![master.clone()], 0.5)?;
        losses.push(train_step(&net, &mut opt, x, y)?);
        value = master.as_tensor().copy()?;
    }
    Ok(losses)
}

#[test]
fn an_epoch_inside_one_region_never_reuses_a_stale_weight_cast() -> Result<()> {
    let (master, init, mut opt, batches) = stale_setup()?;
    let net = Net {
        w: Tensor::<F32>::from_candle(master.as_tensor().clone())?,
    };
    // Outside a region: each forward is its own region, and its casts end with it.
    let outside: Vec<f32> = batches
        .iter()
        .map(|(x, y)| train_step(&net, &mut opt, x, y))
        .collect::<Result<_>>()?;
    assert_eq!(outside, fresh_variable_losses(&init, &batches)?);
    master.set(&init)?;
    let inside = epoch_in_a_region(&net, &mut opt, &batches)?;
    assert_eq!(inside, outside);
    // The losses move: the weights did change between the forwards.
    assert!(
        outside.windows(2).all(|w| (w[0] - w[1]).abs() > 1e-3),
        "{outside:?}"
    );

    // The forward in the region's body itself: the scaler's step drops the cast.
    master.set(&init)?;
    let mut scaler = candle_amp::GradScaler::new();
    let reference: Vec<f32> = batches
        .iter()
        .map(|(x, y)| inline_batch(&net.w, &mut opt, &mut scaler, x, y))
        .collect::<Result<_>>()?;
    master.set(&init)?;
    let mut scaler = candle_amp::GradScaler::new();
    let inline = inline_epoch(&net.w, &mut opt, &mut scaler, &batches)?;
    assert_eq!(inline, reference);
    assert!(
        reference.windows(2).all(|w| (w[0] - w[1]).abs() > 1e-3),
        "{reference:?}"
    );
    Ok(())
}

// ---- Module results that are tuples of tensors. ----

/// Splits a projection in two, as an attention block returns `(k, v)`.
struct Split {
    fc: nn::Linear,
}

#[autocast]
impl Split {
    fn forward(&self, x: &Tensor<F32>) -> Result<(Tensor<F32>, Tensor<F32>)> {
        let h = self.fc.forward(x)?;
        let half = h.dim(1)? / 2;
        Ok((h.narrow(1, 0, half)?, h.narrow(1, half, half)?))
    }
}

#[autocast(fp16)]
fn split_fp16(s: &Split, x: &Tensor<F32>) -> Result<(Tensor<F32>, Vec<DType>)> {
    let (k, v) = s.forward(x)?;
    let dtypes = vec![k.dtype(), v.dtype()];
    Ok(((k + v)?.cast::<F32>()?, dtypes))
}

#[test]
fn a_module_returns_a_tuple_of_region_values_to_a_region_and_typed_tensors_outside() -> Result<()> {
    let (_map, vb) = vars();
    let s = Split {
        fc: nn::linear(3, 4, vb.pp("fc"))?,
    };
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 3), &dev())?;
    let (sum, dtypes) = split_fp16(&s, &x)?;
    assert_eq!(dtypes, [DType::F16, DType::F16]);
    // Called directly: the declared `(Tensor<F32>, Tensor<F32>)`, each cast back, f32 inside.
    let (k, v) = s.forward(&x)?;
    assert_eq!((k.dims(), v.dims()), (&[2, 2][..], &[2, 2][..]));
    let reference = (k.as_candle() + v.as_candle())?;
    let diff = (sum.as_candle() - &reference)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    assert!(diff < 1e-2, "fp16 against f32: {diff}");
    Ok(())
}

// ---- Optional and sliced tensor parameters, from a region and from plain code. ----

/// Cross-attention style: an optional second input and a list of residuals.
struct Mixer {
    fc: nn::Linear,
}

#[autocast]
impl Mixer {
    fn forward(
        &self,
        x: &Tensor<F32>,
        context: Option<&Tensor<F32>>,
        residuals: &[Tensor<F32>],
    ) -> Result<Tensor<F32>> {
        let mut h = self.fc.forward(x)?;
        if let Some(c) = context {
            h = h.matmul(&c.t()?)?.matmul(c)?;
        }
        for r in residuals {
            h = (h + r)?;
        }
        Ok(h)
    }
}

#[autocast(bf16)]
fn mixer_bf16(m: &Mixer, x: &Tensor<F32>) -> Result<(Tensor<F32>, Vec<DType>)> {
    let c = m.fc.forward(x)?;
    let plain = m.forward(x, None, &[])?;
    let with = m.forward(x, Some(&c), &[c.clone(), plain.clone()])?;
    let dtypes = vec![plain.dtype(), with.dtype()];
    Ok((with.cast::<F32>()?, dtypes))
}

#[test]
fn optional_and_sliced_tensor_parameters_take_region_values() -> Result<()> {
    let (_map, vb) = vars();
    let m = Mixer {
        fc: nn::linear(3, 3, vb.pp("fc"))?,
    };
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 3), &dev())?;
    let (mixed, dtypes) = mixer_bf16(&m, &x)?;
    assert_eq!(dtypes, [DType::BF16, DType::BF16]);
    // The same from plain code, typed tensors, f32 throughout.
    let c = m.fc.forward(&x)?;
    let plain = m.forward(&x, None, &[])?;
    let full = m.forward(&x, Some(&c), &[c.clone(), plain])?;
    let diff = (mixed.as_candle() - full.as_candle())?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    let scale = full.as_candle().abs()?.max_all()?.to_scalar::<f32>()?;
    // bf16 keeps 8 bits of mantissa: a relative error of a few 2^-8 through three matmuls.
    assert!(diff < 0.03 * scale, "bf16 against f32: {diff} of {scale}");
    Ok(())
}

// ---- Operators, closures and statement forms follow the policy of where they run. ----

candle_amp::policy! {
    /// Binary ops and affine maps moved to f32.
    pub struct WideArithmetic: fp16 {
        add: fp32,
        mul: fp32,
        affine: fp32,
    }
}

/// Each form next to the method it stands for, inside `#[keep_fp32]` statements and blocks.
#[autocast(fp16)]
fn operators_kept(x: &Tensor<F32>) -> Result<Vec<DType>> {
    let h = x.matmul(x)?; // f16
    let proj = |t: &AmpTensor| t.matmul(t);
    let mixed = |t: &AmpTensor| &(t + t)? * 2.0;
    #[keep_fp32]
    let a = (&h + &h)?;
    #[keep_fp32]
    let b = (&h * 2.0)?;
    #[keep_fp32]
    let c = (1.0 - &h)?;
    #[keep_fp32]
    let d = (&h * &h)?;
    #[keep_fp32]
    let e = proj(&h)?;
    #[keep_fp32]
    let f = mixed(&h)?;
    #[keep_fp32]
    let Ok(g) = proj(&h) else {
        candle_core::bail!("unreachable")
    };
    let inside;
    #[keep_fp32]
    {
        inside = (&h - &h.relu()?)?.dtype();
    }
    #[keep_fp32]
    assert_eq!(proj(&h)?.dtype(), DType::F32, "a macro statement's callees");
    // Outside `#[keep_fp32]`: the region's own classes.
    let outside = vec![(&h + &h)?.dtype(), (&h * 2.0)?.dtype(), proj(&h)?.dtype()];
    let mut dtypes = [a, b, c, d, e, f, g]
        .iter()
        .map(AmpTensor::dtype)
        .collect::<Vec<_>>();
    dtypes.push(inside);
    dtypes.extend(outside);
    Ok(dtypes)
}

#[autocast(policy = WideArithmetic)]
fn operators_under_a_policy(x: &Tensor<F32>) -> Result<Vec<DType>> {
    let h = x.matmul(x)?; // f16
    Ok(vec![
        (&h + &h)?.dtype(),
        (&h * &h)?.dtype(),
        (&h * 2.0)?.dtype(),
        (&h - &h.relu()?)?.dtype(),
    ])
}

#[autocast(fp16, enabled = false)]
fn operators_disabled(x: &Tensor<F16>) -> Result<Vec<DType>> {
    Ok(vec![
        x.add(x)?.dtype(),
        (x + x)?.dtype(),
        (x * 2.0)?.dtype(),
    ])
}

#[test]
fn operators_closures_and_statement_forms_run_under_the_policy_where_they_run() -> Result<()> {
    use DType::{F16 as H, F32 as S};
    let x = Tensor::<F32>::randn(0.0, 1.0, (4, 4), &dev())?;
    assert_eq!(operators_kept(&x)?, [S, S, S, S, S, S, S, S, H, H, H]);
    // `add` and `mul` moved to f32, `affine` too; `sub` still promotes (f16 with f16).
    assert_eq!(operators_under_a_policy(&x)?, [S, S, S, H]);
    let x16 = x.cast::<F16>()?;
    let disabled = operators_disabled(&x16)?;
    assert_eq!(disabled[1], disabled[0], "{disabled:?}");
    assert_eq!(disabled[2], disabled[0], "{disabled:?}");
    Ok(())
}

/// candle-nn's activations and the dropout layer, module calls on a region value: routed as the
/// ops they are, so `#[keep_fp32]` and a `policy!` reach them as they reach `h.relu()`.
#[autocast(fp16)]
fn layers_kept(x: &Tensor<F32>, act: &candle_nn::Activation) -> Result<Vec<DType>> {
    let h = x.matmul(x)?; // f16
    let drop = nn::Dropout::new(0.5);
    let plain = vec![act.forward(&h)?.dtype(), drop.forward(&h, false)?.dtype()];
    #[keep_fp32]
    let a = act.forward(&h)?;
    #[keep_fp32]
    let d = drop.forward(&h, false)?;
    #[candle_amp::keep_fp32] // the marker by its path, the same
    let p = act.forward(&h)?;
    Ok([plain, vec![a.dtype(), d.dtype(), p.dtype()]].concat())
}

#[autocast(policy = AttentionPolicy)]
fn gelu_module(x: &Tensor<F32>) -> Result<DType> {
    let h = x.matmul(x)?; // f16
    Ok(candle_nn::Activation::NewGelu.forward(&h)?.dtype())
}

#[test]
fn activation_and_dropout_modules_follow_keep_fp32_and_policies() -> Result<()> {
    use candle_nn::Activation;
    use DType::{F16 as H, F32 as S};
    let x = Tensor::<F32>::randn(0.0, 1.0, (4, 4), &dev())?;
    for act in [
        Activation::Relu,
        Activation::Gelu,
        Activation::Silu,
        Activation::Elu(1.0),
    ] {
        assert_eq!(layers_kept(&x, &act)?, [H, H, S, S, S], "{act:?}");
    }
    // AttentionPolicy moves gelu to f32.
    assert_eq!(gelu_module(&x)?, S);
    Ok(())
}

/// A user's newtype over a tensor: with `AsAmp` it is routed like the tensor.
struct Param(Tensor<F32>);

impl std::ops::Deref for Param {
    type Target = Tensor<F32>;
    fn deref(&self) -> &Tensor<F32> {
        &self.0
    }
}

impl candle_amp::AsAmp for Param {
    fn to_amp(&self) -> candle_amp::AmpTensor {
        self.0.to_amp()
    }
}

struct Shared {
    param: Param,
    arc: std::sync::Arc<Tensor<F32>>,
    boxed: Box<Tensor<F32>>,
    plain: Tensor<F32>,
    cell: std::cell::RefCell<Tensor<F32>>,
    locked: std::sync::Mutex<Tensor<F32>>,
    rw: std::sync::RwLock<Tensor<F32>>,
}

#[autocast(fp16)]
impl Shared {
    fn dtypes(&mut self) -> Result<Vec<DType>> {
        let cow = std::borrow::Cow::Borrowed(&self.plain);
        let pinned = std::pin::Pin::new(&self.plain);
        let mut dtypes = vec![
            self.plain.matmul(&self.plain)?.dtype(),
            self.arc.matmul(&self.plain)?.dtype(),
            self.boxed.matmul(&self.arc)?.dtype(),
            Tensor::matmul(&self.plain, &self.plain)?.dtype(),
            Tensor::<F32>::matmul(&self.plain, &self.plain)?.dtype(),
            <Tensor<F32>>::matmul(&self.plain, &self.plain)?.dtype(),
            cow.matmul(&self.plain)?.dtype(),
            pinned.matmul(&self.plain)?.dtype(),
            self.cell.borrow().matmul(&self.plain)?.dtype(),
            self.locked
                .lock()
                .expect("lock")
                .matmul(&self.plain)?
                .dtype(),
            self.rw.read().expect("lock").matmul(&self.plain)?.dtype(),
        ];
        // Each guard in its own statement: a statement's temporaries live to its end.
        dtypes.push(self.cell.borrow_mut().matmul(&self.plain)?.dtype());
        dtypes.push(self.rw.write().expect("lock").matmul(&self.plain)?.dtype());
        dtypes.push(self.param.matmul(&self.plain)?.dtype());
        let plain = &mut self.plain;
        dtypes.push(plain.matmul(&self.arc)?.dtype());
        for t in std::iter::once(&mut self.boxed) {
            dtypes.push(t.matmul(&self.arc)?.dtype());
        }
        Ok(dtypes)
    }
}

/// A tensor behind `Arc`, `Box`, `&mut`, `Cow`, `Pin`, a `RefCell`'s borrows, a lock's guards
/// or a newtype with `AsAmp` is routed like the tensor itself (it reached the typed op through `Deref` and ran in f32),
/// and so is a method called by its path (`Tensor::matmul`, `Tensor::<F32>::matmul`,
/// `<Tensor<F32>>::matmul`).
#[test]
fn tensors_behind_pointers_and_guards_and_methods_called_by_path_are_routed() -> Result<()> {
    let t = Tensor::<F32>::randn(0.0, 1.0, (3, 3), &dev())?;
    let mut shared = Shared {
        arc: std::sync::Arc::new(t.clone()),
        boxed: Box::new(t.clone()),
        cell: std::cell::RefCell::new(t.clone()),
        locked: std::sync::Mutex::new(t.clone()),
        rw: std::sync::RwLock::new(t.clone()),
        param: Param(t.clone()),
        plain: t,
    };
    assert_eq!(shared.dtypes()?, [DType::F16; 16]);
    Ok(())
}

struct Head {
    fc: nn::Linear,
}

#[autocast(output = f32)]
impl Head {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        self.fc.forward(x)
    }
}

struct Body {
    fc: nn::Linear,
}

#[autocast]
impl Body {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        self.fc.forward(x)
    }
}

#[autocast(fp16)]
fn heads(head: &Head, body: &Body, x: &Tensor<F32>) -> Result<Vec<DType>> {
    Ok(vec![head.forward(x)?.dtype(), body.forward(x)?.dtype()])
}

/// A module declaring `output = f32` gives the calling region f32, as declared; one without
/// gives back what its body made (f16 here), as a PyTorch submodule does.
#[test]
fn a_declared_output_holds_for_the_calling_region() -> Result<()> {
    let (_map, vb) = vars();
    let head = Head {
        fc: nn::linear(4, 2, vb.pp("head"))?,
    };
    let body = Body {
        fc: nn::linear(4, 2, vb.pp("body"))?,
    };
    let x = Tensor::<F32>::randn(0.0, 1.0, (3, 4), &dev())?;
    assert_eq!(heads(&head, &body, &x)?, [DType::F32, DType::F16]);
    Ok(())
}

/// `#[keep_fp32]` on every statement form and in expression position: each marked op runs in
/// f32 (these forms did not compile), and a body ending in `return` compiles.
#[autocast(fp16)]
fn statement_forms(x: &Tensor<F32>, flag: Option<u8>) -> Result<Vec<DType>> {
    let h = x.matmul(x)?; // f16
    let mut out = vec![h.relu()?.dtype()];
    #[keep_fp32]
    match flag {
        Some(_) => out.push(h.relu()?.dtype()),
        None => out.push(h.sqr()?.dtype()),
    }
    let mut i = 0;
    #[keep_fp32]
    while i < 1 {
        out.push(h.relu()?.dtype());
        i += 1;
    }
    let mut n = 0;
    #[keep_fp32]
    loop {
        out.push(h.relu()?.dtype());
        n += 1;
        if n == 1 {
            break;
        }
    }
    let s = #[keep_fp32]
    h.relu()?;
    out.push(s.dtype());
    let (a, b);
    #[keep_fp32]
    (a, b) = (h.relu()?, h.sqr()?);
    out.extend([a.dtype(), b.dtype()]);
    #[keep_fp32]
    return Ok([out, vec![h.relu()?.dtype()]].concat());
}

#[test]
fn keep_fp32_reaches_every_statement_form() -> Result<()> {
    let x = Tensor::<F32>::randn(0.0, 1.0, (3, 3), &dev())?;
    let mut want = vec![DType::F32; 8];
    want[0] = DType::F16;
    assert_eq!(statement_forms(&x, Some(1))?, want);
    Ok(())
}

// ---- Autocast is per thread: typed tensors in plain code a region calls follow its policy. ----

/// Weights held as typed fields, and a layer.
struct Heads {
    q: Tensor<F32>,
    k: Tensor<F32>,
    out: nn::Linear,
}

/// A plain helper given typed tensors: no macro rewrites it.
fn scores(q: &Tensor<F32>, k: &Tensor<F32>) -> Result<Tensor<F32>> {
    q.matmul(&k.t()?)
}

/// A plain helper with a typed free op and a typed operator.
fn probs_and_sum(a: &Heads) -> Result<(Tensor<F32>, Tensor<F32>)> {
    Ok((ops::softmax(&a.q, 1)?, (&a.q + &a.k)?))
}

trait Project {
    fn layer(&self) -> &nn::Linear;

    /// A trait default method: plain code too.
    fn project(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        self.layer().forward(x)
    }
}

impl Project for Heads {
    fn layer(&self) -> &nn::Linear {
        &self.out
    }
}

/// Each helper called from a region, and once from a `#[keep_fp32]` statement (PyTorch's
/// `autocast(enabled=False)`: typed code runs as written there).
#[autocast(bf16)]
fn helpers_in_a_region(
    a: &Heads,
    f: &dyn Fn(&Tensor<F32>) -> Result<Tensor<F32>>,
) -> Result<Vec<candle_core::Tensor>> {
    let s = scores(&a.q, &a.k)?;
    let p = a.project(&a.q)?;
    let c = f(&a.k)?;
    #[keep_fp32]
    let kept = scores(&a.q, &a.k)?;
    let (soft, sum) = probs_and_sum(a)?;
    // Autocast state is per thread: work handed to another thread runs as written.
    let elsewhere = std::thread::scope(|t| t.spawn(|| scores(&a.q, &a.k)).join())
        .map_err(|_| candle_core::Error::Msg("the thread panicked".into()))??;
    Ok([s, p, c, kept, soft, sum, elsewhere]
        .iter()
        .map(|t| t.as_candle().clone())
        .collect())
}

candle_amp::policy! {
    /// Softmax and add moved to the lower precision.
    pub struct LowSoftmax: bf16 {
        softmax: lower_precision,
        add: lower_precision,
    }
}

#[autocast(policy = LowSoftmax)]
fn helpers_under_a_policy(a: &Heads) -> Result<Vec<candle_core::Tensor>> {
    let (soft, sum) = probs_and_sum(a)?;
    Ok(vec![soft.as_candle().clone(), sum.as_candle().clone()])
}

fn heads_model() -> Result<(VarMap, Heads)> {
    let (map, vb) = vars();
    let attn = Heads {
        q: Tensor::<F32>::randn(0.0, 1.0, (8, 64), &dev())?,
        k: Tensor::<F32>::randn(0.0, 1.0, (8, 64), &dev())?,
        out: nn::linear(64, 16, vb.pp("out"))?,
    };
    Ok((map, attn))
}

/// `t` computed in bf16 (its inputs rounded, as a bf16 matmul does), back in f32.
fn in_bf16(t: impl FnOnce() -> Result<Tensor<BF16>>) -> Result<candle_core::Tensor> {
    Ok(t()?.cast::<F32>()?.into_candle())
}

fn same(a: &candle_core::Tensor, b: &candle_core::Tensor) -> Result<bool> {
    Ok(a.dtype() == b.dtype() && a.eq(b)?.flatten_all()?.min(0)?.to_scalar::<u8>()? == 1)
}

/// A plain fn, a trait default method and a closure written outside any region, called from
/// an `#[autocast(bf16)]` region with typed tensors (fields), run their matmuls and the layer in
/// bf16 as PyTorch's per-thread autocast does (they ran in f32, the type's precision), their
/// results cast back to the `Tensor<F32>` their signatures name; a `#[keep_fp32]` statement and
/// another thread run them as written; fp32-class and promote ops stay f32; a `policy!` moving
/// softmax and add reaches the typed free op and the typed operator.
#[test]
fn typed_tensors_in_plain_code_a_region_calls_follow_its_policy() -> Result<()> {
    let (_map, a) = heads_model()?;
    let mm = |t: &Tensor<F32>| t.matmul(&t.t()?);
    let (out, rep) = candle_amp::report::record(|| helpers_in_a_region(&a, &mm));
    let out = out?;
    let (q16, k16) = (a.q.cast::<BF16>()?, a.k.cast::<BF16>()?);
    let f32_scores = scores(&a.q, &a.k)?.into_candle();
    let expected = [
        in_bf16(|| q16.matmul(&k16.t()?))?,
        in_bf16(|| a.out.forward(&q16))?,
        in_bf16(|| k16.matmul(&k16.t()?))?,
        f32_scores.clone(),
        ops::softmax(&a.q, 1)?.into_candle(),
        (&a.q + &a.k)?.into_candle(),
        f32_scores.clone(),
    ];
    assert_eq!(out.len(), expected.len());
    for (i, (got, want)) in out.iter().zip(&expected).enumerate() {
        assert!(same(got, want)?, "result {i}: {got} vs {want}");
    }
    assert!(
        !same(&out[0], &f32_scores)?,
        "the bf16 scores equal the f32 ones"
    );
    // The report sees them: two bf16 matmuls (helper, closure) and the bf16 layer; the kept
    // call left no line (it ran as written).
    let outputs = |op| rep.op(op).map(|e| (e.output, e.calls)).collect::<Vec<_>>();
    assert_eq!(outputs("matmul"), [(DType::BF16, 2)]);
    assert_eq!(outputs("linear"), [(DType::BF16, 1)]);
    assert_eq!(outputs("softmax"), [(DType::F32, 1)]);

    let (out, rep) = candle_amp::report::record(|| helpers_under_a_policy(&a));
    let out = out?;
    assert_eq!(
        rep.op("softmax").next().map(|e| e.output),
        Some(DType::BF16)
    );
    assert_eq!(rep.op("add").next().map(|e| e.output), Some(DType::BF16));
    let sum16 = in_bf16(|| &q16 + &k16)?;
    assert!(same(&out[1], &sum16)?, "{} vs {sum16}", out[1]);
    let soft32 = ops::softmax(&a.q, 1)?.into_candle();
    let err = (&out[0] - &soft32)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(err > 0.0 && err < 2e-2, "bf16 softmax off f32 by {err}");
    assert_eq!(out[0].dtype(), DType::F32);

    // Outside any region the helpers run as written.
    assert!(same(&scores(&a.q, &a.k)?.into_candle(), &f32_scores)?);
    Ok(())
}

// ---- Results in `Option`s and `Vec`s. ----

/// A region may return `Option<Tensor<P>>` or `Vec<Tensor<P>>`, each tensor leaving in the
/// declared precision; a module called from a region may return them too, its tensors coming
/// back as region values (the trait bound `RegionResult` was not satisfied for either).
#[autocast(fp16)]
fn maybe_product(x: &Tensor<F32>, on: bool) -> Result<Option<Tensor<F32>>> {
    if on {
        Ok(Some(x.matmul(&x.t()?)?))
    } else {
        Ok(None)
    }
}

struct PerHead {
    a: nn::Linear,
    b: nn::Linear,
}

#[autocast]
impl PerHead {
    fn forward(&self, x: &Tensor<F32>) -> Result<Vec<Tensor<F32>>> {
        let mut out = Vec::new();
        out.push(self.a.forward(x)?);
        out.push(self.b.forward(x)?);
        Ok(out)
    }
}

/// A module whose forward may have nothing to give.
struct MaybeHead {
    head: Option<nn::Linear>,
}

#[autocast]
impl MaybeHead {
    fn forward(&self, x: &Tensor<F32>) -> Result<Option<Tensor<F32>>> {
        match &self.head {
            Some(head) => Ok(Some(head.forward(x)?)),
            None => Ok(None),
        }
    }
}

#[autocast(bf16)]
fn heads_in_a_region(
    h: &PerHead,
    some: &MaybeHead,
    none: &MaybeHead,
    x: &Tensor<F32>,
) -> Result<Tensor<F32>> {
    let v = h.forward(x)?;
    let extra = some.forward(x)?.expect("a head");
    assert!(none.forward(x)?.is_none());
    // The heads ran under the caller's bf16 and came back as region values.
    assert_eq!(
        [v[0].dtype(), v[1].dtype(), extra.dtype()],
        [DType::BF16; 3]
    );
    let sum = (&v[0] + &v[1])?;
    Ok((sum + extra)?)
}

#[test]
fn regions_and_modules_return_options_and_vecs_of_tensors() -> Result<()> {
    let x = Tensor::<F32>::randn(0.0, 1.0, (3, 4), &dev())?;
    let p = maybe_product(&x, true)?.expect("a product");
    assert_eq!((p.dtype(), p.dims()), (DType::F32, &[3, 3][..]));
    assert!(maybe_product(&x, false)?.is_none());
    let (_map, vb) = vars();
    let heads = PerHead {
        a: nn::linear(4, 2, vb.pp("a"))?,
        b: nn::linear(4, 2, vb.pp("b"))?,
    };
    let some = MaybeHead {
        head: Some(nn::linear(4, 2, vb.pp("c"))?),
    };
    let none = MaybeHead { head: None };
    let y = heads_in_a_region(&heads, &some, &none, &x)?;
    assert_eq!((y.dtype(), y.dims()), (DType::F32, &[3, 2][..]));
    // Called from plain code, each tensor leaves as its declared f32.
    let v = heads.forward(&x)?;
    assert!(v.iter().all(|t| t.dtype() == DType::F32));
    assert_eq!(some.forward(&x)?.map(|t| t.dtype()), Some(DType::F32));
    Ok(())
}

// ---- Tensors beside text, shapes and other plain values leave as tensors do. ----

type Ct = candle_core::Tensor;

/// A bf16 product returned beside a label, a borrowed name, a shape, a character and a small
/// integer; in an array and a box.
#[autocast(bf16)]
fn labelled(x: &Ct) -> Result<(Ct, String, candle_core::Shape)> {
    let y = x.matmul(&x.t()?)?;
    let shape = y.shape().clone();
    Ok((y, "logits".to_string(), shape))
}

#[autocast(bf16)]
fn named<'a>(x: &Ct, name: &'a str) -> Result<(Ct, &'a str, char, i32, u8)> {
    Ok((x.matmul(&x.t()?)?, name, 'y', -1, 7))
}

#[autocast(bf16)]
#[allow(clippy::type_complexity)]
fn wider(x: &Ct) -> Result<(Ct, i128, &'static [usize], std::time::Duration, u8, u8, u8)> {
    let dims: &'static [usize] = &[3, 3];
    Ok((
        x.matmul(&x.t()?)?,
        -1,
        dims,
        std::time::Duration::ZERO,
        1,
        2,
        3,
    ))
}

#[autocast(bf16)]
fn paired(x: &Ct) -> Result<([Ct; 2], Box<Ct>)> {
    let y = x.matmul(&x.t()?)?;
    Ok(([y.clone(), y.clone()], Box::new(y)))
}

/// Called from f32 code, a region's tensors leave in f32 whatever plain values sit beside them
/// in a tuple, and in arrays and boxes too: a `String` or a `Shape` in the tuple left the
/// product in bf16 (the whole tuple went out unchanged) where a `usize` gave f32.
#[test]
fn tensors_beside_plain_values_leave_in_the_callers_dtype() -> Result<()> {
    let x = Ct::randn(0f32, 1.0, (3, 4), &dev())?;
    let (y, label, shape) = labelled(&x)?;
    assert_eq!(
        (y.dtype(), label.as_str(), shape.dims()),
        (DType::F32, "logits", &[3, 3][..])
    );
    let (y, name, c, i, u) = named(&x, "head")?;
    assert_eq!((y.dtype(), name, c, i, u), (DType::F32, "head", 'y', -1, 7));
    let (y, wide, dims, _, _, _, last) = wider(&x)?;
    assert_eq!(
        (y.dtype(), wide, dims, last),
        (DType::F32, -1, &[3, 3][..], 3)
    );
    let ([a, b], boxed) = paired(&x)?;
    assert_eq!([a.dtype(), b.dtype(), boxed.dtype()], [DType::F32; 3]);
    // The values are the bf16 product's, widened.
    let bf16 = x.to_dtype(DType::BF16)?;
    let want = bf16.matmul(&bf16.t()?)?.to_dtype(DType::F32)?;
    assert_eq!(a.to_vec2::<f32>()?, want.to_vec2::<f32>()?);
    Ok(())
}

// ---- Ops taken as values, not called, are routed as calls are. ----

/// In a bf16 region: candle's `matmul` taken as a value, `exp` passed to `map`, candle-nn's
/// softmax taken by its path; each result's dtype, and the product.
#[autocast(bf16)]
fn taken_ops(x: &Ct) -> Result<(Vec<DType>, Ct)> {
    let mm = candle_core::Tensor::matmul;
    let y = mm(x, &x.t()?)?;
    let half = x.to_dtype(DType::BF16)?;
    let e: Vec<Ct> = [&half, &half]
        .into_iter()
        .map(candle_core::Tensor::exp)
        .collect::<Result<_>>()?;
    let softmax = candle_nn::ops::softmax_last_dim;
    let p = softmax(&half)?;
    // Ops generic over their dimension argument take its type at the call.
    let (sum, along) = (candle_core::Tensor::sum_keepdim, candle_nn::ops::softmax);
    let (s, q) = (sum(&half, 1)?, along(&half, 0)?);
    let dtypes = [
        y.dtype(),
        e[0].dtype(),
        e[1].dtype(),
        p.dtype(),
        s.dtype(),
        q.dtype(),
    ];
    Ok((dtypes.to_vec(), y))
}

/// An op taken as a value ran unrouted: candle's f32 `matmul` in a bf16 region, candle's bf16
/// `exp` and softmax where autocast runs them in f32. Taken, each is now the routed op (the
/// product in bf16, exp and softmax in f32), as PyTorch's `mm = torch.matmul` is under
/// autocast; the product leaves to this f32 caller as the bf16 product's value in f32.
#[test]
fn ops_taken_as_values_are_routed() -> Result<()> {
    let x = Ct::randn(0f32, 1.0, (3, 3), &dev())?;
    let (dtypes, y) = taken_ops(&x)?;
    assert_eq!(
        dtypes,
        [
            DType::BF16,
            DType::F32,
            DType::F32,
            DType::F32,
            DType::F32,
            DType::F32
        ]
    );
    let half = x.to_dtype(DType::BF16)?;
    let want = half.matmul(&half.t()?)?.to_dtype(DType::F32)?;
    assert_eq!(y.to_vec2::<f32>()?, want.to_vec2::<f32>()?);
    Ok(())
}

/// A product of two tensors, as a trait object.
type Product = dyn Fn(&Ct, &Ct) -> Result<Ct>;

/// Generic code asks a function of references at any lifetime, as the taken op is.
fn apply_to<F: Fn(&Ct) -> Result<Ct>>(f: F, x: &Ct) -> Result<Ct> {
    f(x)
}

/// A user's own `ops` module and `Tensor` type, named like candle's.
mod users {
    pub mod ops {
        pub fn softmax(t: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
            t.affine(3.0, 0.0)
        }
    }
    pub struct Tensor(pub f32);
    impl Tensor {
        pub fn exp(&self) -> f32 {
            self.0 + 1.0
        }
    }
}

/// Taken ops where generic code, a boxed `dyn Fn`, a returned `impl Fn` and a closure of its own
/// use them, and an array of two; a user's functions of candle's names taken as they are;
/// `clamp` of f32 bounds.
#[autocast(bf16)]
fn taken_ops_in_generic_code(x: &Ct) -> Result<Vec<DType>> {
    let half = x.to_dtype(DType::BF16)?;
    let e = apply_to(candle_core::Tensor::exp, &half)?;
    let boxed: Box<Product> = Box::new(candle_core::Tensor::matmul);
    let y = boxed(x, x)?;
    let mm = candle_core::Tensor::matmul;
    let square = |t: &Ct| mm(t, t);
    let z = square(x)?;
    let theirs = users::ops::softmax;
    let t = theirs(x)?;
    let exp = users::Tensor::exp;
    assert_eq!(exp(&users::Tensor(1.0)).to_bits(), 2f32.to_bits());
    let clamped = y.clamp(0f32, 1f32)?;
    // Several taken ops in one array, unannotated, as plain Rust takes their functions.
    let ops = [candle_core::Tensor::exp, candle_core::Tensor::sqr];
    let squared = ops[1](&half)?;
    Ok(vec![
        e.dtype(),
        y.dtype(),
        z.dtype(),
        t.dtype(),
        clamped.dtype(),
        squared.dtype(),
    ])
}

#[autocast(bf16)]
fn returns_a_taken_op() -> impl Fn(&Ct, &Ct) -> Result<Ct> {
    candle_core::Tensor::matmul
}

#[autocast(bf16)]
fn calls_in_a_region(f: &Product, x: &Ct) -> Result<DType> {
    Ok(f(x, x)?.dtype())
}

/// Taken ops keep the function's own signature, references at any lifetime: generic code,
/// `Box<dyn Fn(&Tensor, &Tensor) -> ..>` and a returned `impl Fn` take them (they did not when
/// the closure was typed by one call's lifetimes). A user's `users::ops::softmax` and
/// `users::Tensor::exp` are the user's functions, untouched. A taken op returned from a region
/// runs under the policy of the region that calls it, and as plain code outside any.
#[test]
fn taken_ops_keep_the_functions_signature() -> Result<()> {
    let x = Ct::randn(0f32, 1.0, (3, 3), &dev())?;
    let dtypes = taken_ops_in_generic_code(&x)?;
    let (f, b) = (DType::F32, DType::BF16);
    assert_eq!(dtypes, [f, b, b, f, b, f]);
    let mm = returns_a_taken_op();
    assert_eq!(mm(&x, &x)?.dtype(), DType::F32);
    assert_eq!(calls_in_a_region(&mm, &x)?, DType::BF16);
    Ok(())
}

// ---- Attention as one op: a lower-precision op, the mask never cast. ----

/// `ops::scaled_dot_product_attention` in a region, on heads split as views of one projection
/// (no `.contiguous()`), with an f32 additive mask: the dtype it ran in and its result.
#[autocast(bf16)]
fn attention_in_region(
    qkv: &Tensor<F32>,
    mask: &candle_core::Tensor,
) -> Result<(DType, candle_core::Tensor)> {
    let (b, t, c) = qkv.dims3()?;
    let heads = |i: usize| {
        qkv.narrow(2, i * c / 3, c / 3)?
            .reshape((b, t, 2, c / 6))?
            .transpose(1, 2)
    };
    let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
    let y = ops::scaled_dot_product_attention(&q, &k, &v, Some(mask), None, true)?;
    Ok((y.dtype(), y))
}

/// In a bf16 region the op runs in bf16 (its class: lower precision, as `matmul`) on the f32
/// values rounded once, and matches the f32 op on those rounded values to bf16's precision;
/// the gradient reaches the f32 input. Outside a region a typed call runs in its own precision.
#[test]
fn attention_is_a_lower_precision_op() -> Result<()> {
    let qkv = candle_core::Var::randn(0f32, 1.0, (2, 5, 24), &dev())?;
    let typed = Tensor::<F32>::from_candle(qkv.as_tensor().clone())?;
    let mask = candle_core::Tensor::randn(0f32, 1.0, (5, 5), &dev())?;
    let (dtype, y) = attention_in_region(&typed, &mask)?;
    assert_eq!(dtype, DType::BF16);

    // The f32 op on the bf16-rounded values, through the typed API outside any region.
    let rounded = Tensor::<F32>::from_candle(qkv.to_dtype(DType::BF16)?.to_dtype(DType::F32)?)?;
    let (b, t, c) = rounded.dims3()?;
    let heads = |i: usize| -> Result<Tensor<F32>> {
        rounded
            .narrow(2, i * c / 3, c / 3)?
            .reshape((b, t, 2, c / 6))?
            .transpose(1, 2)
    };
    let want = ops::scaled_dot_product_attention(
        &heads(0)?,
        &heads(1)?,
        &heads(2)?,
        Some(&mask),
        None,
        true,
    )?;
    assert_eq!(want.dtype(), DType::F32);
    let err = (y.to_dtype(DType::F32)? - want.as_candle())?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    let scale = want.as_candle().abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(
        err <= 1e-2 * scale,
        "bf16 attention off by {err} (scale {scale})"
    );

    let grads = y.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;
    let g = grads
        .get(qkv.as_tensor())
        .expect("a gradient for the f32 input");
    assert_eq!(g.dtype(), DType::F32);
    assert!(g.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0);
    Ok(())
}

// ---- Module calls by their trait's path (sweep 18). ----

#[autocast(bf16)]
fn module_calls_by_path(
    theirs: &candle_nn::Linear,
    ours: &nn::Linear,
    x: &candle_core::Tensor,
) -> Result<Vec<DType>> {
    use candle_nn::Module;
    Ok(vec![
        candle_nn::Module::forward(theirs, x)?.dtype(),
        Module::forward(theirs, x)?.dtype(),
        <candle_nn::Linear as Module>::forward(theirs, x)?.dtype(),
        Module::forward(ours, x)?.dtype(),
        theirs.forward(x)?.dtype(),
    ])
}

/// `Module::forward(&m, x)`, in any spelling of the trait's path, is the module call
/// `m.forward(x)`: routed under the region's policy (a linear layer in bf16), where it ran as
/// plain candle code in f32.
#[test]
fn module_calls_by_the_traits_path_are_routed() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let theirs = candle_nn::linear(4, 3, vb.pp("theirs"))?;
    let ours = nn::linear(4, 3, vb.pp("ours"))?;
    let x = candle_core::Tensor::ones((2, 4), DType::F32, &dev())?;
    assert_eq!(module_calls_by_path(&theirs, &ours, &x)?, [DType::BF16; 5]);
    Ok(())
}

/// A module of plain candle code, not autocast-aware.
struct PlainProjection {
    w: candle_core::Tensor,
}

impl candle_nn::Module for PlainProjection {
    fn forward(&self, x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        x.matmul(&self.w.to_dtype(x.dtype())?)
    }
}

#[autocast(bf16)]
fn plain_module_with_its_class_stated(
    p: &PlainProjection,
    x: &candle_core::Tensor,
) -> Result<(DType, DType, DType)> {
    use candle_nn::Module;
    let lower = x.lower_op(|t| p.forward(t))?;
    let by_path = x.lower_op(|t| candle_nn::Module::forward(p, t))?;
    // The closure's ops are candle's, on the f32 value: not routed to bf16 again.
    let kept = x.fp32_op(|t| t.matmul(&p.w))?;
    Ok((lower.dtype(), by_path.dtype(), kept.dtype()))
}

/// The compile error for a module that is not autocast-aware names `x.lower_op(|t|
/// layer.forward(t))` as the fix; it compiles and runs the module on the value cast to the
/// class stated, its closure as written (the module call in it was rewritten as a region module
/// call, and failed with the same error; an op in an `fp32_op` closure was routed to bf16).
#[test]
fn a_plain_module_runs_with_its_class_stated() -> Result<()> {
    let p = PlainProjection {
        w: candle_core::Tensor::ones((4, 3), DType::F32, &dev())?,
    };
    let x = candle_core::Tensor::ones((2, 4), DType::F32, &dev())?;
    assert_eq!(
        plain_module_with_its_class_stated(&p, &x)?,
        (DType::BF16, DType::BF16, DType::F32)
    );
    Ok(())
}

/// Layers shared through `Rc` or `Arc` (tied weights) are called as the layer itself, as a
/// `Box` is: they were "not autocast-aware".
struct SharedLayers {
    rc: std::rc::Rc<nn::Linear>,
    arc: std::sync::Arc<nn::Linear>,
}

#[autocast(bf16)]
impl SharedLayers {
    fn forward(&self, x: &Tensor<F32>) -> Result<(DType, DType)> {
        Ok((self.rc.forward(x)?.dtype(), self.arc.forward(x)?.dtype()))
    }
}

#[test]
fn shared_layers_are_called_as_themselves() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let layer = nn::linear(4, 3, vb.pp("l"))?;
    let shared = SharedLayers {
        rc: std::rc::Rc::new(layer.clone()),
        arc: std::sync::Arc::new(layer),
    };
    let x = Tensor::<F32>::ones((2, 4), &dev())?;
    assert_eq!(shared.forward(&x)?, (DType::BF16, DType::BF16));
    Ok(())
}

#[autocast(bf16)]
fn closure_from_a_kept_block(
    x: &candle_core::Tensor,
    w: &candle_core::Tensor,
) -> Result<(DType, DType)> {
    let g;
    let inside;
    #[keep_fp32]
    {
        g = move |t: &candle_core::Tensor| t.matmul(w);
        inside = g(x)?.dtype();
    }
    Ok((inside, g(x)?.dtype()))
}

/// A closure runs under the statement that calls it, also one written in a `#[keep_fp32]`
/// block: f32 when called there, bf16 when called after it (it ran in f32 everywhere; PyTorch's
/// lambda defined under `autocast(enabled=False)` and called under bf16 autocast gives bf16).
#[test]
fn a_closure_from_a_kept_block_runs_where_it_is_called() -> Result<()> {
    let x = candle_core::Tensor::ones((2, 2), DType::F32, &dev())?;
    assert_eq!(
        closure_from_a_kept_block(&x, &x)?,
        (DType::F32, DType::BF16)
    );
    Ok(())
}

#[autocast(bf16)]
fn through_a_borrowed_object(m: &dyn candle_amp::AmpModule, x: &Tensor<F32>) -> Result<DType> {
    Ok(m.forward(x)?.dtype())
}

/// A module taken as `&dyn AmpModule` (a borrowed object, as plain Rust reads that type) is
/// called under the region's policy; it needed `&(dyn AmpModule + 'static)` ("borrowed data
/// escapes outside of function").
#[test]
fn a_borrowed_module_object_is_called_under_the_policy() -> Result<()> {
    let vars = VarMap::new();
    let layer = nn::linear(4, 3, VarBuilder::from_varmap(&vars, DType::F32, &dev()))?;
    let x = Tensor::<F32>::ones((2, 4), &dev())?;
    assert_eq!(through_a_borrowed_object(&layer, &x)?, DType::BF16);
    Ok(())
}

type Masks = (
    candle_core::Tensor,
    candle_core::Tensor,
    candle_core::Tensor,
    candle_core::Tensor,
);

#[autocast(bf16)]
fn compared(x: &Tensor<F32>, y: &candle_core::Tensor, ids: &candle_core::Tensor) -> Result<Masks> {
    let eye = candle_core::Tensor::eye(2, DType::F32, &dev())?;
    let b = x.matmul(&eye)?; // bf16
                             // candle's ReLU6 spelling, with scalars.
    let relu6 = b.maximum(0.0)?.minimum(6.0)?;
    Ok((b.ge(y)?, b.gt(0.5)?, relu6, ids.eq(1u32)?))
}

/// candle's non-broadcast comparisons and `maximum`/`minimum` with a number are routed in a
/// region: a half value meets an f32 tensor in f32, as PyTorch promotes (it was candle's
/// "dtype mismatch in cmp"), and a number is taken as candle takes it (`h.maximum(0.0)` did not
/// compile).
#[test]
fn comparisons_and_scalar_extrema_in_a_region() -> Result<()> {
    // 1 + 2^-8 is exact in f32 and rounds to 1 in bf16 (halfway, to even).
    let x = Tensor::<F32>::from_vec(vec![1.0 + 1.0 / 256.0, 3.0, -2.0, 7.5], (2, 2), &dev())?;
    let y = candle_core::Tensor::new(&[[1.0 + 1.0 / 256.0f32, 3.0], [-2.0, 8.0]], &dev())?;
    let ids = candle_core::Tensor::new(&[1u32, 0, 1], &dev())?;
    let (ge, gt, relu6, eq) = compared(&x, &y, &ids)?;
    // Promoted to f32: bf16's 1.0 is below 1.00390625 (cast to bf16 it would be equal).
    assert_eq!(ge.to_vec2::<u8>()?, [[0, 1], [1, 0]]);
    assert_eq!(gt.to_vec2::<u8>()?, [[1, 1], [0, 1]]);
    assert_eq!(
        relu6.to_dtype(DType::F32)?.to_vec2::<f32>()?,
        [[1.0, 3.0], [0.0, 6.0]]
    );
    assert_eq!(eq.to_vec1::<u8>()?, [1, 0, 1]);
    Ok(())
}

#[autocast(fp16)]
fn with_rank0_operands(x: &Tensor<F32>) -> Result<Vec<Vec<f32>>> {
    let eye = candle_core::Tensor::eye(2, DType::F32, &dev())?;
    let h = x.matmul(&eye)?; // f16
    let scalar = |v: f32| candle_core::Tensor::new(v, &dev());
    let mut out = Vec::new();
    for y in [
        h.broadcast_mul(&scalar(f32::MIN)?)?,
        h.broadcast_mul(&scalar(1e-8)?)?,
        h.broadcast_div(&scalar(1e5)?)?,
        h.broadcast_add(&scalar(1e-4)?)?,
        // An f64 scalar (`Tensor::new(1e-8, ..)` is f64) as the f32 one.
        h.broadcast_mul(&candle_core::Tensor::new(1e-8f64, &dev())?)?,
    ] {
        assert_eq!(y.dtype(), DType::F16, "a rank-0 operand does not promote");
        out.push(y.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// A zero-dimensional f32 or f64 operand beside a half value is not rounded to half first:
/// PyTorch computes with it at full precision and rounds the result once (its dtype is still
/// half). Rounded first, `0 * f32::MIN` was NaN (candle-transformers' BERT mask, `(1 - m) *
/// f32::MIN`, was NaN at every kept position) and `1000 * 1e-8` was 0; an f64 one was candle's
/// "dtype mismatch".
#[test]
fn rank0_float_operands_are_not_rounded_to_half_first() -> Result<()> {
    let x = Tensor::<F32>::from_vec(vec![0.0, 1.0, 1000.0, 2.0], (2, 2), &dev())?;
    let got = with_rank0_operands(&x)?;
    // The f32 results by hand, each rounded once to f16.
    let once = |v: [f32; 4]| v.map(|v| half::f16::from_f32(v).to_f32()).to_vec();
    let want = [
        once([-0.0, f32::MIN, f32::NEG_INFINITY, f32::NEG_INFINITY]),
        once([0.0, 1e-8, 1e-5, 2e-8]),
        once([0.0, 1e-5, 0.01, 2e-5]),
        once([1e-4, 1.0001, 1000.0001, 2.0001]),
        once([0.0, 1e-8, 1e-5, 2e-8]),
    ];
    for (got, want) in got.iter().zip(&want) {
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(got), bits(want), "{got:?} vs {want:?}");
    }
    assert_eq!(got[0][0].to_bits(), (-0.0f32).to_bits());
    assert!(got[1][2] > 0.0, "1000 * 1e-8 is a subnormal f16, not 0");
    Ok(())
}
