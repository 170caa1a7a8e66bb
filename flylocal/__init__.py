"""flylocal: speculative decoding on llama.cpp with loose, training-free verification."""

__version__ = "0.1.0"
