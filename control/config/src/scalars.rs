//! Typed scalar values of the traffic kinds — durations, percentages,
//! weights, counts, regular expressions — and the serde glue that checks
//! them while deserializing, so a bad value is reported with its field path
//! and its line like any type error.
//!
//! Two duration syntaxes exist in the APIs Ambit reads:
//!
//! * Istio (`networking.istio.io`) fields are `google.protobuf.Duration`s,
//!   which Istio reads the way Go's `time.ParseDuration` does: a sequence of
//!   decimal numbers, each with an optional fraction and a unit among `ns`,
//!   `us` (`µs`), `ms`, `s`, `m`, `h` — so the protobuf JSON form (`"1.5s"`)
//!   and the forms Kubernetes users write (`"100ms"`, `"2m"`, `"1h30m"`) are
//!   all accepted ([`parse_istio_duration`]);
//! * Gateway API (`gateway.networking.k8s.io`) fields follow GEP-2257: one to
//!   four whole numbers of at most five digits, each with a unit among `h`,
//!   `m`, `s`, `ms` — no fractions, no `us`/`ns` ([`parse_gateway_duration`]).
//!
//! Negative durations are rejected in both.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

/// Why a scalar value was rejected. Every message ends with what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScalarError {
    #[error(
        "{input:?} is not a duration ({reason}); write numbers with units (ns, us, ms, s, m, h), e.g. \"1.5s\", \"100ms\", \"2m\", \"1h30m\""
    )]
    IstioDuration { input: String, reason: &'static str },
    #[error(
        "{input:?} is not a Gateway API duration ({reason}); write 1 to 4 whole numbers of at most 5 digits, each with a unit h, m, s or ms, e.g. \"10s\", \"1500ms\", \"1m30s\""
    )]
    GatewayDuration { input: String, reason: &'static str },
    #[error("duration {0:?} is negative; durations must be zero or more")]
    NegativeDuration(String),
    #[error("duration {0:?} is too large; use at most about 290 years")]
    DurationTooLarge(String),
    #[error("percentage {0} is out of range; use a value from 0 to 100")]
    Percentage(f64),
    #[error("{what} {value} is negative; use 0 or more")]
    Negative { what: &'static str, value: i64 },
    #[error("{what} {value} is too large; use at most {max}")]
    TooLarge {
        what: &'static str,
        value: u64,
        max: u64,
    },
    #[error("HTTP status {0} is out of range; use a status from 200 to 599")]
    HttpStatus(i128),
    #[error(
        "{pattern:?} is not a valid regular expression ({reason}); fix the pattern (RE2 syntax)"
    )]
    Regex { pattern: String, reason: String },
}

/// Largest duration accepted: Go's (and so Istio's) `time.Duration` limit,
/// `i64::MAX` nanoseconds.
const MAX_DURATION_NANOS: u128 = i64::MAX as u128;

/// Parses an Istio (protobuf/Go) duration: `"1.5s"`, `"100ms"`, `"2m"`,
/// `"1h30m"`, `"0"`.
pub fn parse_istio_duration(input: &str) -> Result<Duration, ScalarError> {
    let bad = |reason| ScalarError::IstioDuration {
        input: input.to_string(),
        reason,
    };
    if input.starts_with('-') {
        return Err(ScalarError::NegativeDuration(input.to_string()));
    }
    let mut rest = input.strip_prefix('+').unwrap_or(input);
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(bad("it is empty"));
    }
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let whole = leading_digits(rest);
        rest = &rest[whole.len()..];
        let mut fraction = "";
        if let Some(after_dot) = rest.strip_prefix('.') {
            fraction = leading_digits(after_dot);
            rest = &after_dot[fraction.len()..];
        }
        if whole.is_empty() && fraction.is_empty() {
            return Err(bad("a number is missing"));
        }
        let unit_len = rest
            .find(|c: char| c == '.' || c.is_ascii_digit())
            .unwrap_or(rest.len());
        let nanos_per_unit: u128 = match &rest[..unit_len] {
            "ns" => 1,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "" => return Err(bad("a unit is missing")),
            _ => return Err(bad("unknown unit")),
        };
        rest = &rest[unit_len..];
        let too_large = || ScalarError::DurationTooLarge(input.to_string());
        let whole_value: u128 = if whole.is_empty() {
            0
        } else if whole.len() > 30 {
            return Err(too_large());
        } else {
            whole.parse().map_err(|_| bad("a number is missing"))?
        };
        // Digits past the 18th cannot change a nanosecond count.
        let fraction = &fraction[..fraction.len().min(18)];
        let fraction_nanos = if fraction.is_empty() {
            0
        } else {
            let digits: u128 = fraction.parse().map_err(|_| bad("a number is missing"))?;
            digits * nanos_per_unit / 10u128.pow(fraction.len() as u32)
        };
        total = whole_value
            .checked_mul(nanos_per_unit)
            .and_then(|n| n.checked_add(fraction_nanos))
            .and_then(|n| n.checked_add(total))
            .filter(|n| *n <= MAX_DURATION_NANOS)
            .ok_or_else(too_large)?;
    }
    Ok(nanos_to_duration(total))
}

