//! The crate's on/off environment switches (`CANDLE_AMP_CHECK_FINITE`,
//! `CANDLE_AMP_PORTABLE_GEMM`, `CANDLE_AMP_NO_AMX`), all read one way.

/// The switch `name`: `None` when it is not set; on for `1`, `true`, `yes` or `on`, off for
/// `0`, `false`, `no`, `off` or the empty string (any case, spaces around allowed). Any other
/// value reads as off and is said on stderr and as a tracing event: a typo would otherwise
/// leave the switch off, or on, without a word (`CANDLE_AMP_PORTABLE_GEMM=0` turned the slow
/// portable GEMM on, any value did).
pub(crate) fn switch(name: &str) -> Option<bool> {
    let value = std::env::var(name).ok()?;
    Some(flag(&value).unwrap_or_else(|| {
        let msg =
            format!("{name}={value:?} is not one of 1/true/yes/on or 0/false/no/off: read as off");
        eprintln!("candle-amp: {msg}");
        tracing::warn!(target: "candle_amp", "{msg}");
        false
    }))
}

/// An on/off value (see [`switch`]); `None` for anything else.
fn flag(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "" | "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::flag;

    /// `yes`, `on` and `" 1"` were read as off without a word; now every common spelling is
    /// understood and anything else is reported (`None`).
    #[test]
    fn flags_read_common_spellings_and_refuse_the_rest() {
        for on in ["1", "true", "TRUE", "yes", "On", " 1", "1\n"] {
            assert_eq!(flag(on), Some(true), "{on:?}");
        }
        for off in ["", "0", "false", "No", "OFF", " 0 "] {
            assert_eq!(flag(off), Some(false), "{off:?}");
        }
        for unknown in ["2", "enable", "y es", "truthy"] {
            assert_eq!(flag(unknown), None, "{unknown:?}");
        }
    }
}
