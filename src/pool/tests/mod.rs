//! The pool's tests: its rules one at a time ([`rules`]), and its properties under random interleavings, at the
//! level of slots and connections ([`properties`]) and of endpoints ([`endpoints`]).

mod endpoints;
mod properties;
mod rules;
