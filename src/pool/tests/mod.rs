//! The pool's tests: its rules one at a time ([`rules`]), and its properties under random interleavings, at the
//! level of slots and connections ([`properties`]) and of endpoints ([`endpoints`]); which idle connection a worker
//! thread is given ([`homes`]).

mod endpoints;
mod homes;
mod properties;
mod rules;
