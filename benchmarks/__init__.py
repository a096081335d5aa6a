"""Measurements of the runtime against its alternatives; not part of the installed package."""
