//! The examples' shared code (`examples/common`) where it decides a run's outcome.

#[path = "../examples/common/mod.rs"]
mod common;

/// A run whose final loss is not finite (it diverged) ends in an error naming each such mode,
/// after its figures are printed; finite losses pass.
#[test]
fn a_diverged_run_is_an_error_naming_its_modes() {
    assert!(common::check_finite([("f32", 0.5), ("amp", 0.51)]).is_ok());
    let err = common::check_finite([("f32", 0.5), ("fp16", f32::NAN), ("bf16", f32::INFINITY)])
        .expect_err("a NaN and an infinite final loss");
    let msg = err.to_string();
    assert!(
        msg.contains("fp16 (NaN)") && msg.contains("bf16 (inf)") && !msg.contains("f32 ("),
        "{msg}"
    );
}
