"""Pure decision code: snapshots in, decisions out.

Purely computational, no side effects: this package imports numpy and scipy only (an import-linter
contract in CI enforces it). Everything a policy may read arrives in a frozen snapshot that carries
``now``; every result carries a machine-readable reason and a human sentence.
"""
