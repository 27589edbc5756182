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

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
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