/// Parses a Gateway API duration (GEP-2257): `"10s"`, `"500ms"`, `"1h30m"`.
pub fn parse_gateway_duration(input: &str) -> Result<Duration, ScalarError> {
    let bad = |reason| ScalarError::GatewayDuration {
        input: input.to_string(),
        reason,
    };
    if input.starts_with('-') {
        return Err(ScalarError::NegativeDuration(input.to_string()));
    }
    if input.is_empty() {
        return Err(bad("it is empty"));
    }
    let mut rest = input;
    let mut total: u128 = 0;
    let mut parts = 0;
    while !rest.is_empty() {
        parts += 1;
        if parts > 4 {
            return Err(bad("more than 4 parts"));
        }
        let digits = leading_digits(rest);
        if digits.is_empty() {
            return Err(bad("a whole number is missing"));
        }
        if digits.len() > 5 {
            return Err(bad("a number has more than 5 digits"));
        }
        rest = &rest[digits.len()..];
        let (nanos_per_unit, unit_len): (u128, usize) = if rest.starts_with("ms") {
            (1_000_000, 2)
        } else if rest.starts_with('h') {
            (3_600_000_000_000, 1)
        } else if rest.starts_with('m') {
            (60_000_000_000, 1)
        } else if rest.starts_with('s') {
            (1_000_000_000, 1)
        } else if rest.is_empty() {
            return Err(bad("a unit is missing"));
        } else {
            return Err(bad("a unit is not one of h, m, s, ms"));
        };
        rest = &rest[unit_len..];
        let value: u128 = digits
            .parse()
            .map_err(|_| bad("a whole number is missing"))?;
        total += value * nanos_per_unit;
    }
    Ok(nanos_to_duration(total))
}

fn leading_digits(s: &str) -> &str {
    let end = s.bytes().take_while(u8::is_ascii_digit).count();
    &s[..end]
}

fn nanos_to_duration(nanos: u128) -> Duration {
    let secs = (nanos / 1_000_000_000) as u64;
    Duration::new(secs, (nanos % 1_000_000_000) as u32)
}

/// Checks a percentage (0 to 100, fractions allowed).
pub fn check_percentage(value: f64) -> Result<f64, ScalarError> {
    if (0.0..=100.0).contains(&value) {
        Ok(value)
    } else {
        Err(ScalarError::Percentage(value))
    }
}

/// Checks that `pattern` is a valid regular expression. Istio and Envoy use
/// RE2; the syntax shared with Rust's `regex` (no look-around, no
/// back-references) is what RE2 accepts.
pub fn check_regex(pattern: &str) -> Result<(), ScalarError> {
    regex_syntax::ParserBuilder::new()
        .nest_limit(100)
        .build()
        .parse(pattern)
        .map(drop)
        .map_err(|e| ScalarError::Regex {
            pattern: pattern.to_string(),
            reason: match &e {
                regex_syntax::Error::Parse(p) => p.kind().to_string(),
                regex_syntax::Error::Translate(t) => t.kind().to_string(),
                other => other.to_string(),
            },
        })
}

/// Checks an integer against `0..=max`, naming the value (`weight`, ...).
fn check_count(what: &'static str, value: i128, max: u64) -> Result<u32, ScalarError> {
    if value < 0 {
        return Err(ScalarError::Negative {
            what,
            value: value.max(i64::MIN as i128) as i64,
        });
    }
    if value > max as i128 {
        return Err(ScalarError::TooLarge {
            what,
            value: value.min(u64::MAX as i128) as u64,
            max,
        });
    }
    Ok(value as u32)
}

// ------------------------------------------------------------ serde glue

/// A visitor for an integer that `check` turns into the field's value.
struct Integer<F>(F, &'static str);

impl<T, F: FnOnce(i128) -> Result<T, ScalarError>> Visitor<'_> for Integer<F> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.1)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        (self.0)(v.into()).map_err(E::custom)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        (self.0)(v.into()).map_err(E::custom)
    }
}

/// An `int32` count that must not be negative (retry attempts, connection
/// limits, Istio weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Count(u32);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_i64(Integer(
            |v| check_count("value", v, i32::MAX as u64).map(Count),
            "a whole number from 0 to 2147483647",
        ))
    }
}

