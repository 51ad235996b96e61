"""Tools for testing clients of Seedance: :mod:`seedance.testing.faults`."""
