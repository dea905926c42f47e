"""Protocols (what a person promised) and locks (what was frozen): schema, freeze and verify."""
