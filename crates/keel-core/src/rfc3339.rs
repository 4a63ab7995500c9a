//! A UTC timestamp as RFC 3339 text, written digit by digit: every event's `ts` and every
//! timestamp SQLite stores is one, and chrono's formatting (its `Display` through `fmt::write`)
//! cost ~2,500 instructions each, about 2% of a HITL run. The text is chrono's, byte for byte (a
//! property test holds it to chrono's); a year outside 0–9999 or a leap second is left to chrono.

use chrono::{Datelike, SecondsFormat, Timelike};
use serde::Serializer;

use crate::domain::Timestamp;

/// How many digits of the second's fraction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fraction {
    /// As many as are not zero, in groups of three (none, 3, 6 or 9): chrono's `AutoSi`, and
    /// what chrono's `Serialize` writes.
    Auto,
    /// Always nine: fixed width, so that texts sort as the times do.
    Nanos,
}

/// The text; at most 30 bytes (`9999-12-31T23:59:59.999999999Z`) but for chrono's rare cases.
pub enum Text {
    Short { bytes: [u8; 30], len: usize },
    Long(String),
}

impl Text {
    pub fn as_str(&self) -> &str {
        match self {
            // only ASCII digits and separators are ever written into `bytes`
            Text::Short { bytes, len } => std::str::from_utf8(&bytes[..*len]).unwrap_or_default(),
            Text::Long(s) => s,
        }
    }
}

/// `t` as RFC 3339 in UTC (`…Z`), with `fraction`'s digits.
pub fn format(t: &Timestamp, fraction: Fraction) -> Text {
    let (year, nanos) = (t.year(), t.nanosecond());
    if !(0..=9999).contains(&year) || nanos >= 1_000_000_000 {
        let format = match fraction {
            Fraction::Auto => SecondsFormat::AutoSi,
            Fraction::Nanos => SecondsFormat::Nanos,
        };
        return Text::Long(t.to_rfc3339_opts(format, true));
    }
    let mut bytes = [0u8; 30];
    let mut len = 0;
    let mut put = |value: u32, width: usize, after: Option<u8>| {
        let mut v = value;
        for i in (0..width).rev() {
            bytes[len + i] = b'0' + (v % 10) as u8;
            v /= 10;
        }
        len += width;
        if let Some(separator) = after {
            bytes[len] = separator;
            len += 1;
        }
    };
    put(year as u32, 4, Some(b'-'));
    put(t.month(), 2, Some(b'-'));
    put(t.day(), 2, Some(b'T'));
    put(t.hour(), 2, Some(b':'));
    put(t.minute(), 2, Some(b':'));
    let digits = match fraction {
        Fraction::Nanos => 9,
        Fraction::Auto if nanos == 0 => 0,
        Fraction::Auto if nanos % 1_000_000 == 0 => 3,
        Fraction::Auto if nanos % 1_000 == 0 => 6,
        Fraction::Auto => 9,
    };
    put(t.second(), 2, (digits > 0).then_some(b'.'));
    if digits > 0 {
        put(nanos / 10u32.pow(9 - digits as u32), digits, None);
    }
    bytes[len] = b'Z';
    Text::Short { bytes, len: len + 1 }
}

/// A timestamp from RFC 3339 text, as chrono's `DateTime::parse_from_rfc3339` reads it (in UTC).
/// The form Keel writes (`YYYY-MM-DDTHH:MM:SS[.fraction]Z`) is read digit by digit; any other
/// (an offset, a leap second, a lowercase `t`, an error) is left to chrono, which also words the
/// error. Every timestamp SQLite returns is read here.
pub fn parse(text: &str) -> Result<Timestamp, chrono::ParseError> {
    match parse_utc(text.as_bytes()) {
        Some(t) => Ok(t),
        None => chrono::DateTime::parse_from_rfc3339(text).map(|t| t.with_timezone(&chrono::Utc)),
    }
}

fn parse_utc(b: &[u8]) -> Option<Timestamp> {
    let digits = |range: std::ops::Range<usize>| -> Option<u32> {
        b.get(range)?.iter().try_fold(0u32, |n, &c| c.is_ascii_digit().then(|| n * 10 + u32::from(c - b'0')))
    };
    let at = |i: usize, c: u8| b.get(i) == Some(&c);
    if !(at(4, b'-') && at(7, b'-') && at(10, b'T') && at(13, b':') && at(16, b':')) || b.last() != Some(&b'Z') {
        return None;
    }
    let (year, month, day) = (digits(0..4)?, digits(5..7)?, digits(8..10)?);
    let (hour, minute, second) = (digits(11..13)?, digits(14..16)?, digits(17..19)?);
    let nanos = match &b[19..b.len() - 1] {
        [] => 0,
        [b'.', fraction @ ..] if (1..=9).contains(&fraction.len()) => {
            digits(20..20 + fraction.len())? * 10u32.pow(9 - fraction.len() as u32)
        }
        _ => return None,
    };
    if second > 59 {
        return None;
    }
    let date = chrono::NaiveDate::from_ymd_opt(i32::try_from(year).ok()?, month, day)?;
    Some(date.and_hms_nano_opt(hour, minute, second, nanos)?.and_utc())
}

