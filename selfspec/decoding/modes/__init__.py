"""The decoding modes and their verify rules: AR, ISD / RISD, Jacobi (+ its n-gram pool), SJD,
the n-gram baseline and the context candidates (with the corpus of served text they draw on),
greedy / p/q verification and the tree verify of candidate branches.
"""
