//! An upstream's answer relayed by a whole floodgate to an HTTP/1 client; see
//! `floodgate::fuzzing::upstream_response`.
#![no_main]

libfuzzer_sys::fuzz_target!(|bytes: &[u8]| floodgate::fuzzing::upstream_response(bytes));
