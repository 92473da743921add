"""nvalchemi_jaxbridge: nvalchemi-toolkit's OpAdapter / DistributionSpec, lowered to JAX collectives.

The package root only re-exports. Importing it (and loading a spec file) imports
neither jax nor torch.
"""
