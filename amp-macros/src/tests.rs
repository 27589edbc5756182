//! Expansion snapshots: each macro's output for a representative input, formatted with
//! prettyplease and pinned with insta, so that any change to the generated code shows up as a
//! reviewable diff instead of passing unnoticed. Regenerate with
//! `INSTA_UPDATE=always cargo test -p amp-macros` and read the `git diff` before committing.

use proc_macro2::TokenStream;
use quote::quote;

fn pretty(tokens: TokenStream) -> String {
    match syn::parse2::<syn::File>(tokens.clone()) {
        Ok(file) => prettyplease::unparse(&file),
        Err(_) => tokens.to_string(),
    }
}

#[test]
fn fn_region() {
    let out = crate::expand::autocast(
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
    let out = crate::expand::autocast(
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
    let out = crate::expand::autocast(
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
    let out = crate::expand::autocast(
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
    let out = crate::expand::autocast(quote!(fp8), item.clone()).to_string();
    assert!(out.contains("compile_error"), "{out}");
    assert!(out.ends_with(&item.to_string()), "{out}");
}

#[test]
fn custom_fwd_forms() {
    let on_impl = crate::custom::custom_fwd(
        quote!(cast_inputs = f32),
        quote! {
            impl Lse {
                fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
                    x.log_sum_exp(1)
                }
            }
        },
    );
    let on_fn = crate::custom::custom_fwd(
        quote!(cast_inputs = f32),
        quote! {
            fn normalize(x: &Tensor<F32>, eps: f64) -> Result<Tensor<F32>> {
                x.broadcast_div(&(x.sqr()?.sum_keepdim(1)?.sqrt()? + eps)?)
            }
        },
    );
    let bwd = crate::custom::custom_bwd(
        TokenStream::new(),
        quote! {
            fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
                Ok(Some((arg.to_dtype(DType::F32)? * grad_res)?))
            }
        },
    );
    insta::assert_snapshot!(pretty(quote!(#on_impl #on_fn #bwd)));
}

/// The names generated code may use under `::candle_amp::__private`: the contract with the
/// facade, which provides exactly these.
#[test]
fn runtime_paths_are_the_contract() {
    let names: Vec<_> = crate::runtime::Rt::ALL.iter().map(|rt| rt.name()).collect();
    assert_eq!(
        names,
        [
            "Fp16Policy",
            "Bf16Policy",
            "Fp32Policy",
            "Policy",
            "Routed",
            "calls",
            "RegionCall",
            "RegionGuard",
            "AsAmp",
            "AmpTensor",
            "enter",
            "enter_fp32",
            "enter_cast",
            "exit",
            "exit_to_region",
            "grad_like",
            "GradsLike",
            "F32",
            "F16",
            "BF16",
            "op",
            "candle_core",
        ]
    );
    let routed = crate::runtime::Rt::Routed;
    let path = quote!(#routed).to_string();
    assert_eq!(path.replace(' ', ""), "::candle_amp::__private::Routed");
}
