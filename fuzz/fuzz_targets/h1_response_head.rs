//! Upstream bytes through floodgate's own HTTP/1 head reader and hyper's client, which must agree; see
//! `floodgate::fuzzing::h1_response_head`.
#![no_main]

libfuzzer_sys::fuzz_target!(|bytes: &[u8]| floodgate::fuzzing::h1_response_head(bytes));
