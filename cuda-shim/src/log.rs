//! Logging to stderr, off by default. `LOGGER_LEVEL` (as the original
//! interposer): 0/off, 1/error, 2/warn, 3/info, 4/debug, 5/trace. The
//! fail-closed reasons are printed whatever the level: they are the one line
//! a user needs to see.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Off = 0,
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
    Trace = 5,
}

pub fn parse_level(s: &str) -> Level {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "error" => Level::Error,
        "2" | "warn" | "warning" => Level::Warn,
        "3" | "info" => Level::Info,
        "4" | "debug" | "verbose" => Level::Debug,
        "5" | "trace" | "detail" => Level::Trace,
        _ => Level::Off,
    }
}

pub fn level() -> Level {
    static L: OnceLock<Level> = OnceLock::new();
    *L.get_or_init(|| {
        std::env::var("LOGGER_LEVEL")
            .map(|v| parse_level(&v))
            .unwrap_or(Level::Off)
    })
}

pub fn enabled(l: Level) -> bool {
    l != Level::Off && l <= level()
}

/// Writes one line with a single write(2), so lines from threads and
/// processes do not interleave.
pub fn write_line(msg: &str) {
    let line = format!("vcuda[{}]: {msg}\n", std::process::id());
    // SAFETY: write(2) reads `line.len()` bytes of the live `line`; fd 2 is only written, never
    // closed here.
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}

/// Prints a fail-closed reason once per process, whatever the level.
pub fn fail_closed(msg: &str) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::AcqRel) {
        write_line(msg);
    }
}

macro_rules! log {
    ($lvl:ident, $($arg:tt)*) => {
        if $crate::log::enabled($crate::log::Level::$lvl) {
            $crate::log::write_line(&format!($($arg)*));
        }
    };
}
pub(crate) use log;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels() {
        assert_eq!(parse_level("0"), Level::Off);
        assert_eq!(parse_level(""), Level::Off);
        assert_eq!(parse_level("3"), Level::Info);
        assert_eq!(parse_level("WARN"), Level::Warn);
        assert_eq!(parse_level("5"), Level::Trace);
        assert!(Level::Error < Level::Debug);
    }
}
