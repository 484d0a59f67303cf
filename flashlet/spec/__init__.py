"""Speculative decoding: proposers and the verification of their guesses."""
