"""Byte-exact dedup."""
