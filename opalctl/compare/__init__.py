"""Putting arms side by side across seeds: paired statistics, tables and plots."""
