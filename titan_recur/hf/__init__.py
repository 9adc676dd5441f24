"""Hugging Face export: configuration and modeling code shipped into exported folders, and the exporter.

``configuration_titan_recur.py`` is copied verbatim; ``modeling_titan_recur.py`` is the wrapper that
``export.standalone_modeling_source`` ships with titan_recur's model code inlined. See docs/hf.md.
"""
