//! A request head in a line format through the header rewriting; see `floodgate::fuzzing::header_rewrite`.
#![no_main]

libfuzzer_sys::fuzz_target!(|bytes: &[u8]| floodgate::fuzzing::header_rewrite(bytes));