/// For `#[serde(serialize_with)]`: the text chrono's `Serialize` writes, without its formatter.
pub fn serialize<S: Serializer>(t: &Timestamp, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(format(t, Fraction::Auto).as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::DateTime;
    use proptest::strategy::Strategy;

    fn at(secs: i64, nanos: u32) -> Timestamp {
        DateTime::from_timestamp(secs, nanos).expect("a time chrono can hold")
    }

    proptest::proptest! {
        #[test]
        fn the_text_is_chronos(
            secs in -62_135_596_800i64..253_402_300_800,
            nanos in proptest::prop_oneof![
                proptest::strategy::Just(0u32),
                (0u32..1_000).prop_map(|ms| ms * 1_000_000),
                (0u32..1_000_000).prop_map(|us| us * 1_000),
                0u32..1_000_000_000,
            ],
        ) {
            let t = at(secs, nanos);
            let (auto, fixed) = (format(&t, Fraction::Auto), format(&t, Fraction::Nanos));
            proptest::prop_assert_eq!(format!("\"{}\"", auto.as_str()), serde_json::to_string(&t).unwrap());
            proptest::prop_assert_eq!(fixed.as_str(), t.to_rfc3339_opts(SecondsFormat::Nanos, true));
        }
    }

    proptest::proptest! {
        #[test]
        fn a_text_reads_back_as_its_time(
            secs in -62_135_596_800i64..253_402_300_800,
            nanos in 0u32..1_000_000_000,
        ) {
            let t = at(secs, nanos);
            for fraction in [Fraction::Auto, Fraction::Nanos] {
                proptest::prop_assert_eq!(parse(format(&t, fraction).as_str()), Ok(t));
            }
        }

        #[test]
        fn a_text_reads_as_chrono_reads_it(
            text in "[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{0,11})?(Z|z|[+-][0-9]{2}:[0-9]{2}|)",
        ) {
            let chrono = chrono::DateTime::parse_from_rfc3339(&text).map(|t| t.with_timezone(&chrono::Utc));
            proptest::prop_assert_eq!(parse(&text), chrono);
        }
    }

    #[test]
    fn texts_at_the_edges_read_as_chrono_reads_them() {
        for text in [
            "2030-01-01T12:00:00Z",
            "2030-01-01T12:00:00.1Z",
            "2030-01-01T12:00:00.123456789Z",
            "2030-01-01T12:00:00.1234567891Z",
            "2030-01-01T12:00:00.Z",
            "2030-02-29T12:00:00Z",
            "2028-02-29T23:59:59.999999999Z",
            "2030-01-01T23:59:60Z",
            "2030-01-01T24:00:00Z",
            "2030-13-01T00:00:00Z",
            "0000-01-01T00:00:00Z",
            "9999-12-31T23:59:59Z",
            "2030-01-01T12:00:00+02:00",
            "2030-01-01t12:00:00z",
            "2030-01-01T12:00:00",
            "2030-1-01T12:00:00Z",
            "",
            "Z",
        ] {
            let chrono = chrono::DateTime::parse_from_rfc3339(text).map(|t| t.with_timezone(&chrono::Utc));
            assert_eq!(parse(text), chrono, "{text:?}");
        }
    }

    #[test]
    fn edges_of_the_range_and_of_the_fraction() {
        for t in [at(0, 0), at(0, 1), at(0, 999_999_999), at(253_402_300_799, 999_999_999), at(-62_135_596_800, 0)] {
            assert_eq!(format(&t, Fraction::Nanos).as_str(), t.to_rfc3339_opts(SecondsFormat::Nanos, true));
            assert_eq!(format(&t, Fraction::Auto).as_str(), t.to_rfc3339_opts(SecondsFormat::AutoSi, true));
        }
        assert_eq!(format(&at(1_893_499_200, 120_000_000), Fraction::Auto).as_str(), "2030-01-01T12:00:00.120Z");
        assert_eq!(format(&at(1_893_499_200, 0), Fraction::Nanos).as_str(), "2030-01-01T12:00:00.000000000Z");
        // outside 0–9999: chrono's own text
        let far = at(253_402_300_800, 5);
        assert_eq!(format(&far, Fraction::Auto).as_str(), far.to_rfc3339_opts(SecondsFormat::AutoSi, true));
        assert!(matches!(format(&far, Fraction::Auto), Text::Long(_)));
    }
}
