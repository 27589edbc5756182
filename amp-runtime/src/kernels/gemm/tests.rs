//! The GEMM against an f64 reference: every kernel this CPU runs, every element type, edge
//! shapes, strided and transposed operands, masters of another type.

use std::mem::MaybeUninit;

use half::{bf16, f16};

use super::params::CACHE_LINE;
use super::scratch::grown;
use super::*;

/// f64 reference of `a * b` on the same (already rounded) values.
fn reference<T: GemmElem>(m: usize, n: usize, k: usize, a: MatRef<T>, b: MatRef<T>) -> Vec<f64> {
    let mut c = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|l| f64::from(a.at(i, l).get()) * f64::from(b.at(l, j).get()))
                .sum();
        }
    }
    c
}

fn values<T: GemmElem>(len: usize, seed: u32) -> Vec<T> {
    (0..len)
        .map(|i| T::put(((i as f32) * 0.618 + seed as f32).sin()))
        .collect()
}

type Driver<T, B> = Box<dyn Fn(&Problem<T, B>, &mut [MaybeUninit<f32>])>;

/// The drivers this CPU can run for products in `T` with B stored as `B`, f32 output.
fn drivers<T: GemmElem, B: GemmElem>() -> Vec<Driver<T, B>> {
    let mut all: Vec<Driver<T, B>> = vec![Box::new(|p, c| blocked(p, c, portable::F32Kernel))];
    #[cfg(target_arch = "x86_64")]
    {
        let f32_kernel =
            |cpu| -> Driver<T, B> { Box::new(move |p, c| blocked(p, c, x86::F32Kernel(cpu))) };
        let bf16_kernel =
            |cpu| -> Driver<T, B> { Box::new(move |p, c| blocked(p, c, x86::Bf16Kernel(cpu))) };
        match isa() {
            Isa::Amx(tiles) => {
                all.push(f32_kernel(tiles.avx512()));
                if T::IS_BF16 {
                    all.push(bf16_kernel(tiles.avx512_bf16()));
                    all.push(Box::new(move |p, c| blocked(p, c, amx::AmxKernel(tiles))));
                }
            }
            Isa::Avx512Bf16(cpu) => {
                all.push(f32_kernel(cpu.avx512()));
                if T::IS_BF16 {
                    all.push(bf16_kernel(cpu));
                }
            }
            Isa::Avx512(cpu) => all.push(f32_kernel(cpu)),
            Isa::Portable => {}
        }
    }
    all
}

