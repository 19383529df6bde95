"""Shipped data files (topology presets)."""
