"""selfspec: self-speculative parallel decoding (ISD, RISD, Jacobi, SJD) for SGLang."""

__version__ = "0.1.0"
