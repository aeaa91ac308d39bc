//! A config file through floodgate's loader and validation; see `floodgate::fuzzing::config_file`.
#![no_main]

libfuzzer_sys::fuzz_target!(|bytes: &[u8]| floodgate::fuzzing::config_file(bytes));
