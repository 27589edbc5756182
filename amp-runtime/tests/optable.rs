//! The runtime against the op table (`amp-macros/src/optable.rs`): every hand-written routed
//! method and routed free op is a row of the table, with the row's argument count, and every
//! row has its routed form. Adding an op on one side only fails here (or, for the generated
//! shapes and the markers, does not compile).

use std::collections::BTreeMap;

macro_rules! method_rows {
    ($($shape:ident $arity:literal $name:ident;)*) => {
        /// `(name, (shape, arity))` of every `method` row.
        fn method_rows() -> BTreeMap<&'static str, (&'static str, usize)> {
            BTreeMap::from([$((stringify!($name), (stringify!($shape), $arity))),*])
        }
    };
}
amp_macros::__op_table!(methods => method_rows);

macro_rules! free_rows {
    ($($module:ident $name:ident;)*) => {
        /// `(module, name)` of every `free` row.
        fn free_rows() -> Vec<(&'static str, &'static str)> {
            vec![$((stringify!($module), stringify!($name))),*]
        }
    };
}
amp_macros::__op_table!(free => free_rows);

fn source(path: &str) -> String {
    let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src")
        .join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// `name -> argument count (without the receiver)` of every `pub fn` in `text` at the given
/// indentation (4: methods of an impl; 0: free functions).
fn pub_fns(text: &str, indent: usize) -> BTreeMap<String, usize> {
    let prefix = format!("{}pub fn ", " ".repeat(indent));
    let mut fns = BTreeMap::new();
    for (start, _) in text.match_indices(&prefix) {
        if start > 0 && !text[..start].ends_with('\n') {
            continue;
        }
        let rest = &text[start + prefix.len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // The parameter list: the first `(` after the generics, to its matching `)`.
        let mut depth_angle = 0i32;
        let mut open = None;
        for (i, c) in rest.char_indices().skip(name.len()) {
            match c {
                '<' => depth_angle += 1,
                '>' => depth_angle -= 1,
                '(' if depth_angle == 0 => {
                    open = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let open = open.expect("a parameter list");
        let mut depth = 0i32;
        let mut params = Vec::new();
        let mut current = String::new();
        let mut previous = ' ';
        for c in rest[open + 1..].chars() {
            let arrow = previous == '-';
            previous = c;
            match c {
                '(' | '<' | '[' => depth += 1,
                ')' if depth == 0 => break,
                '>' if arrow => {}
                ')' | '>' | ']' => depth -= 1,
                ',' if depth == 0 => {
                    params.push(std::mem::take(&mut current));
                    continue;
                }
                _ => {}
            }
            current.push(c);
        }
        params.push(current);
        let count = params
            .iter()
            .map(|p| p.trim())
            .filter(|p| !p.is_empty() && *p != "&self" && *p != "self")
            .count();
        fns.insert(name, count);
    }
    fns
}

#[test]
fn hand_written_routed_methods_are_the_custom_rows() {
    let rows = method_rows();
    let written = pub_fns(&source("region/methods.rs"), 4);
    for (name, (shape, arity)) in &rows {
        if *shape == "custom" {
            assert_eq!(
                written.get(*name),
                Some(arity),
                "the op table has `{name}` (custom, {arity} arguments): region/methods.rs needs \
                 a routed `pub fn {name}` with {arity} arguments"
            );
        }
    }
    for name in written.keys() {
        assert!(
            rows.get(name.as_str())
                .is_some_and(|(shape, _)| *shape == "custom"),
            "region/methods.rs routes `{name}`, which is not a custom method row of the op table \
             (the rewrite would never call it)"
        );
    }
}

#[test]
fn routed_free_ops_are_the_free_rows() {
    let rows = free_rows();
    let written = pub_fns(&source("region/free.rs"), 0);
    for (module, name) in &rows {
        assert!(
            written.contains_key(*name),
            "the op table has `{module}::{name}`: region/free.rs needs a routed `pub fn {name}`"
        );
    }
    for name in written.keys() {
        assert!(
            rows.iter().any(|(_, n)| n == name),
            "region/free.rs routes `{name}`, which is not a free row of the op table"
        );
    }
}

#[test]
fn the_signature_reader_counts_parameters() {
    let text = "    pub fn narrow<D: Dim>(\n        &self,\n        dim: D,\n        start: usize,\n        len: usize,\n    ) -> R {}\n    pub fn t(&self) -> R {}\n    pub fn f(&self, s: impl Fn(A, B) -> C, t: Vec<(u8, u8)>) {}\n";
    let fns = pub_fns(text, 4);
    assert_eq!(fns["narrow"], 3);
    assert_eq!(fns["t"], 0);
    assert_eq!(fns["f"], 2);
}
