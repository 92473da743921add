"""layout layer (see docs/design.md)."""