/// Every kernel against f64 on the same values, for edge sizes (one pass and several),
/// strided and transposed operands, accumulation, serial and parallel; f32 accumulation of
/// k products of magnitude <= 1 is good to ~k * 2^-24. Then the public entry point into
/// `T` itself, which rounds once.
fn check<T: GemmElem>() {
    let shapes = [
        (1, 1, 1),
        (7, 17, 3),
        (13, 33, 513),
        (25, 70, 1030),
        (5, 9, 4500),
        // Few rows, many columns: on several threads, each takes a group of B's panels
        // and packs it a few panels at a time (a tail of fewer).
        (40, 600, 96),
        // Several blocks of rows, one per task.
        (300, 100, 40),
    ];
    for &(m, n, k) in &shapes {
        for transposed in [false, true] {
            let a_data = values::<T>(m * k + 3, 1);
            let b_data = values::<T>(k * n + 5, 2);
            let (a, b) = if transposed {
                (
                    MatRef {
                        data: &a_data,
                        offset: 3,
                        rs: 1,
                        cs: m,
                    },
                    MatRef {
                        data: &b_data,
                        offset: 5,
                        rs: 1,
                        cs: k,
                    },
                )
            } else {
                (
                    MatRef {
                        data: &a_data,
                        offset: 3,
                        rs: k,
                        cs: 1,
                    },
                    MatRef {
                        data: &b_data,
                        offset: 5,
                        rs: n,
                        cs: 1,
                    },
                )
            };
            let want = reference(m, n, k, a, b);
            let tol = 1e-5 * (k as f64 + 1.0);
            let name = std::any::type_name::<T>();
            for driver in drivers::<T, T>() {
                // Added to ones, or written over NaNs (every element must be written).
                for (parallel, accumulate) in [(false, true), (true, true), (true, false)] {
                    let before = if accumulate { 1f32 } else { f32::NAN };
                    let mut c = vec![MaybeUninit::new(before); m * n];
                    let p = Problem {
                        m,
                        n,
                        k,
                        a,
                        b,
                        accumulate,
                        parallel,
                    };
                    driver(&p, &mut c);
                    for (got, want) in c.iter().zip(&want) {
                        // SAFETY: initialised above, and the driver writes values.
                        let got = f64::from(unsafe { got.assume_init() });
                        let got = if accumulate { got - 1.0 } else { got };
                        assert!(
                            (got - want).abs() <= tol,
                            "{name} {m}x{n}x{k} t={transposed} acc={accumulate}: {got} vs \
                                 {want}"
                        );
                    }
                }
            }
            check_rounded((m, n, k), a, b, &want);
        }
    }
    let mut empty: Vec<T> = vec![T::put(3.0); 6];
    let none = MatRef {
        data: &[] as &[T],
        offset: 0,
        rs: 0,
        cs: 1,
    };
    gemm(2, 3, 0, none, none, &mut empty, false, false);
    assert!(empty.iter().all(|x| x.get() == 0.0), "k = 0 gives zeros");
}

fn product<'a, T, B>(
    (m, n, k): (usize, usize, usize),
    a: MatRef<'a, T>,
    b: MatRef<'a, B>,
) -> Problem<'a, T, B> {
    Problem {
        m,
        n,
        k,
        a,
        b,
        accumulate: false,
        parallel: true,
    }
}

/// An f32 B (a master weight) in a product of `T`: every kernel gives, to the bit, what it
/// gives on B rounded to `T` first, for B's rows or columns contiguous (both packing paths,
/// whole groups of 16 and tails), values that round to even, overflow f16, or are subnormal.
fn check_master<T: GemmElem>() {
    let name = std::any::type_name::<T>();
    for &(m, n, k) in &[
        (3, 5, 7),
        (33, 48, 64),
        (20, 70, 130),
        (18, 48, 129),
        (5, 9, 4500),
    ] {
        let a_data = values::<T>(m * k, 1);
        let mut master = values::<f32>(k * n, 2);
        for (i, v) in master.iter_mut().enumerate() {
            *v *= [1.0, 1.0 + f32::EPSILON, 3.0e4, 1e-39][i % 4];
        }
        master[1] = 1.0 + 2f32.powi(-8); // a bf16 tie: rounds to even (1.0)
        master[2] = 70_000.0; // past f16's range: inf in f16
        let rounded: Vec<T> = master.iter().map(|&v| T::put(v)).collect();
        let a = MatRef::row_major(&a_data, 0, k);
        for b_transposed in [false, true] {
            let (rs, cs) = if b_transposed { (1, k) } else { (n, 1) };
            let view = MatRef {
                data: &master[..],
                offset: 0,
                rs,
                cs,
            };
            let same = view.with_data(&rounded[..]);
            for (mixed, plain) in drivers::<T, f32>().into_iter().zip(drivers::<T, T>()) {
                let mut got = vec![MaybeUninit::new(0f32); m * n];
                let mut want = vec![MaybeUninit::new(0f32); m * n];
                mixed(&product((m, n, k), a, view), &mut got);
                plain(&product((m, n, k), a, same), &mut want);
                let bits = |c: &[MaybeUninit<f32>]| -> Vec<u32> {
                    c.iter()
                        // SAFETY: both drivers wrote every element.
                        .map(|x| unsafe { x.assume_init() }.to_bits())
                        .collect()
                };
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{name} {m}x{n}x{k} t={b_transposed}"
                );
            }
        }
    }
}

