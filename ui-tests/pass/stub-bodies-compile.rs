// Bodies that are stubs while the code is written (`todo!()` and the other macros that never
// return) compile in every kind of region part.
#![allow(dead_code)]

use candle_amp::{autocast, custom_fwd, Tensor, F32};
use candle_core::Result;

struct Op;

#[custom_fwd]
impl Op {
    fn forward(&self, _x: &Tensor<F32>) -> Result<Tensor<F32>> {
        todo!("write the op")
    }
}

struct Block;

#[autocast(fp16)]
impl Block {
    fn forward(&self, _x: &Tensor<F32>) -> Result<Tensor<F32>> {
        unimplemented!()
    }
}

#[autocast(bf16)]
fn helper(x: &Tensor<F32>) -> Result<Tensor<F32>> {
    let _y = x.exp()?;
    panic!("not yet")
}

fn main() {}