/// Deserializes a non-negative `int32` (null: 0).
pub(crate) fn count<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    Ok(Option::<Count>::deserialize(d)?.map_or(0, |c| c.0))
}

/// Deserializes an optional non-negative `int32`.
pub(crate) fn optional_count<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    Ok(Option::<Count>::deserialize(d)?.map(|c| c.0))
}

/// An Istio route weight: a non-negative `int32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct IstioWeight(u32);

impl<'de> Deserialize<'de> for IstioWeight {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_i64(Integer(
            |v| check_count("weight", v, i32::MAX as u64).map(IstioWeight),
            "a weight (a whole number, 0 or more)",
        ))
    }
}

/// Deserializes an Istio weight (absent or null: 0).
pub(crate) fn istio_weight<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    Ok(Option::<IstioWeight>::deserialize(d)?.map_or(0, |w| w.0))
}

/// A Gateway API backend weight: 0 to 1,000,000.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GatewayWeight(u32);

impl<'de> Deserialize<'de> for GatewayWeight {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_i64(Integer(
            |v| check_count("weight", v, 1_000_000).map(GatewayWeight),
            "a weight (a whole number from 0 to 1000000)",
        ))
    }
}

/// Deserializes an optional Gateway API weight.
pub(crate) fn optional_gateway_weight<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<u32>, D::Error> {
    Ok(Option::<GatewayWeight>::deserialize(d)?.map(|w| w.0))
}

/// A whole-number percentage, 0 to 100 (deprecated `percent` fields,
/// ejection and health percentages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WholePercent(u32);

impl<'de> Deserialize<'de> for WholePercent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_i64(Integer(
            |v| {
                if (0..=100).contains(&v) {
                    Ok(WholePercent(v as u32))
                } else {
                    Err(ScalarError::Percentage(v as f64))
                }
            },
            "a percentage (a whole number from 0 to 100)",
        ))
    }
}

/// Deserializes an optional whole-number percentage.
pub(crate) fn optional_whole_percent<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<u32>, D::Error> {
    Ok(Option::<WholePercent>::deserialize(d)?.map(|p| p.0))
}

/// Deserializes a percentage value (0 to 100, fractions allowed).
pub(crate) fn percentage<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    struct V;
    impl Visitor<'_> for V {
        type Value = f64;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a percentage (a number from 0 to 100)")
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
            check_percentage(v).map_err(E::custom)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
            self.visit_f64(v as f64)
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
            self.visit_f64(v as f64)
        }
    }
    d.deserialize_f64(V)
}

/// A visitor for a duration string; a bare number (YAML `timeout: 5`, JSON
/// `"timeout": 5`) is read as its text, so the message says the unit is
/// missing.
struct DurationText(fn(&str) -> Result<Duration, ScalarError>, &'static str);

impl Visitor<'_> for DurationText {
    type Value = Duration;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.1)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
        (self.0)(v).map_err(E::custom)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
        self.visit_str(&v.to_string())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
        self.visit_str(&v.to_string())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Duration, E> {
        self.visit_str(&v.to_string())
    }
}

/// An Istio duration field's value.
struct IstioDuration(Duration);

impl<'de> Deserialize<'de> for IstioDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = DurationText(
            parse_istio_duration,
            "a duration such as \"1.5s\" or \"100ms\"",
        );
        d.deserialize_any(text).map(IstioDuration)
    }
}

/// A Gateway API duration field's value.
struct GatewayDuration(Duration);

impl<'de> Deserialize<'de> for GatewayDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = DurationText(
            parse_gateway_duration,
            "a duration such as \"10s\" or \"500ms\"",
        );
        d.deserialize_any(text).map(GatewayDuration)
    }
}

/// Deserializes an optional Istio duration.
pub(crate) fn optional_istio_duration<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Duration>, D::Error> {
    Ok(Option::<IstioDuration>::deserialize(d)?.map(|w| w.0))
}

/// Deserializes an optional Gateway API duration.
pub(crate) fn optional_gateway_duration<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Duration>, D::Error> {
    Ok(Option::<GatewayDuration>::deserialize(d)?.map(|w| w.0))
}

/// An HTTP status an Envoy filter can answer with: 200 to 599.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HttpStatus(u16);

impl<'de> Deserialize<'de> for HttpStatus {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_i64(Integer(
            |v| {
                if (200..=599).contains(&v) {
                    Ok(HttpStatus(v as u16))
                } else {
                    Err(ScalarError::HttpStatus(v))
                }
            },
            "an HTTP status (200 to 599)",
        ))
    }
}

/// Deserializes an HTTP status, 200 to 599.
pub(crate) fn http_status<'de, D: Deserializer<'de>>(d: D) -> Result<u16, D::Error> {
    HttpStatus::deserialize(d).map(|s| s.0)
}

