//! Property test: random sequences of finite, inf and NaN gradients, under random scaler
//! parameters, give exactly the scale, tracker and skip count of a direct model of PyTorch's
//! rule (`_amp_update_scale_cpu_`), except that a backoff below the smallest normal f32 is an
//! error that leaves the scale as it was. Invariants: the scale is always a normal positive f32;
//! the master weights are bit-identical after a skipped step and finite after a taken one.
#![allow(clippy::float_cmp)]

use candle_amp::GradScaler;
use candle_core::{Device, Result, Var};
use candle_nn::{Optimizer, SGD};
use proptest::prelude::*;

/// PyTorch's update rule, transcribed from its CPU kernel: the f32 scale times a double factor,
/// stored back as f32; growth only if the result is finite.
#[derive(Debug)]
struct Reference {
    scale: f32,
    tracker: u32,
    growth_factor: f64,
    backoff_factor: f64,
    interval: u32,
    skipped: u64,
}

impl Reference {
    /// One update after a step with gradient `grad`; whether it is the underflow error.
    fn iteration(&mut self, grad: f32) -> bool {
        // The gradient the scaler sees is `grad * scale` in f32.
        let found_inf = !(grad * self.scale).is_finite();
        if found_inf {
            self.skipped += 1;
            self.tracker = 0;
            let backed_off = (f64::from(self.scale) * self.backoff_factor) as f32;
            // PyTorch stores it whatever it is; candle-amp stops above the subnormals.
            if backed_off < f32::MIN_POSITIVE {
                return true;
            }
            self.scale = backed_off;
        } else {
            let successful = self.tracker + 1;
            if successful == self.interval {
                let new_scale = (f64::from(self.scale) * self.growth_factor) as f32;
                if new_scale.is_finite() {
                    self.scale = new_scale;
                }
                self.tracker = 0;
            } else {
                self.tracker = successful;
            }
        }
        false
    }
}

fn gradient() -> impl Strategy<Value = f32> {
    prop_oneof![
        6 => -1e3f32..1e3f32,
        1 => Just(f32::INFINITY),
        1 => Just(f32::NEG_INFINITY),
        1 => Just(f32::NAN),
        // Finite, but overflows once scaled by a large scale.
        1 => prop_oneof![Just(1e30f32), Just(-3e37f32)],
    ]
}

fn run(
    init_scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    interval: u32,
    grads: &[f32],
) -> Result<()> {
    let mut scaler = GradScaler::builder()
        .init_scale(init_scale)
        .growth_factor(growth_factor)
        .backoff_factor(backoff_factor)
        .growth_interval(interval)
        .build()?;
    let mut reference = Reference {
        scale: init_scale as f32,
        tracker: 0,
        growth_factor,
        backoff_factor,
        interval,
        skipped: 0,
    };
    let w = Var::new(&[0.5f32], &Device::Cpu)?;
    let mut opt = SGD::new(vec![w.clone()], 1e-3)?;
    for &g in grads {
        // loss = w * g, so dloss/dw = g; scaled: g * scale.
        let c = candle_core::Tensor::new(&[g], &Device::Cpu)?;
        let loss = w.as_tensor().mul(&c)?.sum_all()?;
        let before = w.as_tensor().to_vec1::<f32>()?[0];
        let outcome = scaler.step(&mut opt, scaler.scale(&loss)?.backward()?)?;
        let after = w.as_tensor().to_vec1::<f32>()?[0];
        if outcome.is_skipped() {
            assert_eq!(after.to_bits(), before.to_bits(), "a skipped step wrote");
        } else {
            assert!(after.is_finite(), "a taken step wrote {after}");
        }
        let expect_skip = !(g * reference.scale).is_finite();
        assert_eq!(
            outcome.is_skipped(),
            expect_skip,
            "grad {g}, scale {}",
            reference.scale
        );
        let updated = scaler.update();
        let underflow = reference.iteration(g);
        assert_eq!(updated.is_err(), underflow, "{updated:?} vs {reference:?}");
        let scale = scaler.scale_value();
        assert_eq!(scale.to_bits(), reference.scale.to_bits(), "{reference:?}");
        assert_eq!(scaler.growth_tracker(), reference.tracker);
        assert!(
            scale.is_finite() && scale >= f32::MIN_POSITIVE,
            "the scale is always a normal positive f32, got {scale:e}"
        );
    }
    assert_eq!(scaler.skipped_steps(), reference.skipped);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

    #[test]
    fn scaler_matches_the_reference_rule(
        init_scale in prop_oneof![
            1e-3f64..1e6, Just(65536.0), 1e30f64..3e38,
            // Near the bottom of the normal range, where backoff meets the subnormals.
            1.2e-38f64..1e-30,
        ],
        growth_factor in prop_oneof![1.0001f64..20.0, Just(2.0)],
        backoff_factor in prop_oneof![1e-3f64..0.9999, Just(0.5), 1e-320f64..1e-30],
        interval in 1u32..5,
        grads in prop::collection::vec(gradient(), 1..24),
    ) {
        run(init_scale, growth_factor, backoff_factor, interval, &grads).unwrap();
    }
}
