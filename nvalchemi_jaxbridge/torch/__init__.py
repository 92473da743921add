"""torch layer (see docs/design.md)."""
