"""Identities and signatures: the federation CA, Ed25519 frame signatures, the replay window on disk."""
