//! Data parallel over threads (`distributed::ThreadGroup`): ranks that each train on their part
//! of a batch end where one process training on the whole batch ends; the GradScaler's ranks
//! skip together when one overflows; mismatched ranks are errors, not hangs or wrong sums.

use std::sync::Arc;

use candle_amp::distributed::{Collective, DataParallel, ReduceOp, ThreadCollective, ThreadGroup};
use candle_amp::nn::{self, Linear};
use candle_amp::{autocast, loss, GradScaler, StepOutcome, Tensor, F32};
use candle_core::{DType, Device, Result, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap, SGD};

mod common;

/// Runs `body(rank handle)` on one thread per rank and returns the results in rank order.
fn on_ranks<R: Send>(
    world: usize,
    body: impl Fn(ThreadCollective) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let ranks = ThreadGroup::ranks(world)?;
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks.into_iter().map(|c| s.spawn(|| body(c))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

struct Mlp {
    l1: Linear,
    l2: Linear,
}

#[autocast]
impl Mlp {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        self.l2.forward(&self.l1.forward(x)?.relu()?)
    }
}

fn mse_f32(m: &Mlp, x: &Tensor<F32>, y: &Tensor<F32>) -> Result<Tensor<F32>> {
    loss::mse(&m.forward(x)?, y)
}

#[autocast(fp16)]
fn mse_fp16(m: &Mlp, x: &Tensor<F32>, y: &Tensor<F32>) -> Result<Tensor<F32>> {
    loss::mse(&m.forward(x)?, y)
}

type Loss = fn(&Mlp, &Tensor<F32>, &Tensor<F32>) -> Result<Tensor<F32>>;

/// A model from fixed weights: the same on every rank.
fn model() -> Result<(Mlp, VarMap)> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let m = Mlp {
        l1: nn::linear(4, 16, vb.pp("l1"))?,
        l2: nn::linear(16, 2, vb.pp("l2"))?,
    };
    for (i, var) in sorted(&vars).iter().enumerate() {
        let t = var.as_tensor();
        let v = common::values(t.elem_count(), 10 + i as u64);
        var.set(&candle_core::Tensor::from_vec(v, t.shape(), t.device())?.affine(0.5, 0.0)?)?;
    }
    Ok((m, vars))
}

fn sorted(vars: &VarMap) -> Vec<Var> {
    let data = vars.data().lock().unwrap();
    let mut named: Vec<_> = data.iter().collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    named.into_iter().map(|(_, v)| v.clone()).collect()
}

/// A batch of 8 rows (inputs and targets), the same for every step's draw `step`.
fn batch(step: u64) -> Result<(Tensor<F32>, Tensor<F32>)> {
    let x = candle_core::Tensor::from_vec(common::values(32, 100 + step), (8, 4), &Device::Cpu)?;
    let y = candle_core::Tensor::from_vec(common::values(16, 200 + step), (8, 2), &Device::Cpu)?;
    Ok((Tensor::from_candle(x)?, Tensor::from_candle(y)?))
}

/// The weights after `steps` SGD steps of `loss` on rows `part` of each batch, the gradients
/// averaged over `dp` when given, through a scaler (with `dp`'s collective) when `fp16`.
fn train(
    loss: Loss,
    fp16: bool,
    part: std::ops::Range<usize>,
    dp: Option<&DataParallel>,
    steps: u64,
) -> Result<Vec<Vec<f32>>> {
    let (m, vars) = model()?;
    let mut opt = SGD::new(vars.all_vars(), 0.1)?;
    let mut builder = GradScaler::builder().enabled(fp16).init_scale(1024.0);
    if let Some(dp) = dp {
        builder = builder.collective(dp.collective().clone());
    }
    let mut scaler = builder.build()?;
    for step in 0..steps {
        let (x, y) = batch(step)?;
        let rows = |t: Tensor<F32>| t.narrow(0, part.start, part.len());
        let l = loss(&m, &rows(x)?, &rows(y)?)?;
        let mut grads = scaler.scale(&l)?.backward()?;
        if let Some(dp) = dp {
            grads.all_reduce(dp)?;
        }
        assert_eq!(scaler.step(&mut opt, grads)?, StepOutcome::Stepped);
        scaler.update()?;
    }
    sorted(&vars)
        .iter()
        .map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>())
        .collect()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The mean loss over the whole batch has the mean of the ranks' gradients (equal parts): 2 and
