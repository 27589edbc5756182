//! Ranks as threads of one process: each rank's tensor is read to the host, the last rank to
//! arrive combines them in f64 in rank order, and every rank gets the same result in its
//! tensor's dtype, on its device.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use candle_core::{DType, Result, Tensor};

use super::{Collective, ReduceOp};

/// Makes the ranks of an in-process group: [`ThreadGroup::ranks`].
#[derive(Debug)]
pub struct ThreadGroup;

/// The most ranks a [`ThreadGroup`] makes: each is a thread of this process, and a world size
/// beyond this is a mistake (a mis-parsed `WORLD_SIZE`), not a machine.
const MAX_RANKS: usize = 1 << 16;

impl ThreadGroup {
    /// `world_size` handles, rank 0 first, one for each thread that trains a replica. A rank
    /// whose handle is dropped leaves the group: a collective another rank is waiting in, or
    /// calls later, is then an error instead of a wait for ever.
    pub fn ranks(world_size: usize) -> Result<Vec<ThreadCollective>> {
        if world_size == 0 {
            candle_core::bail!("ThreadGroup::ranks: the world size must be at least 1");
        }
        if world_size > MAX_RANKS {
            candle_core::bail!(
                "ThreadGroup::ranks: a world size of {world_size}: each rank is a thread of this \
                 process, at most {MAX_RANKS} (a group across processes or machines is NCCL's)"
            );
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                deposits: vec![None; world_size],
                arrived: 0,
                generation: 0,
                result: Arc::new(Vec::new()),
                left: None,
                failed: None,
            }),
            done: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| ThreadCollective {
                rank,
                world_size,
                shared: shared.clone(),
            })
            .collect())
    }
}

/// One rank of a [`ThreadGroup`].
#[derive(Debug)]
pub struct ThreadCollective {
    rank: usize,
    world_size: usize,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    done: Condvar,
}

#[derive(Debug)]
struct State {
    /// Each rank's values and op for the collective in progress.
    deposits: Vec<Option<(Vec<f64>, ReduceOp)>>,
    arrived: usize,
    /// Counts completed collectives; a waiting rank wakes when it moves on.
    generation: u64,
    /// The last completed collective's result.
    result: Arc<Vec<f64>>,
    /// A rank that left the group.
    left: Option<usize>,
    /// Why a collective failed (the ranks called different ones): every rank gets it.
    failed: Option<String>,
}

impl ThreadCollective {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn gone(rank: usize, left: usize) -> candle_core::Error {
        candle_core::Error::Msg(format!(
            "rank {rank}: rank {left} left the thread group (its handle was dropped, or its \
             thread ended or failed) before this collective completed"
        ))
    }

    /// Why this rank cannot go on: a failed collective, or a rank that left.
    fn ended(&self, state: &State) -> Option<candle_core::Error> {
        if let Some(why) = &state.failed {
            return Some(candle_core::Error::Msg(format!(
                "rank {}: {why}",
                self.rank
            )));
        }
        state.left.map(|left| Self::gone(self.rank, left))
    }

