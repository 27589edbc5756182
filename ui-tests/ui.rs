//! Compile-fail and compile-pass cases pinning the precision rules. `fail/`: one misuse a user
//! would make per file, named for the misuse, each a whole program whose blessed `.stderr` shows
//! the error landing under the offending token; `pass/`: programs that must compile.
//!
//! Bless with `TRYBUILD=overwrite cargo test --test ui`, then read the `git diff`.

#[rustversion::attr(
    not(stable(1.95)),
    ignore = "diagnostics are blessed on stable 1.95, the project's toolchain"
)]
#[test]
fn ui() {
    // trybuild builds its programs in a project of its own, which does not inherit this
    // workspace's `[profile.dev]`; the variable reaches its cargo and keeps the ~20 linked pass
    // programs from carrying full debug info (~135 MB each).
    std::env::set_var("CARGO_PROFILE_DEV_DEBUG", "false");
    let t = trybuild::TestCases::new();
    t.compile_fail("ui-tests/fail/*.rs");
    t.pass("ui-tests/pass/*.rs");
}