/// 4 ranks end where one process ends, in f32 and in fp16 with the scaler.
#[test]
fn ranks_train_as_one_process_on_the_concatenated_batch() -> Result<()> {
    for (loss, fp16, tol) in [(mse_f32 as Loss, false, 1e-5), (mse_fp16, true, 2e-2)] {
        let whole = train(loss, fp16, 0..8, None, 5)?;
        for world in [2, 4] {
            let per = 8 / world;
            let ranks = on_ranks(world, |c| {
                let r = c.rank();
                let dp = DataParallel::new(Arc::new(c));
                train(loss, fp16, r * per..(r + 1) * per, Some(&dp), 5)
            })?;
            for (r, w) in ranks.iter().enumerate() {
                // Every rank holds the same weights, bit for bit.
                assert_eq!(w, &ranks[0], "fp16 {fp16}, world {world}: rank {r}");
            }
            let d = max_diff(&ranks[0], &whole);
            assert!(d < tol, "fp16 {fp16}, world {world}: {d} from one process");
        }
    }
    Ok(())
}

/// One rank's fp16 overflow: every rank skips (weights untouched), every scale backs off, the
/// next finite step steps everywhere. The gradients are not averaged here, so only the scaler's
/// reduction of found-inf can tell the other rank.
#[test]
fn ranks_skip_together_when_one_overflows() -> Result<()> {
    let outcomes = on_ranks(2, |c| {
        let rank = c.rank();
        let c: Arc<dyn Collective> = Arc::new(c);
        let (m, vars) = model()?;
        let before = sorted(&vars)[0].as_tensor().to_vec1::<f32>()?;
        let mut opt = SGD::new(vars.all_vars(), 0.1)?;
        let mut scaler = GradScaler::builder().collective(c).build()?;
        let mut seen = Vec::new();
        for step in 0..2 {
            let (x, y) = batch(step)?;
            // Rank 1's first batch overflows f16 in the forward.
            let x = if rank == 1 && step == 0 {
                (x * 1e5)?
            } else {
                x
            };
            let l = mse_fp16(&m, &x, &y)?;
            let grads = scaler.scale(&l)?.backward()?;
            let outcome = scaler.step(&mut opt, grads)?;
            if step == 0 {
                let now = sorted(&vars)[0].as_tensor().to_vec1::<f32>()?;
                assert_eq!(
                    now, before,
                    "rank {rank}: a skipped step leaves the weights"
                );
            }
            scaler.update()?;
            seen.push((outcome, scaler.scale_value()));
        }
        Ok(seen)
    })?;
    for (rank, seen) in outcomes.iter().enumerate() {
        assert_eq!(
            seen,
            &[
                (StepOutcome::Skipped, 32768.0),
                (StepOutcome::Stepped, 32768.0)
            ],
            "rank {rank}"
        );
    }
    Ok(())
}

