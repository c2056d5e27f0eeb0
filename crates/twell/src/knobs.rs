//! Development knobs read from the environment: switches that measure two variants of
//! one build (`TWELL_ROW_SPLIT`, `TWELL_DECODE_MAX_TOKENS`, `TWELL_BACKWARD`,
//! `TWELL_HOST_WARM_MS`). A value a knob cannot take is an error that names the knob, so a
//! mistyped A/B run fails instead of quietly measuring the default.

use crate::error::{err, TwellError};

/// Where a knob keeps its value: read from the environment once per process.
pub(crate) type Cell = std::sync::OnceLock<Result<Option<usize>, String>>;

/// The knob kept in `cell`, read by `read` (an `env_*` function) on the first call; a
/// value the knob cannot take is the same error on every call.
pub(crate) fn read_once(
    cell: &'static Cell,
    read: impl FnOnce() -> Result<Option<usize>, String>,
) -> candle_core::Result<Option<usize>> {
    match cell.get_or_init(read) {
        Ok(value) => Ok(*value),
        Err(msg) => err(TwellError::Invalid(msg.clone())),
    }
}

/// `raw`, the value of the knob `name`, as a count that `accept` allows (`expected`
/// says which, for the message); `None` when the knob is unset.
pub(crate) fn parse_count(
    name: &str,
    raw: Option<&str>,
    expected: &str,
    accept: impl Fn(usize) -> bool,
) -> Result<Option<usize>, String> {
    let Some(raw) = raw else { return Ok(None) };
    match raw.trim().parse::<usize>() {
        Ok(v) if accept(v) => Ok(Some(v)),
        _ => Err(format!("{name}={raw:?}: expected {expected}")),
    }
}

/// [`parse_count`] of the environment variable `name`.
pub(crate) fn env_count(
    name: &str,
    expected: &str,
    accept: impl Fn(usize) -> bool,
) -> Result<Option<usize>, String> {
    let raw = std::env::var_os(name);
    let text = raw.as_ref().map(|v| v.to_string_lossy());
    parse_count(name, text.as_deref(), expected, accept)
}

/// `raw`, the value of the knob `name`, as the index of one of `choices`; `None` when
/// the knob is unset.
pub(crate) fn parse_choice(
    name: &str,
    raw: Option<&str>,
    choices: &[&str],
) -> Result<Option<usize>, String> {
    let Some(raw) = raw else { return Ok(None) };
    match choices.iter().position(|c| *c == raw.trim()) {
        Some(i) => Ok(Some(i)),
        None => Err(format!(
            "{name}={raw:?}: expected one of {}",
            choices.join(", ")
        )),
    }
}

/// [`parse_choice`] of the environment variable `name`.
pub(crate) fn env_choice(name: &str, choices: &[&str]) -> Result<Option<usize>, String> {
    let raw = std::env::var_os(name);
    let text = raw.as_ref().map(|v| v.to_string_lossy());
    parse_choice(name, text.as_deref(), choices)
}

/// The splits the prefill row kernels are built for besides one warp a row, most first
/// (their `SPLIT`: `_s4`, `_s2`; each divides a block's 8 warps). Kept here rather than
/// in the CUDA module so that `TWELL_ROW_SPLIT`'s rule is tested on any machine.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const ROW_SPLITS: [usize; 2] = [4, 2];

/// Whether the row kernels are built for `split` warps a row (`TWELL_ROW_SPLIT`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn is_row_split(split: usize) -> bool {
    split == 1 || ROW_SPLITS.contains(&split)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_knob_takes_its_values_and_names_itself_otherwise() {
        let split = |raw| parse_count("TWELL_ROW_SPLIT", raw, "1 or 4", |v| v == 1 || v == 4);
        assert_eq!(split(None), Ok(None));
        assert_eq!(split(Some("4")), Ok(Some(4)));
        assert_eq!(split(Some(" 1 ")), Ok(Some(1)));
        for bad in ["3", "0", "four", "", "-1"] {
            let msg = split(Some(bad)).unwrap_err();
            assert!(
                msg.contains("TWELL_ROW_SPLIT") && msg.contains("1 or 4"),
                "{msg}"
            );
        }
        let taken: Vec<usize> = (0..=16).filter(|&v| is_row_split(v)).collect();
        assert_eq!(taken, vec![1, 2, 4]);
        assert!(taken.iter().all(|split| 8 % split == 0), "{taken:?}");
        let built = |raw| parse_count("TWELL_ROW_SPLIT", raw, "1, 2 or 4", is_row_split);
        assert_eq!(built(Some("2")), Ok(Some(2)));
        assert!(built(Some("8")).unwrap_err().contains("1, 2 or 4"));
        let tokens = |raw| parse_count("TWELL_DECODE_MAX_TOKENS", raw, "a token count", |_| true);
        assert_eq!(tokens(Some("128")), Ok(Some(128)));
        assert!(tokens(Some("1e3")).unwrap_err().contains("a token count"));
        let path = |raw| parse_choice("TWELL_BACKWARD", raw, &["sparse", "dense-dx", "dense"]);
        assert_eq!(path(None), Ok(None));
        assert_eq!(path(Some("dense-dx")), Ok(Some(1)));
        assert_eq!(path(Some("dense ")), Ok(Some(2)));
        for bad in ["Dense", "gemm", ""] {
            let msg = path(Some(bad)).unwrap_err();
            assert!(
                msg.contains("TWELL_BACKWARD") && msg.contains("dense-dx"),
                "{msg}"
            );
        }
    }
}
