"""Unit and property tests: pure functions and classes, in-process, no daemons."""
