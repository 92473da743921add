"""spec layer (see docs/design.md)."""
