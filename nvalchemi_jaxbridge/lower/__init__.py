"""lower layer (see docs/design.md)."""
