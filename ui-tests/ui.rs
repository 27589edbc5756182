//! Compile-fail and compile-pass cases pinning the precision rules and the macros' diagnostics.
//!
//! Bless with `TRYBUILD=overwrite cargo test --test ui`, then read the `git diff`.

#[rustversion::attr(
    not(stable(1.95)),
    ignore = "diagnostics are blessed on stable 1.95, the project's toolchain"
)]
#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui-tests/fail/*.rs");
    t.pass("ui-tests/pass/*.rs");
}
