//! The syntax of `CUMEM_CONF`: comma-separated `key=value` entries.
//!
//! The manager's [`Config`](crate::Config) gives the keys their meaning;
//! lower layers that need one setting before any manager exists (the
//! default device) read it through [`env_value`].

use crate::error::{Error, Result};

/// The `key=value` entries of `text`, trimmed, empty entries skipped; an
/// entry without `=` is an [`Error::Config`].
pub(crate) fn entries(text: &str) -> impl Iterator<Item = Result<(&str, &str)>> {
    text.split(',').map(str::trim).filter(|i| !i.is_empty()).map(|item| {
        item.split_once('=')
            .map(|(k, v)| (k.trim(), v.trim()))
            .ok_or_else(|| Error::Config(format!("'{item}' is not key=value")))
    })
}

/// The value `CUMEM_CONF` gives `key`, if it is set, readable and names it.
pub(crate) fn env_value(key: &str) -> Option<String> {
    let text = std::env::var("CUMEM_CONF").ok()?;
    let value = entries(&text).filter_map(Result::ok).filter(|(k, _)| *k == key).last()?.1;
    Some(value.to_string())
}

#[cfg(test)]
mod tests {
    use super::entries;

    #[test]
    fn entries_are_trimmed_and_checked() {
        let all: Vec<_> = entries(" a = 1 ,, b=2 ").collect::<Result<_, _>>().unwrap();
        assert_eq!(all, [("a", "1"), ("b", "2")]);
        assert!(entries("a=1,oops").any(|e| e.is_err()));
    }
}
