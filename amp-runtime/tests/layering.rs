//! The runtime's modules depend on each other one way only, in the order ARCHITECTURE.md draws.
//!
//! Plain Rust over the sources, in the spirit of rust-analyzer's `tidy` tests: the layer order
//! is read from the `<!-- layers -->` block of ARCHITECTURE.md (top layer first), and every
//! `crate::module` path in the code of a top-level module must name a module of a lower layer
//! (or the module itself). A module that needs something from above is a sign that the thing
//! belongs lower.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Layer rank of each top-level module (0 = bottom), from ARCHITECTURE.md.
fn layers() -> BTreeMap<String, usize> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let start = text
        .find("<!-- layers -->")
        .expect("a `<!-- layers -->` block");
    let block = text[start..]
        .split("```")
        .nth(1)
        .expect("a fenced block after the marker");
    let rows: Vec<Vec<String>> = block
        .lines()
        .skip(1) // the fence's info string
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with(['|', '↓', '^']))
        .map(|l| {
            let modules = l.split("  ").next().unwrap_or_default();
            modules
                .split(',')
                .map(|m| m.trim().trim_end_matches('/').to_string())
                .collect()
        })
        .collect();
    let n = rows.len();
    rows.into_iter()
        .enumerate()
        .flat_map(|(i, row)| row.into_iter().map(move |m| (m, n - 1 - i)))
        .collect()
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules a line of code names as `crate::m` (also `crate::{a, b::c}`).
fn crate_refs(line: &str) -> Vec<String> {
    let mut refs = Vec::new();
    for (i, _) in line.match_indices("crate::") {
        let before = line[..i].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // e.g. `amp_crate::`
        }
        let rest = &line[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = group.split('}').next().unwrap_or_default();
            refs.extend(
                group
                    .split(',')
                    .map(|p| p.trim().split("::").next().unwrap_or_default().to_string())
                    .filter(|m| !m.is_empty()),
            );
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            refs.push(name);
        }
    }
    refs
}

#[test]
fn modules_only_use_lower_layers() {
    let layers = layers();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut violations = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for file in files {
        let rel = file.strip_prefix(&src).expect("under src");
        let top = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|s| s.trim_end_matches(".rs").to_string())
            .expect("a file name");
        if top == "lib" {
            continue; // the crate root declares and re-exports the modules
        }
        seen.insert(top.clone());
        let Some(&rank) = layers.get(&top) else {
            violations.push(format!(
                "{}: module `{top}` is not in ARCHITECTURE.md's layers",
                rel.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(&file).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            for used in crate_refs(line) {
                let ok = match layers.get(&used) {
                    Some(&r) => used == top || r < rank,
                    None => false,
                };
                if !ok {
                    violations.push(format!(
                        "{}:{}: `{top}` uses `crate::{used}`, which is {}",
                        rel.display(),
                        n + 1,
                        if layers.contains_key(&used) {
                            "not in a lower layer"
                        } else {
                            "not a module of the layer order (name the module, e.g. crate::tensor::Tensor)"
                        }
                    ));
                }
            }
        }
    }
    for m in layers.keys() {
        if !seen.contains(m) {
            violations.push(format!(
                "ARCHITECTURE.md lists `{m}`, which is not a module of src/"
            ));
        }
    }
    assert!(
        violations.is_empty(),
        "layering violations:\n{}",
        violations.join("\n")
    );
}

#[test]
fn the_checker_sees_grouped_and_macro_paths() {
    assert_eq!(
        crate_refs("use crate::{composite, fp32::sum, kernels};"),
        ["composite", "fp32", "kernels"]
    );
    assert_eq!(
        crate_refs("$crate::region::unary::<Pol, $crate::nn::X>"),
        ["region", "nn"]
    );
    assert!(crate_refs("candle_core::Tensor").is_empty());
}