/// Deserializes an optional HTTP status, 200 to 599.
pub(crate) fn optional_http_status<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<u16>, D::Error> {
    Ok(Option::<HttpStatus>::deserialize(d)?.map(|s| s.0))
}

/// Deserializes a required Istio duration.
pub(crate) fn istio_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    optional_istio_duration(d)?
        .ok_or_else(|| de::Error::custom("the duration is null; write a duration such as \"1.5s\""))
}

/// Deserializes a regular expression, checking its syntax (null: empty).
pub(crate) fn regex<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let pattern: String = crate::objects::nullable(d)?;
    check_regex(&pattern).map_err(de::Error::custom)?;
    Ok(pattern)
}

/// A value checked as soon as it is deserialized (a rule spanning several
/// of its fields), so a failing check carries the value's path and line.
pub(crate) trait CheckOnDecode {
    /// The module's error type.
    type Error: fmt::Display;
    /// What makes the value unusable on its own, if anything.
    fn check(&self) -> Result<(), Self::Error>;
}

/// Deserializes `T` and runs its [`CheckOnDecode::check`].
pub(crate) struct Checked<T>(pub T);

impl<'de, T: Deserialize<'de> + CheckOnDecode> Deserialize<'de> for Checked<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = T::deserialize(d)?;
        value.check().map_err(de::Error::custom)?;
        Ok(Checked(value))
    }
}

/// Deserializes a list of checked values (null: empty).
pub(crate) fn checked_list<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + CheckOnDecode,
{
    let list: Option<Vec<Checked<T>>> = Option::deserialize(d)?;
    Ok(list.unwrap_or_default().into_iter().map(|c| c.0).collect())
}

/// Deserializes an optional checked value.
pub(crate) fn checked_option<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + CheckOnDecode,
{
    Ok(Option::<Checked<T>>::deserialize(d)?.map(|c| c.0))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn istio_durations_table() {
        let ms = Duration::from_millis;
        let cases: [(&str, Option<Duration>); 18] = [
            ("1s", Some(ms(1_000))),
            ("0.5s", Some(ms(500))),
            ("1.5s", Some(ms(1_500))),
            ("100ms", Some(ms(100))),
            ("2m", Some(ms(120_000))),
            ("1h", Some(ms(3_600_000))),
            ("1h30m", Some(ms(5_400_000))),
            ("250us", Some(Duration::from_micros(250))),
            ("7ns", Some(Duration::from_nanos(7))),
            (".25s", Some(ms(250))),
            ("0", Some(Duration::ZERO)),
            ("0.000000001s", Some(Duration::from_nanos(1))),
            ("", None),
            ("10", None),
            ("1.5", None),
            ("5sec", None),
            ("-1s", None),
            ("99999999999h", None),
        ];
        for (input, want) in cases {
            assert_eq!(parse_istio_duration(input).ok(), want, "{input:?}");
        }
        let e = parse_istio_duration("5sec").unwrap_err().to_string();
        assert!(
            e.contains("unknown unit") && e.contains("e.g. \"1.5s\""),
            "{e}"
        );
        assert!(
            parse_istio_duration("-1s")
                .unwrap_err()
                .to_string()
                .contains("negative")
        );
    }

    #[test]
    fn gateway_durations_table() {
        let ms = Duration::from_millis;
        let cases: [(&str, Option<Duration>); 12] = [
            ("10s", Some(ms(10_000))),
            ("500ms", Some(ms(500))),
            ("2m", Some(ms(120_000))),
            ("1h30m", Some(ms(5_400_000))),
            ("1h1m1s1ms", Some(ms(3_661_001))),
            ("0s", Some(Duration::ZERO)),
            ("1.5s", None),
            ("100us", None),
            ("123456s", None),
            ("1h1m1s1ms1ms", None),
            ("0", None),
            ("", None),
        ];
        for (input, want) in cases {
            assert_eq!(parse_gateway_duration(input).ok(), want, "{input:?}");
        }
    }

    #[test]
    fn percentages_and_regexes() {
        assert_eq!(check_percentage(0.1).unwrap(), 0.1);
        assert!(check_percentage(150.0).is_err());
        assert!(check_percentage(-1.0).is_err());
        assert!(check_percentage(f64::NAN).is_err());
        assert!(check_regex("^/api/v[0-9]+/.*$").is_ok());
        let e = check_regex("/api/(v1").unwrap_err().to_string();
        assert!(
            e.contains("\"/api/(v1\" is not a valid regular expression"),
            "{e}"
        );
        assert!(check_regex("(?=x)").is_err(), "no look-around in RE2");
    }
}
