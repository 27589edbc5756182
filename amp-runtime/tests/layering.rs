//! The runtime's modules depend on each other one way only, in the order ARCHITECTURE.md draws.
//!
//! Plain Rust over the sources, in the spirit of rust-analyzer's `tidy` tests: the layer order
//! is read from the `<!-- layers -->` block of ARCHITECTURE.md (top layer first), and every
//! `crate::module` path in the code of a top-level module must name a module of a lower layer
//! (or the module itself). A module that needs something from above is a sign that the thing
//! belongs lower.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Layer rank of each module of the block after `marker` in ARCHITECTURE.md (0 = bottom).
fn layers(marker: &str) -> BTreeMap<String, usize> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let start = text
        .find(marker)
        .unwrap_or_else(|| panic!("a `{marker}` block in ARCHITECTURE.md"));
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
    refs_after(line, "crate::")
}

/// The modules a line of code names right after `prefix` (`prefix` then `m`, or `{a, b::c}`),
/// where `prefix` starts a path (`$crate::` counts, `amp_crate::` does not).
fn refs_after(line: &str, prefix: &str) -> Vec<String> {
    let mut refs = Vec::new();
    for (i, _) in line.match_indices(prefix) {
        let before = line[..i].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue; // e.g. `amp_crate::`, or `super::` inside `super::super::`
        }
        let rest = &line[i + prefix.len()..];
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
    let layers = layers("<!-- layers -->");
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

/// The room of the kernels a file of `src/kernels/` belongs to (`gemm` for `gemm/pack.rs`, `bias`
/// for `bias.rs`); `None` for the map, `kernels/mod.rs`.
fn room(rel: &Path) -> Option<String> {
    let mut parts = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned());
    let first = parts.next()?;
    if first == "mod.rs" {
        return None;
    }
    Some(first.trim_end_matches(".rs").to_string())
}

/// The rooms a line of a kernels file names: `crate::kernels::r` anywhere, `super::super::r`
/// in a room's subfile, and `super::r` in a one-file room naming another room (inside its
/// tests, `super::` is the file itself: those names are not rooms).
fn room_refs(line: &str, in_subfile: bool, rooms: &BTreeMap<String, usize>) -> Vec<String> {
    let mut refs = refs_after(line, "crate::kernels::");
    if in_subfile {
        refs.extend(refs_after(line, "super::super::"));
    } else {
        refs.extend(
            refs_after(line, "super::")
                .into_iter()
                .filter(|r| rooms.contains_key(r)),
        );
    }
    refs
}

/// The kernels' rooms depend on each other one way only, in the order of ARCHITECTURE.md's
/// `<!-- kernel rooms -->` block: a room names only rooms below it (or itself), so that a room
/// can be read knowing only what is under it.
#[test]
fn kernel_rooms_only_use_lower_rooms() {
    let rooms = layers("<!-- kernel rooms -->");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut violations = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for file in files {
        let rel = file.strip_prefix(&src).expect("under src/kernels");
        let Some(own) = room(rel) else { continue };
        seen.insert(own.clone());
        let Some(&rank) = rooms.get(&own) else {
            violations.push(format!(
                "kernels/{}: room `{own}` is not in ARCHITECTURE.md's kernel rooms",
                rel.display()
            ));
            continue;
        };
        let in_subfile = rel.components().count() > 1;
        let text = std::fs::read_to_string(&file).expect("readable source");
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            for used in room_refs(line, in_subfile, &rooms) {
                let ok = rooms.get(&used).is_some_and(|&r| used == own || r < rank);
                if !ok {
                    violations.push(format!(
                        "kernels/{}:{}: room `{own}` uses `{used}`, which is {}",
                        rel.display(),
                        n + 1,
                        if rooms.contains_key(&used) {
                            "not a lower room"
                        } else {
                            "not a room (name the room, e.g. crate::kernels::elem::Real)"
                        }
                    ));
                }
            }
        }
    }
    for m in rooms.keys() {
        if !seen.contains(m) {
            violations.push(format!(
                "ARCHITECTURE.md lists room `{m}`, not in src/kernels/"
            ));
        }
    }
    assert!(
        violations.is_empty(),
        "kernel room violations:\n{}",
        violations.join("\n")
    );
}

/// The macro crate's modules import one another without a cycle: helpers shared by several
/// phases live in leaf modules (`errors`, `syntax`), not in one phase that another phase's
/// module would then have to import back.
#[test]
fn macro_modules_have_no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../amp-macros/src");
    let mut edges: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    let mut files = Vec::new();
    sources(&src, &mut files);
    for file in files {
        let module = file
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("a file name")
            .to_string();
        if module == "lib" || module == "tests" {
            continue; // the root declares every module; unit tests import, nothing imports them
        }
        let text = std::fs::read_to_string(&file).expect("readable source");
        let uses = edges.entry(module.clone()).or_default();
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            uses.extend(crate_refs(line).into_iter().filter(|m| *m != module));
        }
    }
    assert!(edges.len() > 5, "amp-macros' modules were not found");
    if let Some(cycle) = find_cycle(&edges) {
        panic!("amp-macros import cycle: {}", cycle.join(" -> "));
    }
}

/// A cycle of `edges` as the modules along it (the first repeated at the end), if there is one.
fn find_cycle(edges: &BTreeMap<String, std::collections::BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        edges: &BTreeMap<String, std::collections::BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut cycle = path[at..].to_vec();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in edges.get(m).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = std::collections::BTreeSet::new();
    edges
        .keys()
        .find_map(|m| visit(m, edges, &mut Vec::new(), &mut done))
}

#[test]
fn the_cycle_finder_finds_a_cycle_and_only_a_cycle() {
    let graph = |pairs: &[(&str, &str)]| {
        let mut g: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
        for &(a, b) in pairs {
            g.entry(a.into()).or_default().insert(b.into());
            g.entry(b.into()).or_default();
        }
        g
    };
    assert_eq!(
        find_cycle(&graph(&[("a", "b"), ("b", "c"), ("a", "c")])),
        None
    );
    assert_eq!(
        find_cycle(&graph(&[("a", "b"), ("b", "c"), ("c", "a")])),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    let rooms: BTreeMap<String, usize> = [("elem".to_string(), 0), ("gemm".to_string(), 1)].into();
    assert_eq!(
        room_refs("use super::super::elem::Real;", true, &rooms),
        ["elem"]
    );
    assert_eq!(
        room_refs("use super::gemm::MatRef;", false, &rooms),
        ["gemm"]
    );
    assert!(room_refs("use super::*;", false, &rooms).is_empty());
    assert_eq!(
        room_refs(
            "$crate::kernels::elem::x; crate::kernels::{gemm, elem}",
            false,
            &rooms
        ),
        ["elem", "gemm", "elem"]
    );
}
