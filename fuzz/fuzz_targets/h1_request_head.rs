//! Client bytes through floodgate's own HTTP/1 head reader and hyper's server, which must agree; see
//! `floodgate::fuzzing::h1_request_head`.
#![no_main]

libfuzzer_sys::fuzz_target!(|bytes: &[u8]| floodgate::fuzzing::h1_request_head(bytes));
