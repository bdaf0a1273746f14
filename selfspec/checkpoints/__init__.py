"""The checkpoint formats selfspec reads and writes: its own metadata (`selfspec.json`), a
model's files wherever they live (a folder or the Hub cache), and the published releases of
I-DLM and Jacobi Forcing recognised from what they carry.
"""
