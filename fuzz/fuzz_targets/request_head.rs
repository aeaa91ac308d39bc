//! Client bytes through hyper's HTTP/1 server and floodgate's route + rewrite; see
//! `floodgate::fuzzing::request_head`.
#![no_main]

libfuzzer_sys::fuzz_target!(|bytes: &[u8]| floodgate::fuzzing::request_head(bytes));
