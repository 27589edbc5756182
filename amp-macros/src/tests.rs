//! Expansion snapshots: each macro's output for a representative input, formatted with
//! prettyplease and pinned with insta, so that any change to the generated code shows up as a
//! reviewable diff instead of passing unnoticed. Regenerate with
//! `INSTA_UPDATE=always cargo test -p amp-macros` and read the `git diff` before committing.

use proc_macro2::TokenStream;
use quote::quote;

use crate::model::AttrKind;

fn autocast(args: TokenStream, item: TokenStream) -> TokenStream {
    crate::region_attr(AttrKind::Autocast, args, item)
}

fn keep_fp32(args: TokenStream, item: TokenStream) -> TokenStream {
    crate::region_attr(AttrKind::KeepFp32, args, item)
}

fn custom_fwd(args: TokenStream, item: TokenStream) -> TokenStream {
    crate::region_attr(AttrKind::CustomFwd, args, item)
}

fn pretty(tokens: TokenStream) -> String {
    match syn::parse2::<syn::File>(tokens.clone()) {
        Ok(file) => prettyplease::unparse(&file),
        Err(_) => tokens.to_string(),
    }
}

#[test]
fn fn_region() {
    let out = autocast(
        quote!(fp16),
        quote! {
            fn forward(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<Tensor<F32>> {
                let h = x.matmul(&w)?.relu()?;
                if h.dims()[0] == 0 {
                    return Ok(h);
                }
                Ok(ops::softmax(&h, 1)?)
            }
        },
    );
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn impl_inheriting_the_callers_policy() {
    let out = autocast(
        TokenStream::new(),
        quote! {
            impl Block {
                fn forward(&self, x: &Tensor<F32>, train: bool) -> Result<Tensor<F32>> {
                    let h = self.fc.forward(&x)?;
                    Ok(self.bn.forward_t(&h, train)?)
                }
            }
        },
    );
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn nested_module_calls_and_enabled_switch() {
    let out = autocast(
        quote!(bf16, enabled = self.use_amp),
        quote! {
            impl Model {
                fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
                    let mut h = x.clone();
                    for block in &self.blocks {
                        h = block.forward(&h)?;
                    }
                    Ok(loss::mse(&h, &x)?)
                }
            }
        },
    );
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn keep_fp32_statement_and_method() {
    let out = autocast(
        quote!(fp16),
        quote! {
            impl Head {
                fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
                    let h = x.matmul(&self.w)?;
                    #[keep_fp32]
                    let s = h.sum_keepdim(1)?;
                    Ok(Tensor::cat(&[&h, &s], 1)?)
                }

                #[keep_fp32]
                fn forward_t(&self, x: &Tensor<F32>, train: bool) -> Result<Tensor<F32>> {
                    Ok(x.exp()?)
                }
            }
        },
    );
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn policy_declaration() {
    let out = crate::policy::expand(quote! {
        /// Softmax kept in f16.
        pub struct AttentionPolicy: fp16 {
            softmax: lower_precision,
            gelu: fp32,
        }
    });
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn errors_leave_the_item_untouched() {
    let item = quote! {
        fn forward(x: &Tensor<F32>) -> Result<Tensor<F32>> {
            Ok(x.relu()?)
        }
    };
    let out = autocast(quote!(fp8), item.clone()).to_string();
    assert!(out.contains("compile_error"), "{out}");
    assert!(out.ends_with(&item.to_string()), "{out}");
}

#[test]
fn custom_fwd_forms() {
    let on_impl = custom_fwd(
        quote!(cast_inputs = f32),
        quote! {
            impl Lse {
                fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
                    x.log_sum_exp(1)
                }
            }
        },
    );
    let on_fn = custom_fwd(
        quote!(cast_inputs = f32),
        quote! {
            fn normalize(x: &Tensor<F32>, eps: f64) -> Result<Tensor<F32>> {
                x.broadcast_div(&(x.sqr()?.sum_keepdim(1)?.sqrt()? + eps)?)
            }
        },
    );
    let bwd = crate::custom_bwd_attr(
        TokenStream::new(),
        quote! {
            fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
                Ok(Some((arg.to_dtype(DType::F32)? * grad_res)?))
            }
        },
    );
    insta::assert_snapshot!(pretty(quote!(#on_impl #on_fn #bwd)));
}

/// The names generated code may use under `::candle_amp::__private` are exactly what the
/// runtime's hidden module exports (read from its source): none missing, nothing else there.
#[test]
fn runtime_paths_are_what_the_runtime_exports() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../amp-runtime/src/region/mod.rs");
    let source = std::fs::read_to_string(path).expect("the runtime's region/mod.rs");
    let start = source
        .find("pub mod __private {")
        .expect("the hidden module");
    let block = &source[start..];
    let block = &block[..block.find("\n}").expect("its closing brace")];
    // `pub use a::b::{C, D};` exports `C` and `D`; `pub use a::b;` exports `b`.
    let mut exported: Vec<String> = Vec::new();
    for item in block.split("pub use ").skip(1) {
        let item = &item[..item.find(';').expect("a use item ends with `;`")];
        let names = match item.find('{') {
            Some(open) => &item[open + 1..item.rfind('}').expect("a closed group")],
            None => item.rsplit("::").next().unwrap_or_default(),
        };
        exported.extend(
            names
                .split(',')
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty()),
        );
    }
    let mut exported: Vec<&str> = exported.iter().map(String::as_str).collect();
    let mut names: Vec<_> = crate::runtime::Rt::ALL.iter().map(|rt| rt.name()).collect();
    exported.sort_unstable();
    names.sort_unstable();
    assert_eq!(names, exported, "Rt and the runtime's `__private` disagree");
    let routed = crate::runtime::Rt::Routed;
    let path = quote!(#routed).to_string();
    assert_eq!(path.replace(' ', ""), "::candle_amp::__private::Routed");
}

/// Runs the model and validation on `source`, an item under one region attribute written as in
/// user code, and lists every error as `line:column `tokens`: message`, in the order reported.
fn validation_errors(source: &str) -> String {
    let mut item: syn::Item = syn::parse_str(source).expect("the test input is an item");
    let attrs = match &mut item {
        syn::Item::Fn(f) => &mut f.attrs,
        syn::Item::Impl(imp) => &mut imp.attrs,
        syn::Item::Struct(s) => &mut s.attrs,
        _ => panic!("no test uses another item"),
    };
    let attr = attrs.remove(0);
    let args = match &attr.meta {
        syn::Meta::List(list) => list.tokens.clone(),
        _ => TokenStream::new(),
    };
    if attr.path().is_ident("custom_bwd") {
        let syn::Item::Fn(item) = &item else {
            panic!("#[custom_bwd] tests use a fn")
        };
        let backward = crate::custom::Backward::from_syn(args, item);
        return render_errors(source, backward.validate());
    }
    let kind = if attr.path().is_ident("autocast") {
        AttrKind::Autocast
    } else if attr.path().is_ident("keep_fp32") {
        AttrKind::KeepFp32
    } else {
        AttrKind::CustomFwd
    };
    let result = crate::model::Region::from_syn(kind, args, &item)
        .and_then(|region| crate::validate::region(&region));
    render_errors(source, result)
}

fn render_errors(source: &str, result: syn::Result<()>) -> String {
    let Err(errors) = result else {
        return "no errors".to_string();
    };
    let lines: Vec<&str> = source.lines().collect();
    errors
        .into_iter()
        .map(|error| {
            let (start, end) = (error.span().start(), error.span().end());
            let line = lines[start.line - 1];
            let tokens = if end.line == start.line {
                &line[start.column..end.column]
            } else {
                &line[start.column..]
            };
            format!("{}:{} `{tokens}`: {error}", start.line, start.column)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn validation_reports_every_error_together() {
    let errors = validation_errors(
        r#"#[autocast(fp16, bf16, output = f8, enabled = true, enabled = false)]
impl Model {
    #[keep_fp32]
    #[autocast(bf16)]
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let l = loss::mse(&x, &x)?;
        l.backward()?;
        let _closure = || l.backward();
        println!("{:?}", l.backward());
        fn nested(l: &Tensor) { l.backward(); }
        Ok(l)
    }

    #[autocast(bf16, output = f16)]
    fn forward_t(&self, x: &Tensor<F32>, cfg: &Config) -> Result<Tensor<F32>> {
        Ok(x.relu()?)
    }
}"#,
    );
    insta::assert_snapshot!(errors);
}

#[test]
fn method_markers_conflict_on_the_second_attribute() {
    let errors = validation_errors(
        r"#[autocast(fp16)]
impl Model {
    #[autocast(bf16)]
    #[keep_fp32]
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        Ok(x.relu()?)
    }

    #[autocast]
    #[autocast(fp16)]
    fn forward_t(&self, x: &Tensor<F32>, train: bool) -> Result<Tensor<F32>> {
        Ok(x.relu()?)
    }

    #[keep_fp32]
    #[keep_fp32]
    fn forward_train(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        Ok(x.relu()?)
    }
}",
    );
    insta::assert_snapshot!(errors, @r"
    4:4 `#[keep_fp32]`: a method is either #[keep_fp32] or #[autocast(..)], not both
    10:4 `#[autocast(fp16)]`: duplicate #[autocast] on this method
    ");
}

#[test]
fn attribute_misuses_point_at_the_item_or_the_arguments() {
    let on_struct = validation_errors("#[autocast(fp16, fp16)]\nstruct Model;");
    let keep_on_fn = validation_errors(
        "#[keep_fp32(strict, mode)]\nfn f(x: &Tensor<F32>) -> Result<Tensor<F32>> { Ok(x.exp()?) }",
    );
    let custom_fn = validation_errors(
        "#[custom_fwd(cast_inputs = f8)]\nfn f(x: &Tensor<F16>, y: Tensor<BF16>) -> Result<Tensor<F32>> { x.exp() }",
    );
    let contradicting = validation_errors(
        "#[custom_fwd(cast_inputs = f32)]\nfn f(x: &Tensor<F16>, y: Tensor<BF16>, z: &Tensor) -> Result<Tensor<F32>> { x.exp() }",
    );
    insta::assert_snapshot!([on_struct, keep_on_fn, custom_fn, contradicting].join("\n---\n"), @r"
    1:17 `fp16`: duplicate policy argument
    2:0 `struct`: #[autocast] applies to a fn, a method or an impl block
    ---
    1:12 `strict, mode`: #[keep_fp32] takes no arguments
    2:0 `fn`: #[keep_fp32] only has meaning inside an #[autocast] region: put it on a statement, a block or a method there, or on a module's impl block to keep that module in f32
    ---
    1:27 `f8`: cast_inputs is `f32`, `f16` or `bf16`
    ---
    2:16 `F16`: cast_inputs casts to F32, but this parameter is declared F16
    2:32 `BF16`: cast_inputs casts to F32, but this parameter is declared BF16
    ");
}

#[test]
fn custom_bwd_and_policy_report_every_error_together() {
    let bwd = validation_errors(
        "#[custom_bwd(strict)]\nfn bwd(&self, (a, b): (&Tensor, &Tensor)) { todo!() }",
    );

    let out = crate::policy::expand(quote! {
        pub struct P: fp8 {
            softmax: half,
            gelu: fp32,
            softmax: fp32,
        }
    });
    let policy: Vec<_> = out
        .into_iter()
        .filter_map(|t| match t {
            proc_macro2::TokenTree::Group(g) => Some(g.stream().to_string()),
            _ => None,
        })
        .filter(|s| s.starts_with('"'))
        .collect();
    insta::assert_snapshot!(format!("{bwd}\n---\n{}", policy.join("\n")), @r#"
    1:13 `strict`: #[custom_bwd] takes no arguments
    2:14 `(a, b)`: #[custom_bwd] needs named parameters
    2:3 `bwd`: #[custom_bwd] applies to a backward taking the op's inputs, its result and the result's gradient, as candle's `CustomOp1/2/3::bwd`
    2:3 `bwd`: #[custom_bwd] needs the backward's Result return type
    ---
    "the lower dtype of a policy is `fp16` or `bf16`"
    "unknown op class: use `lower_precision`, `fp32`, `promote` or `preserve`"
    "`softmax` is moved twice"
    "#);
}

#[test]
fn fallback_keeps_the_item_and_stubs_region_call() {
    let item = quote! {
        impl<T: Clone> Block<T> {
            fn forward(&self, x: &Tensor<F32>, cfg: &Config) -> Result<Tensor<F32>> {
                let y = x.relu()?;
                y.as_candle().backward()?;
                Ok(y)
            }

            fn forward_t(&self, x: &Tensor<F32>, train: bool) -> Result<Tensor<F32>> {
                Ok(x.relu()?)
            }

            fn helper(&self) -> usize {
                1
            }
        }
    };
    let out = autocast(TokenStream::new(), item.clone());
    let text = out.to_string();
    // The original item, token for token, and no rewritten body.
    assert!(text.contains(&item.to_string()), "{text}");
    assert!(!text.contains("Routed"), "{text}");
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn fallback_removes_the_markers_the_expansion_would_consume() {
    let out = keep_fp32(
        quote!(strict),
        quote! {
            impl Head {
                #[keep_fp32]
                fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
                    #[keep_fp32]
                    let s = x.sum_keepdim(1)?;
                    #[keep_fp32]
                    {
                        fn nested() {
                            #[keep_fp32]
                            let kept = 1;
                        }
                    }
                    #[allow(unused)]
                    Ok(s)
                }
            }
        },
    );
    insta::assert_snapshot!(pretty(out));
}

#[test]
fn policy_fallback_declares_the_policy() {
    let bad_class = crate::policy::expand(quote! {
        /// Kept in bf16.
        pub struct P: bf16 { softmax: half }
    });
    let bad_syntax = crate::policy::expand(quote! {
        pub(crate) struct Q: fp8 { softmax lower_precision }
    });
    let no_name = crate::policy::expand(quote! { pub struct });
    insta::assert_snapshot!(pretty(quote!(#bad_class #bad_syntax #no_name)));
}
