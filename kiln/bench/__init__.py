"""Benchmarks that ship with kiln (``kiln bench``): kiln beside Hugging Face transformers."""
