"""Counters as data (counters.py) and their renderers (render.py)."""
