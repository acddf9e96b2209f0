"""Speculative decoding: drafters, chain and tree verification, and the options per request."""
