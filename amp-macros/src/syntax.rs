//! Syntax built for generated code, shared by the phases that emit it.

use proc_macro2::TokenStream;
use syn::{Block, Expr, Stmt};

/// A block holding generated statements as tokens, which are emitted between the braces as
/// they are: built, not parsed back. The braces are the call site's, as a quoted block's are.
pub(crate) fn verbatim_block(stmts: TokenStream) -> Block {
    Block {
        brace_token: syn::token::Brace::default(),
        stmts: vec![Stmt::Expr(Expr::Verbatim(stmts), None)],
    }
}