/// Averaging by hand: rank `r` holds `(r + 1) * g`; the mean over 3 ranks is `2 g`, whatever
/// the bucket size, and in bf16 on the wire it is the bf16 rounding of the sum of the ranks'
/// shares, each rounded to bf16.
#[test]
fn gradients_average_whatever_the_buckets() -> Result<()> {
    let g = |scale: f32| -> Result<Vec<candle_core::Tensor>> {
        Ok(vec![
            candle_core::Tensor::new(&[[1f32, -2.5], [0.1, 3.0]], &Device::Cpu)?
                .affine(f64::from(scale), 0.0)?,
            candle_core::Tensor::new(&[7f32, 1.0 / 3.0, -0.2], &Device::Cpu)?
                .affine(f64::from(scale), 0.0)?,
        ])
    };
    let want: Vec<Vec<f32>> = g(2.0)?
        .iter()
        .map(|t| t.flatten_all()?.to_vec1::<f32>())
        .collect::<Result<_>>()?;
    for bucket in [4, 16, 1 << 20] {
        let got = on_ranks(3, |c| {
            let scale = c.rank() as f32 + 1.0;
            let dp = DataParallel::new(Arc::new(c)).bucket_bytes(bucket)?;
            let mut grads = g(scale)?;
            dp.all_reduce(&mut grads)?;
            assert_eq!(grads[0].dims(), &[2, 2]);
            grads
                .iter()
                .map(|t| t.flatten_all()?.to_vec1::<f32>())
                .collect::<Result<Vec<_>>>()
        })?;
        for r in &got {
            assert!(
                max_diff(r, &want) < 1e-6,
                "bucket {bucket}: {r:?} vs {want:?}"
            );
        }
    }
    let bf16 = on_ranks(3, |c| {
        let scale = c.rank() as f32 + 1.0;
        let dp = DataParallel::new(Arc::new(c)).reduce_dtype(DType::BF16)?;
        let mut grads = g(scale)?;
        dp.all_reduce(&mut grads)?;
        assert_eq!(
            grads[0].dtype(),
            DType::F32,
            "the mean comes back in the gradient's dtype"
        );
        grads[1].to_vec1::<f32>()
    })?;
    // Rank r's 1/3 * (r + 1), divided by the 3 ranks in f32 and rounded to bf16, then the f64
    // sum of the three rounded to bf16 (DDP's compression hook divides before the sum too).
    let ninth = [1.0f32, 2.0, 3.0]
        .iter()
        .map(|s| f64::from(half::bf16::from_f32(s / 3.0 / 3.0).to_f32()))
        .sum::<f64>();
    let want = f64::from(half::bf16::from_f64(ninth).to_f32());
    assert!(
        (f64::from(bf16[0][1]) - want).abs() < 1e-7,
        "{:?} vs {want}",
        bf16[0]
    );
    Ok(())
}

#[test]
fn ranks_with_different_gradients_all_get_an_error() -> Result<()> {
    let results = on_ranks(2, |c| {
        let rank = c.rank();
        let dp = DataParallel::new(Arc::new(c));
        let n = if rank == 0 { 3 } else { 4 };
        let mut grads = vec![candle_core::Tensor::zeros(n, DType::F32, &Device::Cpu)?];
        Ok(dp.all_reduce(&mut grads).map_err(|e| e.to_string()))
    })?;
    for (rank, r) in results.iter().enumerate() {
        let e = r.as_ref().expect_err("a mismatch is an error");
        assert!(e.contains("reduce different gradients"), "rank {rank}: {e}");
    }
    // As many tensors of as many values, of other shapes: two parameters in another order,
    // then a (2, 3) weight against a (3, 2) one. Each was averaged with the other rank's
    // unrelated values.
    let order: [&[&[usize]]; 2] = [&[&[2], &[3]], &[&[3], &[2]]];
    let transposed: [&[&[usize]]; 2] = [&[&[2, 3], &[1]], &[&[3, 2], &[1]]];
    for per_rank in [order, transposed] {
        let results = on_ranks(2, |c| {
            let dims = per_rank[c.rank()];
            let dp = DataParallel::new(Arc::new(c));
            let mut grads = dims
                .iter()
                .map(|&d| candle_core::Tensor::ones(d, DType::F32, &Device::Cpu))
                .collect::<Result<Vec<_>>>()?;
            let reduced = dp.all_reduce(&mut grads).map_err(|e| e.to_string());
            let var = Var::ones(dims[0], DType::F32, &Device::Cpu)?;
            let broadcast = dp.broadcast(&[var]).map_err(|e| e.to_string());
            Ok((reduced, broadcast))
        })?;
        for (rank, (reduced, broadcast)) in results.iter().enumerate() {
            for e in [reduced.as_ref().err(), broadcast.as_ref().err()] {
                let e = e.unwrap_or_else(|| panic!("rank {rank} {per_rank:?}: accepted"));
                assert!(e.contains("other shapes"), "rank {rank}: {e}");
            }
        }
    }
    Ok(())
}

