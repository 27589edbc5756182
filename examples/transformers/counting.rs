//! A synthetic language for the decoder examples (`gpt`, `llama`): sequences that count up by a
//! stride modulo the vocabulary, generated in code from a seed.
#![allow(dead_code)]

use candle_core::{Device, Result};

/// A synthetic language with structure to learn: each sequence counts up from a random start by
/// a random stride (1, 2, 3 or 5) modulo the vocabulary, so the next token follows from the
/// last two; a model must attend to its context to find the stride.
pub struct Counting {
    state: u64,
    pub vocab: usize,
}

impl Counting {
    pub fn new(vocab: usize, seed: u64) -> Self {
        Self {
            state: seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407)
                | 1,
            vocab,
        }
    }

    fn next(&mut self) -> u64 {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11
    }

    /// One sequence of `len` tokens.
    pub fn sequence(&mut self, len: usize) -> Vec<u32> {
        let start = self.next() % self.vocab as u64;
        let stride = [1, 2, 3, 5][(self.next() % 4) as usize];
        (0..len as u64)
            .map(|i| ((start + i * stride) % self.vocab as u64) as u32)
            .collect()
    }

    /// A batch `(b, len)` of sequences.
    pub fn batch(&mut self, b: usize, len: usize, dev: &Device) -> Result<candle_core::Tensor> {
        let ids: Vec<u32> = (0..b).flat_map(|_| self.sequence(len)).collect();
        candle_core::Tensor::from_vec(ids, (b, len), dev)
    }
}
