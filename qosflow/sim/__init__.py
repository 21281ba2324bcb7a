"""Trace-driven simulation of GPU cluster scheduling: the same policy code the live worker runs."""
