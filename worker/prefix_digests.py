"""Digests of a prompt's prefixes (no torch: the API routes by them, workers key shared states by them).

A prefix's digest is sha256 of its token ids (uint32, little-endian), cut to 128 bits. Workers publish states and
advertise what they hold under the digest of a prefix rounded down to ``contract.STATE_BLOCK`` tokens, so a reader
computes one digest per block of its prompt (the hash state is kept at every block boundary: each digest costs at
most one block of hashing).
"""

from __future__ import annotations

import hashlib
from array import array

from worker import contract as c

DIGEST_CHARS = 32  # hex characters of a prefix digest


class PrefixDigests:
    """Digests of a prompt's prefixes: sha256 of the token ids (uint32, little-endian), the hash state kept at
    every block boundary, so each digest costs one block of hashing at most."""

    def __init__(self, tokens: list[int]):
        self._data = array("I", tokens)
        if self._data.itemsize != 4:  # pragma: no cover - every platform torch runs on
            raise RuntimeError("array('I') is not 32-bit here")
        self._n = len(tokens)
        h, self._at_block = hashlib.sha256(), []
        for k in range(self._n // c.STATE_BLOCK + 1):
            self._at_block.append(h.copy())
            h.update(self._data[k * c.STATE_BLOCK:(k + 1) * c.STATE_BLOCK].tobytes())

    def block(self, k: int) -> str:
        """The digest of the first ``k * STATE_BLOCK`` tokens."""
        return self._at_block[k].hexdigest()[:DIGEST_CHARS]

    def at(self, n: int) -> str:
        """The digest of the first ``n`` tokens."""
        k = n // c.STATE_BLOCK
        h = self._at_block[k].copy()
        h.update(self._data[k * c.STATE_BLOCK:n].tobytes())
        return h.hexdigest()[:DIGEST_CHARS]


def block_digest(tokens: list[int]) -> str:
    """The digest of ``tokens`` rounded down to STATE_BLOCK tokens (what a worker advertises it holds): one hash,
    without PrefixDigests' state at every block."""
    n = len(tokens) // c.STATE_BLOCK * c.STATE_BLOCK
    return hashlib.sha256(array("I", tokens[:n]).tobytes()).hexdigest()[:DIGEST_CHARS]