/// Ranks under different `DataParallel` settings (the wire dtype, the bucket size) reduced as
/// if they agreed: with `reduce_dtype` on one rank only the replicas drifted apart (1.5 and
/// 1.5000501), and different buckets made one rank's collective fail while the other was told
/// its peer had left. Now every rank gets an error naming the settings; a huge world size is an
/// error, not an abort.
#[test]
fn ranks_with_different_settings_all_get_an_error() -> Result<()> {
    type Setup = fn(DataParallel) -> Result<DataParallel>;
    let settings: [[Setup; 2]; 2] = [
        [Ok, |dp| dp.reduce_dtype(DType::BF16)],
        [|dp| dp.bucket_bytes(4), |dp| dp.bucket_bytes(1 << 20)],
    ];
    for setup in settings {
        let results = on_ranks(2, |c| {
            let rank = c.rank();
            let dp = setup[rank](DataParallel::new(Arc::new(c)))?;
            let third = candle_core::Tensor::new(&[1.0f32 / 3.0, 2.0, 3.0], &Device::Cpu)?;
            let mut grads = vec![third.clone(), third];
            Ok(dp.all_reduce(&mut grads).map_err(|e| e.to_string()))
        })?;
        for (rank, r) in results.iter().enumerate() {
            let e = r.as_ref().expect_err("different settings are an error");
            assert!(
                e.contains("reduce different gradients") && e.contains("settings"),
                "rank {rank}: {e}"
            );
        }
    }
    for huge in [usize::MAX, 1 << 40] {
        let e = ThreadGroup::ranks(huge).expect_err("a huge world size");
        assert!(e.to_string().contains("world size of"), "{e}");
    }
    Ok(())
}

/// f16 gradients of 40000 on two ranks: their mean fits f16, their sum (80000) does not. Each
/// share is divided before the sum (DDP's default hook), so the mean is 40000, not inf.
#[test]
fn half_gradients_average_without_overflowing() -> Result<()> {
    let got = on_ranks(2, |c| {
        let dp = DataParallel::new(Arc::new(c));
        let mut grads =
            vec![candle_core::Tensor::new(&[40000f32, -1.5], &Device::Cpu)?.to_dtype(DType::F16)?];
        dp.all_reduce(&mut grads)?;
        grads[0].to_dtype(DType::F32)?.to_vec1::<f32>()
    })?;
    assert_eq!(got, vec![vec![40000.0, -1.5]; 2]);
    Ok(())
}

#[test]
fn a_rank_that_leaves_is_an_error_for_the_others_not_a_hang() -> Result<()> {
    let mut ranks = ThreadGroup::ranks(2)?;
    drop(ranks.pop());
    let t = candle_core::Tensor::new(&[1f32], &Device::Cpu)?;
    let e = ranks[0]
        .all_reduce(&t, ReduceOp::Sum)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 1 left the thread group"), "{e}");
    assert!(ThreadGroup::ranks(0).is_err());
    Ok(())
}

/// Integer variables arrive exactly too: 2^53 + 1 (which the `ThreadGroup`'s f64 sum rounded
/// to 2^53) and a negative value.
#[test]
fn broadcast_copies_integers_exactly() -> Result<()> {
    let big = (1i64 << 53) + 1;
    let got = on_ranks(3, |c| {
        let mine = if c.rank() == 0 { [big, -7] } else { [1, 2] };
        let var = Var::from_tensor(&candle_core::Tensor::new(&mine, &Device::Cpu)?)?;
        DataParallel::new(Arc::new(c)).broadcast(std::slice::from_ref(&var))?;
        var.as_tensor().to_vec1::<i64>()
    })?;
    assert_eq!(got, vec![vec![big, -7]; 3]);
    Ok(())
}

