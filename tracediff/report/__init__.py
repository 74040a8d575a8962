"""Renderers of a compare report: they format findings, they never compute."""