#[test]
fn a_master_operand_is_rounded_as_it_is_packed() {
    check_master::<half::bf16>();
    check_master::<half::f16>();
    check_master::<f32>();
}

/// The public entry point into `T` itself, which rounds once: within half an ulp of `T`
/// plus the f32 accumulation error.
fn check_rounded<T: GemmElem>(
    (m, n, k): (usize, usize, usize),
    a: MatRef<T>,
    b: MatRef<T>,
    want: &[f64],
) {
    let name = std::any::type_name::<T>();
    let tol = 1e-5 * (k as f64 + 1.0);
    let mut c = vec![T::put(0.0); m * n];
    gemm(m, n, k, a, b, &mut c, false, true);
    // Into a fresh buffer, never initialised: every element written, to the same bits.
    let mut fresh: Vec<T> = Vec::with_capacity(m * n);
    gemm_uninit(
        (m, n, k),
        a,
        b,
        &mut fresh.spare_capacity_mut()[..m * n],
        true,
    );
    // SAFETY: `gemm_uninit` wrote all m * n elements.
    unsafe { fresh.set_len(m * n) };
    let bits = |v: &[T]| v.iter().map(|x| x.get().to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&fresh),
        bits(&c),
        "{name} {m}x{n}x{k}: gemm_uninit differs"
    );
    for (got, want) in c.iter().zip(want) {
        let ulp = (T::put(want.abs() as f32 * 1.001).get() - T::put(want.abs() as f32).get())
            .abs()
            .max(f32::EPSILON);
        let bound = f64::from(ulp) + tol + want.abs() * 1e-2;
        assert!(
            (f64::from(got.get()) - want).abs() <= bound,
            "{name} {m}x{n}x{k} into {name}: {} vs {want}",
            got.get()
        );
    }
}

#[test]
fn packing_buffers_start_on_a_cache_line() {
    let mut kept = Vec::<u32>::new();
    for len in [1, 15, 16, 1000, 40_000, 3] {
        let mut new = Vec::<f32>::new();
        let fresh = grown(&mut new, len);
        assert_eq!(
            (fresh.len(), fresh.as_ptr() as usize % CACHE_LINE),
            (len, 0)
        );
        // A kept buffer, regrown or reused shorter.
        let again = grown(&mut kept, len);
        assert_eq!(
            (again.len(), again.as_ptr() as usize % CACHE_LINE),
            (len, 0)
        );
    }
}

#[test]
fn gemm_matches_f64_reference_in_every_type() {
    check::<f32>();
    check::<f16>();
    check::<bf16>();
}

/// `CANDLE_AMP_PORTABLE_GEMM` is an on/off switch: `0`, `false` and the empty string leave the
/// detected kernel, `1` forces the portable one (any value forced it before). Each value runs
/// this test again in a child process, which prints the kernel it detected.
#[test]
fn the_portable_switch_reads_on_and_off() {
    const CHILD: &str = "CANDLE_AMP_GEMM_SWITCH_CHILD";
    if std::env::var_os(CHILD).is_some() {
        println!("kernel: {:?}", isa());
        return;
    }
    let kernel = |value: &str| -> String {
        let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                "--exact",
                "kernels::gemm::tests::the_portable_switch_reads_on_and_off",
            ])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .env("CANDLE_AMP_PORTABLE_GEMM", value)
            .output()
            .expect("the child runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        // The harness prints the test's name on the same line, before it.
        let line = stdout.lines().find_map(|l| l.split_once("kernel: "));
        line.expect("the child prints its kernel").1.to_string()
    };
    let portable = kernel("1");
    assert!(portable.contains("Portable"), "{portable}");
    let detected = format!("{:?}", isa());
    if std::env::var("CANDLE_AMP_PORTABLE_GEMM").is_err() {
        for off in ["0", "false", "", " Off "] {
            assert_eq!(kernel(off), detected, "CANDLE_AMP_PORTABLE_GEMM={off:?}");
        }
    }
}