/// The thread group's reduction is exact on `i64` values beyond f64's 2^53 (as NCCL's and
/// gloo's): a sum (2^53 + 1) + 0 + (-2^62) and a maximum over values that differ only in their
/// last bit.
#[test]
fn thread_group_reduces_i64_exactly() -> Result<()> {
    let big = (1i64 << 53) + 1;
    let got = on_ranks(3, |c| {
        let mine: [i64; 2] = match c.rank() {
            0 => [big, big],
            1 => [0, big - 1],
            _ => [-(1 << 62), big - 2],
        };
        let t = candle_core::Tensor::new(&mine, &Device::Cpu)?;
        let sum = c
            .all_reduce(&t.narrow(0, 0, 1)?, ReduceOp::Sum)?
            .to_vec1::<i64>()?;
        let max = c
            .all_reduce(&t.narrow(0, 1, 1)?, ReduceOp::Max)?
            .to_vec1::<i64>()?;
        Ok((sum, max))
    })?;
    assert_eq!(got, vec![(vec![big - (1 << 62)], vec![big]); 3]);
    Ok(())
}

#[test]
fn broadcast_starts_every_replica_from_rank_0s_weights() -> Result<()> {
    let got = on_ranks(3, |c| {
        let rank = c.rank() as f32;
        // Rank 0's -0.0 arrives as -0.0, to the bit.
        let first = if rank == 0.0 { -0.0 } else { rank };
        let var = Var::from_tensor(&candle_core::Tensor::new(
            &[first, rank + 0.5],
            &Device::Cpu,
        )?)?;
        DataParallel::new(Arc::new(c)).broadcast(std::slice::from_ref(&var))?;
        let values = var.as_tensor().to_vec1::<f32>()?;
        Ok(values.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
    })?;
    assert_eq!(got, vec![vec![(-0.0f32).to_bits(), 0.5f32.to_bits()]; 3]);
    Ok(())
}

/// NCCL with one GPU: world size 1, whose mean is the gradient itself and whose max is the
/// value (needs a GPU and libnccl; `--features cuda,nccl`; named `_cuda` for the GPU check).
#[cfg(feature = "nccl")]
#[test]
fn nccl_world_size_1_reduces_to_the_values_cuda() -> Result<()> {
    use candle_amp::distributed::NcclCollective;
    let dev = Device::new_cuda(0)?;
    let id = NcclCollective::unique_id()?;
    let c = Arc::new(NcclCollective::new(&dev, 0, 1, &id)?);
    let t = candle_core::Tensor::new(&[1.5f32, -2.0, f32::INFINITY], &dev)?;
    let max = c.all_reduce(&t, ReduceOp::Max)?.to_vec1::<f32>()?;
    assert_eq!(max, vec![1.5, -2.0, f32::INFINITY]);
    let dp = DataParallel::new(c);
    let mut grads = vec![
        candle_core::Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &dev)?,
        candle_core::Tensor::new(&[0.25f32], &dev)?.to_dtype(DType::BF16)?,
    ];
    dp.all_reduce(&mut grads)?;
    assert_eq!(
        grads[0].to_vec2::<f32>()?,
        vec![vec![1.0, 2.0], vec![3.0, 4.0]]
    );
    assert_eq!(grads[1].dtype(), DType::BF16);
    assert_eq!(grads[1].to_dtype(DType::F32)?.to_vec1::<f32>()?, vec![0.25]);
    Ok(())
}

#[test]
fn integer_gradients_are_an_error() -> Result<()> {
    let c = ThreadGroup::ranks(1)?.pop().expect("one rank");
    let dp = DataParallel::new(Arc::new(c));
    let mut grads = vec![candle_core::Tensor::new(&[3u8, 4], &Device::Cpu)?];
    let e = dp.all_reduce(&mut grads).unwrap_err().to_string();
    assert!(e.contains("averages float gradients, got a U8"), "{e}");
    assert!(DataParallel::new(dp.collective().clone())
        .reduce_dtype(DType::U32)
        .is_err());
    Ok(())
}

