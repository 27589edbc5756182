//! Shared by the integration tests: candle's `test_device!` pattern. A test body written as
//! `fn name(dev: &Device) -> Result<()>` gets a CPU test, and a CUDA test when the crate is
//! built with `--features cuda` (it needs a GPU to pass).

/// `test_device!(body, body_cpu, body_cuda)` defines `#[test] fn body_cpu` running `body` on
/// the CPU and, with the `cuda` feature, `#[test] fn body_cuda` running it on CUDA device 0.
#[macro_export]
macro_rules! test_device {
    ($body:ident, $cpu:ident, $cuda:ident) => {
        #[test]
        fn $cpu() -> candle_core::Result<()> {
            $body(&candle_core::Device::Cpu)
        }

        #[cfg(feature = "cuda")]
        #[test]
        fn $cuda() -> candle_core::Result<()> {
            $body(&candle_core::Device::new_cuda(0)?)
        }
    };
}

/// Deterministic pseudo-random values in [-1, 1) (a 64-bit LCG), so runs can be repeated.
#[allow(dead_code)] // not every test file that shares this module draws values
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}