    /// The combined values of every rank's `values`.
    fn combine(&self, values: Vec<f64>, op: ReduceOp) -> Result<Arc<Vec<f64>>> {
        let mut state = self.lock();
        if let Some(e) = self.ended(&state) {
            return Err(e);
        }
        state.deposits[self.rank] = Some((values, op));
        state.arrived += 1;
        if state.arrived == self.world_size {
            let deposits: Vec<_> = state.deposits.iter_mut().map(Option::take).collect();
            state.arrived = 0;
            let result = reduce(deposits.into_iter().flatten().collect());
            let result = match result {
                Ok(r) => r,
                Err(e) => {
                    // Every waiting rank wakes to the same error.
                    state.failed = Some(e.to_string());
                    self.shared.done.notify_all();
                    return Err(e);
                }
            };
            state.result = Arc::new(result);
            state.generation += 1;
            self.shared.done.notify_all();
            return Ok(state.result.clone());
        }
        let generation = state.generation;
        while state.generation == generation {
            if let Some(e) = self.ended(&state) {
                return Err(e);
            }
            state = self
                .shared
                .done
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        Ok(state.result.clone())
    }

    /// `op` over every rank's `i64` values, exactly, through the f64 reduction: each value as
    /// its signed upper and unsigned lower 32 bits, which f64 holds exactly. A sum adds the
    /// halves apart and joins them, wrapping as an `i64` sum does (NCCL's and gloo's); a
    /// maximum takes the largest upper half, then the largest lower half among the ranks that
    /// hold it.
    fn all_reduce_i64(&self, values: &[i64], op: ReduceOp) -> Result<Vec<i64>> {
        let hi: Vec<f64> = values.iter().map(|&x| (x >> 32) as f64).collect();
        let lo = |x: i64| (x & 0xffff_ffff) as f64;
        let join = |hi: f64, lo: f64| ((hi as i64) << 32).wrapping_add(lo as i64);
        match op {
            ReduceOp::Sum => {
                let hi = self.combine(hi, op)?;
                let lo = self.combine(values.iter().map(|&x| lo(x)).collect(), op)?;
                Ok(hi
                    .iter()
                    .zip(lo.iter())
                    .map(|(&h, &l)| join(h, l))
                    .collect())
            }
            ReduceOp::Max => {
                let top = self.combine(hi.clone(), op)?;
                // -1 (below every lower half) where this rank's upper half is not the top one.
                let mine = values
                    .iter()
                    .zip(hi.iter().zip(top.iter()))
                    .map(|(&x, (h, t))| {
                        if h.to_bits() == t.to_bits() {
                            lo(x)
                        } else {
                            -1.0
                        }
                    })
                    .collect();
                let low = self.combine(mine, op)?;
                Ok(top
                    .iter()
                    .zip(low.iter())
                    .map(|(&h, &l)| join(h, l))
                    .collect())
            }
        }
    }
}

/// Every rank's values combined by their op, in rank order, in f64.
fn reduce(deposits: Vec<(Vec<f64>, ReduceOp)>) -> Result<Vec<f64>> {
    let (first, op) = &deposits[0];
    if deposits
        .iter()
        .any(|(v, o)| v.len() != first.len() || o != op)
    {
        let seen: Vec<_> = deposits.iter().map(|(v, o)| (v.len(), *o)).collect();
        candle_core::bail!(
            "the ranks called different collectives (values and op per rank: {seen:?})"
        );
    }
    let mut out = first.clone();
    for (values, _) in &deposits[1..] {
        for (o, v) in out.iter_mut().zip(values) {
            *o = match op {
                ReduceOp::Sum => *o + v,
                // NaN wins, as a found-inf flag must.
                ReduceOp::Max => {
                    if o.is_nan() || v.is_nan() {
                        f64::NAN
                    } else {
                        o.max(*v)
                    }
                }
            };
        }
    }
    Ok(out)
}

impl Collective for ThreadCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    /// In f64, which holds every f32, f16, bf16, u8 and u32 value (and their sums over up to
    /// 2^21 ranks) exactly; `i64` values, which f64 does not (2^53 + 1 summed as 2^53), are
    /// combined exactly through their 32-bit halves.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if t.dtype() == DType::I64 {
            let values = t.flatten_all()?.to_vec1::<i64>()?;
            let result = self.all_reduce_i64(&values, op)?;
            return Tensor::from_vec(result, t.shape(), t.device());
        }
        let values = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let result = self.combine(values, op)?;
        Tensor::from_slice(result.as_slice(), t.shape(), t.device())?.to_dtype(t.dtype())
    }
}

impl Drop for ThreadCollective {
    fn drop(&mut self) {
        let mut state = self.lock();
        state.left.get_or_insert(self.rank);
        self.shared.done.notify_all();
    }
}