/// Two parameters of one shape, used in opposite orders by the two ranks' forwards (rank 0
/// `a * 1 + b * 2`, rank 1 `b * 4 + a * 3`): each is averaged with itself, as DDP pairs
/// `model.parameters()`: a's gradient (1 + 3) / 2 = 2, b's (2 + 4) / 2 = 3 on both ranks
/// (PyTorch 2.15, two gloo processes). Paired by the graph's order they were both 2.5. Then
/// accumulation: rank 0's first micro-batch uses only a, rank 1's only b, then the other; the
/// sums are paired by parameter too (a: (1 + 2) / 2 = 1.5, b: (4 + 3) / 2 = 3.5).
#[test]
fn gradients_are_paired_by_parameter_whatever_order_the_forward_used() -> Result<()> {
    let grads = on_ranks(2, |c| {
        let rank = c.rank();
        let dp = DataParallel::new(Arc::new(c));
        let a = Var::new(&[1f32, 1.0], &Device::Cpu)?;
        let b = Var::new(&[1f32, 1.0], &Device::Cpu)?;
        let sum = |t: &candle_core::Tensor, k: f64| (t * k)?.sum_all();
        let scaler = GradScaler::builder().enabled(false).build()?;
        let l = if rank == 0 {
            (sum(a.as_tensor(), 1.0)? + sum(b.as_tensor(), 2.0)?)?
        } else {
            (sum(b.as_tensor(), 4.0)? + sum(a.as_tensor(), 3.0)?)?
        };
        let mut g = scaler.scale(&Tensor::<F32>::from_candle(l)?)?.backward()?;
        g.all_reduce(&dp)?;
        let once = [g.get(&a), g.get(&b)].map(|t| t.expect("a gradient").to_vec1::<f32>());
        let (first, second) = if rank == 0 {
            (sum(a.as_tensor(), 1.0)?, sum(b.as_tensor(), 3.0)?)
        } else {
            (sum(b.as_tensor(), 4.0)?, sum(a.as_tensor(), 2.0)?)
        };
        let mut acc = scaler
            .scale(&Tensor::<F32>::from_candle(first)?)?
            .backward()?;
        acc.accumulate(
            scaler
                .scale(&Tensor::<F32>::from_candle(second)?)?
                .backward()?,
        )?;
        acc.all_reduce(&dp)?;
        let accumulated =
            [acc.get(&a), acc.get(&b)].map(|t| t.expect("a gradient").to_vec1::<f32>());
        Ok((once, accumulated))
    })?;
    for (rank, (once, accumulated)) in grads.into_iter().enumerate() {
        let [ga, gb] = once;
        assert_eq!((ga?, gb?), (vec![2.0; 2], vec![3.0; 2]), "rank {rank}");
        let [ga, gb] = accumulated;
        assert_eq!(
            (ga?, gb?),
            (vec![1.5; 2], vec![3.5; 2]),
            "rank {rank}, accumulated"
        );
    }
    Ok(())
}

/// Unscaled, then averaged, with a scaler that has no collective: rank 1's NaN gradient makes
/// the mean NaN on both ranks, and both skip (PyTorch's DDP averages in the backward, before
/// `unscale_`, so both scalers see the NaN). Before, rank 0 had found nothing in its own
/// gradients and stepped with the NaN mean.
#[test]
fn a_non_finite_mean_skips_every_rank_without_a_scaler_collective() -> Result<()> {
    let outcomes = on_ranks(2, |c| {
        let rank = c.rank();
        let dp = DataParallel::new(Arc::new(c));
        let w = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let mut opt = candle_amp::optim::SGD::new(vec![w.clone()], 0.1)?;
        let mut scaler = GradScaler::new();
        let k = if rank == 1 { f64::NAN } else { 1.0 };
        let l = (w.as_tensor() * k)?.sum_all()?;
        let scaled = scaler.scale(&Tensor::<F32>::from_candle(l)?)?.backward()?;
        let mut grads = scaler.unscale(scaled)?;
        grads.all_reduce(&dp)?;
        let outcome = scaler.step(&mut opt, grads)?;
        scaler.update()?;
        Ok((
            outcome,
            w.as_tensor().to_vec1::<f32>()?,
            scaler.scale_value(),
        ))
    })?;
    for (rank, seen) in outcomes.into_iter().enumerate() {
        assert_eq!(
            seen,
            (StepOutcome::Skipped, vec![1.0, 2.0], 32768.0),
            "rank {rank}"
        );
    }
    Ok(())
}
