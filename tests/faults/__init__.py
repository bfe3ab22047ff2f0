"""Fault-injection suite (issue #18); the table is filled in below once the suite runs."""
