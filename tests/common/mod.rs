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
