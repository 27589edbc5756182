//! Procedural macros of candle-amp.
//!
//! `#[autocast]`, `#[keep_fp32]`, `#[custom_fwd]`, `#[custom_bwd]` and `policy!` are being
//! built (see the README's roadmap); this crate is in the workspace now so that the facade's
//! layout and re-exports are final.
